"""A plain training step with transformers' output layer + cross-entropy against the same step with ours
(`linear_ce_ntl_loss`, CE + 0.3·NTL-WAS; torch and, where it runs, Triton backend), and through the drop-in
(`apply_ntl`: the patched forward, backend auto), whose row less the head's is what the drop-in's plumbing costs:
issue 48's "our head no slower than transformers' dense head + CE" on the SmolLM2-135M shape (30 × 576, vocabulary
49,152 tied, sequence 2,048, micro-batch 8), bf16 autocast over fp32 weights, SDPA, fused AdamW on the device, no
DeepSpeed (as bench/plain_step.py). The heads take turns step by step (the order rotated every step) on one model
and batch; medians of `--steps` after `--warmup`, each over transformers'.

    python bench/head_step.py --out head-step.json [--device cuda] [--steps 20] [--warmup 5] [KEY=VALUE ...]

KEY=VALUE as bench/plain_step.py's (Llama config keys, seq_len, micro_batch_size); the number vocabulary is
Llama-3-like (1-3-digit chunks) over the model's vocabulary size. bench/gpu_heads.py --step runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ntl_pretrain.doctor.loss_checks import multi_digit_surfaces, multi_digit_vocab
from ntl_pretrain.loss.backend import interpreter_ready, why_triton_cannot_run
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss

MODEL_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
              "max_position_embeddings": 2048}  # fmt: skip
BATCH_135M = {"seq_len": 2048, "micro_batch_size": 8}
BASELINE = "transformers head + CE"
DROP_IN = "apply_ntl CE+NTL-WAS"
Head = Callable[[LlamaForCausalLM, torch.Tensor], torch.Tensor]


def transformers_loss(lm: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward and loss (logits upcast to fp32), called past the drop-in's instance patch."""
    return type(lm).forward(lm, input_ids=input_ids, labels=input_ids).loss


class Surfaces:
    """What `apply_ntl` reads of a tokenizer (`len` and `convert_ids_to_tokens`), for `multi_digit_vocab`'s ids."""

    def __init__(self, vocab_size: int):
        self.surfaces = multi_digit_surfaces(vocab_size)

    def __len__(self) -> int:
        return len(self.surfaces)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.surfaces[i] for i in ids]


def drop_in(lm: LlamaForCausalLM) -> Head:
    """`lm` patched by `apply_ntl` (kind was, λ 0.3, backend auto) over the same number tokens as `our_head`."""
    from ntl_pretrain.integrations import apply_ntl

    apply_ntl(lm, Surfaces(lm.config.vocab_size), kind="was", ntl_weight=0.3)
    return lambda lm, input_ids: lm(input_ids=input_ids, labels=input_ids).loss


def our_head(backend: str, vocab_size: int, device: torch.device) -> Head:
    """The trunk's hidden states through `linear_ce_ntl_loss`, in autocast's dtype (bf16 on a GPU)."""
    nv = multi_digit_vocab(vocab_size).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def loss(lm: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = lm.model(input_ids=input_ids).last_hidden_state[:, :-1]
        return linear_ce_ntl_loss(hidden.to(dtype), lm.lm_head.weight.to(dtype), input_ids[:, 1:], nv,
                                  backend=backend).loss  # fmt: skip

    return loss


def step_seconds(lm, optimizer, input_ids, device: torch.device, head: Head) -> float:
    """One step with `head`'s loss."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = head(lm, input_ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure_heads(config: dict, batch: dict, device: torch.device, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(device)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=device.type == "cuda")
    input_ids = torch.randint(0, lm.config.vocab_size, (batch["micro_batch_size"], batch["seq_len"]), device=device)
    triton_reason = why_triton_cannot_run(device.type, torch.bfloat16, interpreter_ready())
    heads: dict[str, Head] = {BASELINE: transformers_loss}
    heads["chunked head CE+NTL-WAS"] = our_head("torch", lm.config.vocab_size, device)
    if triton_reason is None:
        heads["chunked head CE+NTL-WAS [triton]"] = our_head("triton", lm.config.vocab_size, device)
    heads[DROP_IN] = drop_in(lm)
    names, times = list(heads), {name: [] for name in heads}
    for step in range(warmup + steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            seconds = step_seconds(lm, optimizer, input_ids, device, heads[name])
            if step >= warmup:
                times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    rows = {name: {"step_seconds": median, "over_transformers": median / medians[BASELINE]}
            for name, median in medians.items()}  # fmt: skip
    return {"shape": {**config, **batch}, "triton": triton_reason or "measured", "heads": rows}


def main(argv: list[str] | None = None) -> None:
    from plain_step import parse_settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("settings", nargs="*", help="Llama config keys, seq_len, micro_batch_size (KEY=VALUE)")
    args = parser.parse_args(argv)
    config, batch = parse_settings(args.settings)
    report = measure_heads({**MODEL_135M, **config}, {**BATCH_135M, **batch}, torch.device(args.device), args.steps,
                           args.warmup)  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, figures in report["heads"].items():
        print(f"  {name:34} {figures['step_seconds'] * 1e3:8.1f} ms ({figures['over_transformers']:.2f}x)")


if __name__ == "__main__":
    main()
