"""What the manifest's checksums add to a checkpoint save: `torch.save` of fp32 tensors to a file, then xxh3-64
(the manifest's) and zlib's CRC-32 over the file just written, interleaved.

    python bench/checkpoint_checksum.py [--megabytes 512] [--dir /path/on/the/checkpoint/filesystem] [--repeats 3]

A rank checksums its files right after writing them, so they are read back from the page cache; on a network
filesystem that evicts them the read-back costs a read of the file. Prints the median of each and the ratio
checksum / save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from ntl_pretrain.manifest import BLOCK_BYTES, checksum


def crc32(path: Path) -> int:
    value = 0
    with path.open("rb") as file:
        while block := file.read(BLOCK_BYTES):
            value = zlib.crc32(block, value)
    return value


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=512, help="size of the saved state")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # Like a ZeRO shard: a few large fp32 tensors (master weights, two Adam moments).
    numel = args.megabytes * (1 << 20) // 4 // 3
    state = {name: torch.randn(numel) for name in ("fp32", "exp_avg", "exp_avg_sq")}
    times = {"save": [], "xxh3_64": [], "crc32": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "optim_states.pt"
        for _ in range(args.repeats):
            times["save"].append(timed(lambda: torch.save(state, path)))
            times["xxh3_64"].append(timed(lambda: checksum(path)))
            times["crc32"].append(timed(lambda: crc32(path)))
        size = path.stat().st_size
    save = statistics.median(times["save"])
    print(f"state {size / 1e6:.0f} MB, median of {args.repeats}")
    print(f"torch.save      {save:7.3f} s  {size / save / 1e9:5.2f} GB/s")
    for name in ("xxh3_64", "crc32"):
        seconds = statistics.median(times[name])
        print(f"{name:<15} {seconds:7.3f} s  {size / seconds / 1e9:5.2f} GB/s  {seconds / save:6.1%} of the save")


if __name__ == "__main__":
    main()
