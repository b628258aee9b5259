"""What checksumming a ZeRO shard costs: while `torch.save` writes it (`manifest.HashingWriter`, what a save does
now) against reading it back afterwards (`manifest.checksum`, what a save did before), beside a plain save.

    python bench/hashing_writer.py [--megabytes 400] [--rounds 5]

One state dict of fp32 tensors (a shard's shape: a few large flat tensors), saved round-robin the three ways into a
temporary folder, DeepSpeed's serialisation (`_use_new_zipfile_serialization=False`); fastest of `--rounds` each.
The read-back comes from the page cache here; on a network filesystem that evicts the file it is a read of it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ntl_pretrain.checkpoint import manifest


def plain(state: dict, path: Path) -> None:
    torch.save(state, path, _use_new_zipfile_serialization=False)


def hashed_while_writing(state: dict, path: Path) -> None:
    with manifest.HashingWriter(path) as file:
        torch.save(state, file, _use_new_zipfile_serialization=False)
    file.entry()


def read_back(state: dict, path: Path) -> None:
    plain(state, path)
    manifest.checksum(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    elements = args.megabytes * 10**6 // 4
    state = {f"fp32_flat_group_{i}": torch.randn(elements // 4) for i in range(4)}
    ways = {"torch.save": plain, "hashed while writing": hashed_while_writing, "save, then read back": read_back}
    best = dict.fromkeys(ways, float("inf"))
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for name, way in ways.items():
                path = Path(folder) / "shard.pt"
                started = time.perf_counter()
                way(state, path)
                best[name] = min(best[name], time.perf_counter() - started)
                path.unlink()
    for name, seconds in best.items():
        print(f"{name:22} {seconds:7.3f} s   {seconds / best['torch.save'] - 1:+6.1%}")


if __name__ == "__main__":
    main()
