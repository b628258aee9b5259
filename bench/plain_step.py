"""The training step without DeepSpeed: the yardstick for `ntl-pretrain train`'s step on the same model.

The first GPU run (docs/benchmarks.md, "GPU") found our step at 3.4% MFU on a 135M Llama, bound by per-layer
overhead. This times the plainest fast step of the same model on the same batch: transformers' Llama, SDPA, bf16
autocast over fp32 weights, its own cross-entropy, fused AdamW on the device; no ZeRO, no hooks, no NTL. Medians
of `--steps` after `--warmup`, with the device synchronised around each step. bench/gpu_first_run.py compares it
with its train_125m stage; the ratio says how much of our step is the training stack, not the arithmetic.

    python bench/plain_step.py --out plain-step.json [--device cuda] [--steps 20] [--warmup 5] [--compile]
        [KEY=VALUE ...]

--compile: the model under `torch.compile` (the plain step at its fastest; its first step compiles, and is
reported apart as `first_step_seconds`).
--matmul-rate: also measure the device's dense bf16 matmul rate (the doctor's: 8192³, fastest of 10; on CPU 512³)
and report MFU against it (`mfu_of_matmul`) beside MFU of the datasheet peak.

KEY=VALUE are the Llama config's keys (hidden_size=576 ...) plus seq_len and micro_batch_size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ntl_pretrain.model.build import model_flops_per_token
from ntl_pretrain.reporting.metrics import device_peak_flops, mfu

BATCH_KEYS = {"seq_len": 2048, "micro_batch_size": 8}


def parse_settings(pairs: list[str]) -> tuple[dict, dict]:
    """(Llama config keys, batch keys) from KEY=VALUE; values are ints, or `true`/`false`."""
    config, batch = {}, dict(BATCH_KEYS)
    for pair in pairs:
        key, _, text = pair.partition("=")
        value = {"true": True, "false": False}.get(text.lower(), None)
        value = int(text) if value is None else value
        (batch if key in BATCH_KEYS else config)[key] = value
    return config, batch


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(lm, optimizer, input_ids, device: torch.device) -> float:
    synchronise(device)
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = lm(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronise(device)
    return time.perf_counter() - started


def measure(config: dict, batch: dict, device: torch.device, steps: int, warmup: int, compile: bool = False) -> dict:
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(device)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=device.type == "cuda")
    model = torch.compile(lm) if compile else lm
    shape = (batch["micro_batch_size"], batch["seq_len"])
    input_ids = torch.randint(0, lm.config.vocab_size, shape, device=device)
    all_times = [step_seconds(model, optimizer, input_ids, device) for _ in range(warmup + steps)]
    times = all_times[warmup:]
    seconds = statistics.median(times)
    tokens_per_s = shape[0] * shape[1] / seconds
    peak = device_peak_flops(device, "bf16")
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "config": config,
            "flops_per_token": model_flops_per_token(lm, shape[1]),
            **batch, "parameters": sum(p.numel() for p in lm.parameters()), "step_seconds": seconds,
            "tokens_per_s": tokens_per_s, "mfu": mfu(model_flops_per_token(lm, shape[1]), tokens_per_s, peak, 1),
            "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            "compiled": compile, "first_step_seconds": all_times[0]}  # fmt: skip


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a dense bf16 matmul on `device`: the doctor's measurement on a GPU, a 512³ one on CPU (dry runs)."""
    if device.type == "cuda":
        from ntl_pretrain.doctor.training import matmul_flops

        return matmul_flops(device)
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    started = time.perf_counter()
    a @ a
    return 2.0 * 512**3 / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="the model under torch.compile")
    parser.add_argument("--matmul-rate", action="store_true", help="MFU against the measured bf16 matmul rate too")
    parser.add_argument("settings", nargs="*", help="Llama config keys, seq_len, micro_batch_size (KEY=VALUE)")
    args = parser.parse_args(argv)
    config, batch = parse_settings(args.settings)
    report = measure(config, batch, torch.device(args.device), args.steps, args.warmup, args.compile)
    if args.matmul_rate:
        rate = matmul_rate(torch.device(args.device))
        report.update(matmul_flops=rate, mfu_of_matmul=mfu(report["flops_per_token"], report["tokens_per_s"], rate, 1))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    seconds, tokens_per_s = report["step_seconds"], report["tokens_per_s"]
    kind = "compiled plain step" if args.compile else "plain step"
    print(f"{kind}: {seconds * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s, MFU {report['mfu']}")


if __name__ == "__main__":
    main()
