"""Step time of CE + λ·NTL relative to CE only, measured side by side in one process.

Two engines with the same recipe, initial weights and batches (one with `loss.ntl.kind: was`, one with
`loss.ntl.kind: null`, which runs the same fused loss path without the NTL term) take turns step by step, so
machine noise hits both alike (the order flips every step). Printed: median step times, and the median of the
per-step ratios (paired, so slow phases of the machine cancel).

    python bench/train_step.py [--recipe RECIPE] [--steps 40] [key.path=value ...]
Defaults to recipes/tiny-cpu.yaml on one CPU process (DeepSpeed ZeRO-3, gloo); run it under `deepspeed
--num_gpus N bench/train_step.py ...` for several ranks or GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.runtime.process_group import free_port
from ntl_pretrain.train.main import init_distributed
from ntl_pretrain.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def single_process_defaults() -> None:
    """Let `python bench/train_step.py` run without a launcher (one rank)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def build(recipe_path: str, overrides: list[str], kind: str, output_dir: str) -> Trainer:
    run_overrides = [*overrides, f"loss.ntl.kind={kind}", f"train.output_dir={output_dir}", "train.resume=null"]
    recipe, ds_config = load_run(recipe_path, run_overrides, int(os.environ["WORLD_SIZE"]))
    return Trainer(recipe, ds_config)


def timed_step(trainer: Trainer, batches: list[dict]) -> float:
    dist.barrier()
    started = time.perf_counter()
    trainer.train_step(batches)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    single_process_defaults()
    init_distributed()
    with tempfile.TemporaryDirectory() as scratch:
        trainers = {kind: build(args.recipe, args.overrides, kind, f"{scratch}/{kind}") for kind in ("was", "null")}
        batches = iter(trainers["was"].loader)
        times = {kind: [] for kind in trainers}
        for step in range(WARMUP_STEPS + args.steps):
            micro = [next(batches) for _ in range(trainers["was"].grad_accum)]
            order = list(trainers) if step % 2 == 0 else list(reversed(trainers))  # cancel who-goes-first effects
            for kind in order:
                seconds = timed_step(trainers[kind], micro)
                if step >= WARMUP_STEPS:
                    times[kind].append(seconds)
    if dist.get_rank() == 0:
        report(trainers["was"], times)
    dist.destroy_process_group()


def report(trainer: Trainer, times: dict[str, list[float]]) -> None:
    lm, recipe = trainer.built.module.lm, trainer.recipe
    median = {kind: statistics.median(values) for kind, values in times.items()}
    config = lm.config
    train = recipe.train
    print(f"model: {config.model_type} hidden={config.hidden_size} layers={config.num_hidden_layers} "
          f"vocab={config.vocab_size}; seq_len={recipe.data.seq_len} micro_batch={train.micro_batch_size} "
          f"grad_accum={trainer.grad_accum} ranks={dist.get_world_size()} precision={train.precision}")  # fmt: skip
    for kind, seconds in median.items():
        print(f"  loss.ntl.kind={kind:<5} median step {seconds * 1e3:8.2f} ms over {len(times[kind])} steps")
    paired = statistics.median(a / b for a, b in zip(times["was"], times["null"], strict=True))
    print(
        f"step-time ratio CE+NTL / CE-only: {paired:.3f} (median of paired steps; ratio of medians "
        f"{median['was'] / median['null']:.3f})"
    )


if __name__ == "__main__":
    main()
