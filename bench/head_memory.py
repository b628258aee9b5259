"""Peak memory and step time of the trainer with `loss.head: chunked` against `loss.head: dense`, and the peak of a
plain Hugging Face model under the same DeepSpeed engine with transformers' own loss (`model(input_ids,
labels=...)`, which materialises the logits, upcasts them to fp32 and runs torch's cross-entropy).

Llama-3's vocabulary (V = 128,256), hidden size 128, 4,096 tokens per micro-batch (8 x 512), fp32, one CPU rank
(ZeRO-3 on gloo), a few training steps. Each variant runs in its own process, because the CPU figure is the
process's maximum resident set size (`ru_maxrss`, a lifetime high-water mark: the trainer's `peak_mem_mib`).
Printed: peak MiB and median step time of each, and the chunked/dense ratios.

    python bench/head_memory.py [--steps 3] [--repeats 1]
`--repeats` runs the chunked and dense processes that many times each, alternating, and keeps each one's fastest
median step (the machine's other load then hits both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
SETTINGS = [
    "model.config.vocab_size=128256", "model.config.hidden_size=128", "model.config.intermediate_size=512",
    "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
    "data.seq_len=512", "train.micro_batch_size=8", "train.global_batch_size=8", "train.eval_every_steps=null",
    "logging.progress_bar=false", "train.resume=null",
]  # fmt: skip
VARIANTS = ("chunked", "dense", "transformers")


def worker(variant: str, steps: int, output_dir: str) -> dict:
    """Train `steps` steps in this process; return its peak memory and step times."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    from ntl_pretrain.runtime.process_group import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from ntl_pretrain.config.deepspeed import load_run
    from ntl_pretrain.reporting.metrics import peak_memory_mib
    from ntl_pretrain.train.main import init_distributed
    from ntl_pretrain.train.trainer import Trainer

    init_distributed()
    head = "dense" if variant == "transformers" else variant
    recipe, ds_config = load_run(RECIPE, [*SETTINGS, f"loss.head={head}", f"train.output_dir={output_dir}"], 1)
    if variant == "transformers":
        run_step = transformers_loss_steps(recipe, ds_config)
    else:
        trainer = Trainer(recipe, ds_config)
        batches = iter(trainer.loader)
        run_step = lambda: trainer.train_step([next(batches) for _ in range(trainer.grad_accum)])  # noqa: E731
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - started)
    return {"variant": variant, "peak_mib": peak_memory_mib("cpu"), "step_s": statistics.median(times)}


def transformers_loss_steps(recipe, ds_config):
    """A step of the plain HF model (the same ZeRO-3 engine, optimizer and batches) with transformers' loss."""
    import deepspeed
    import torch

    from ntl_pretrain.data import build_dataloader
    from ntl_pretrain.model.build import build_model, parameter_groups
    from ntl_pretrain.tokenizer import load_tokenizer

    class TransformersLoss(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, labels, position_ids):
            return self.lm(input_ids=input_ids, position_ids=position_ids, labels=labels).loss

    tokenizer = load_tokenizer(recipe.tokenizer.path)
    module = TransformersLoss(build_model(recipe, tokenizer, ds_config).module.lm)
    optimizer = torch.optim.AdamW(parameter_groups(module, recipe.optimizer.weight_decay), lr=recipe.optimizer.lr)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config)
    loader = build_dataloader(recipe.data, tokenizer, micro_batch_size=recipe.train.micro_batch_size, dp_rank=0,
                              dp_world_size=1, seed=recipe.seed)  # fmt: skip
    batches = iter(loader)

    def step() -> None:
        batch = next(batches)
        loss = engine(**{key: batch[key] for key in ("input_ids", "labels", "position_ids")})
        engine.backward(loss)
        engine.step()

    return step


def run_worker(variant: str, steps: int) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([sys.executable, __file__, "--worker", variant, "--steps", str(steps), "--out", scratch],
                              env=env, capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.out)))
        return
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant in ("chunked", "dense"):
            results[variant].append(run_worker(variant, args.steps))
    results["transformers"].append(run_worker("transformers", args.steps))
    best = {variant: min(runs, key=lambda r: r["step_s"]) for variant, runs in results.items()}
    print("V=128,256 hidden=128, 4,096 tokens per micro-batch, fp32, 1 CPU rank (ZeRO-3, gloo), "
          f"{args.steps} steps, each variant in its own process")  # fmt: skip
    for variant, result in best.items():
        print(f"  {variant:<12} peak {result['peak_mib']:9.0f} MiB   median step {result['step_s'] * 1e3:8.0f} ms")
    chunked, dense, plain = best["chunked"], best["dense"], best["transformers"]
    print(f"chunked / dense: peak memory {chunked['peak_mib'] / dense['peak_mib']:.3f}, "
          f"step time {chunked['step_s'] / dense['step_s']:.3f}")  # fmt: skip
    print(f"chunked / transformers' own loss: peak memory {chunked['peak_mib'] / plain['peak_mib']:.3f}")


if __name__ == "__main__":
    main()
