"""What the manifest's checksums add to a checkpoint save, measured inside the trainer's own saves.

    python bench/checkpoint_checksum.py [--hidden 512] [--layers 8] [--saves 3]

Runs the tiny recipe with a wider, deeper Llama (1 CPU rank, fp32, ZeRO-3; `--hidden 512 --layers 8` is 29M
parameters, a ~350 MB checkpoint) for `--saves` steps with a checkpoint after each, and times every
`checkpoint.save` and, inside it, `manifest.describe`. The model and optimizer files are checksummed while they are
written (`manifest.HashingWriter` is the file DeepSpeed's writer writes into), so their hashing is inside the save's
own time and not separated here; `describe` then reads back only the files not hashed that way (recipe, tokenizer,
config, small rank states). Prints each save and what `describe` adds to it. The hashing-while-writing cost was
measured against a plain `torch.save` by bench/hashing_writer.py (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(module, name: str, seconds: list[float]) -> None:
    """Replace `module.name` by a wrapper that appends each call's wall time to `seconds`."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(module, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from ntl_pretrain.checkpoint import manifest
    from ntl_pretrain.checkpoint import store as checkpoint
    from ntl_pretrain.train import main as train

    saves, checksums = [], []
    timed(checkpoint, "save", saves)
    timed(manifest, "describe", checksums)
    with tempfile.TemporaryDirectory() as output_dir:
        overrides = [
            f"train.output_dir={output_dir}", f"train.max_steps={args.saves}", "checkpoint.every_steps=1",
            f"checkpoint.keep_last={args.saves}", "train.precision=fp32", "data.seq_len=32",
            "train.micro_batch_size=1", "train.global_batch_size=1", "logging.progress_bar=false",
            f"model.config.hidden_size={args.hidden}", f"model.config.intermediate_size={4 * args.hidden}",
            f"model.config.num_hidden_layers={args.layers}", "train.eval_every_steps=null",
        ]  # fmt: skip
        train.main([str(REPO / "recipes" / "tiny-cpu.yaml"), *overrides])
        size = sum(path.stat().st_size for path in (Path(output_dir) / "checkpoints" / "step_1").rglob("*"))
    print(f"checkpoint {size / 1e6:.0f} MB; per save: the save without checksums, the checksums, what they add")
    for save, checksum in zip(saves, checksums, strict=True):
        print(f"save {save - checksum:6.3f} s   checksums {checksum:6.3f} s   +{checksum / (save - checksum):5.1%}")
    rest, checksum = sum(saves) - sum(checksums), sum(checksums)
    print(f"all  {rest:6.3f} s   checksums {checksum:6.3f} s   +{checksum / rest:5.1%}")


if __name__ == "__main__":
    main()
