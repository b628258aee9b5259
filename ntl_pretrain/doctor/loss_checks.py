"""Check 3: the loss on this device, every kind, fp32 and bf16, against float64 on CPU.

The reference is `ce_ntl_loss` itself run in float64 on CPU, whose math the test suite checks against independent
dense float64 formulas and the `ntloss` package; what this check adds is the device: its kernels, its bf16, its
collectives. Inputs are drawn in float64 and rounded to the checked dtype; the reference gets the rounded values,
so the tolerances measure the computation, not the input rounding:

  loss      |loss - ref| / |ref|                    fp32 and bf16 logits: 1e-5 (the math runs in fp32 for both)
  gradient  max|grad - ref| / max|ref|              fp32: 1e-4; bf16: 1e-2 (the gradient is stored in bf16)
  chunked head (logits = hidden @ weight.T in the checked dtype): loss fp32 1e-5, bf16 1e-3; gradient 1e-4, 5e-2

Measured on CPU (2026-11-24), the worst of the cases: fused 7.5e-8 / 1.4e-6 (fp32), 1.9e-7 / 3.6e-3 (bf16); chunked
7.7e-8 / 2.9e-6 (fp32), 6.1e-5 / 2.1e-2 (bf16). A wrong formula or kernel is off by far more (1e-2 and up).

Two vocabularies: the tiny recipe's single-digit tokenizer, and a Llama-3-like one of 1-3 digit chunks, so that
kind "number" assembles numbers from multi-digit tokens. With 2+ ranks, the vocabulary-parallel forms (fused and
chunked, fp32) run across all ranks, each holding a slice of the vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.report import Check
from ntl_pretrain.heads.vocab_parallel_layer import vocab_bounds
from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

TOLERANCES = {  # (path, dtype): (loss, gradient), relative as in the module docstring
    ("fused", torch.float32): (1e-5, 1e-4),
    ("fused", torch.bfloat16): (1e-5, 1e-2),
    ("chunked", torch.float32): (1e-5, 1e-4),
    ("chunked", torch.bfloat16): (1e-3, 5e-2),
}
POSITIONS, HIDDEN, NTL_WEIGHT = 600, 32, 0.3
MULTI_DIGIT_VOCAB = 4096


def multi_digit_surfaces(vocab_size: int) -> list[str | None]:
    """Llama-3's number tokens: every chunk of 1-3 digits ("7", "07", "007"), here after 1,000 word tokens (None)."""
    chunks = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)] + [f"{i:03d}" for i in range(1000)]
    return [None] * 1000 + chunks + [None] * (vocab_size - 1000 - len(chunks))


def multi_digit_vocab(vocab_size: int) -> NumberVocab:
    """The number vocabulary of `multi_digit_surfaces`."""
    return NumberVocab.from_surfaces(multi_digit_surfaces(vocab_size))


def vocabularies() -> dict[str, NumberVocab]:
    from ntl_pretrain.tokenizer import load_tokenizer

    tiny = load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer")
    return {"single-digit": NumberVocab.from_tokenizer(tiny), "1-3 digit": multi_digit_vocab(MULTI_DIGIT_VOCAB)}


def draw_labels(nv: NumberVocab, generator: torch.Generator, positions: int = POSITIONS) -> torch.Tensor:
    """Word tokens with runs of 1-4 number tokens (whole numbers for kind "number") and 5% ignored positions."""
    vocab_size, number_ids = nv.vocab_size, nv.number_ids
    is_number = torch.zeros(vocab_size, dtype=torch.bool)
    is_number[number_ids] = True
    words = (~is_number).nonzero().flatten()
    labels = words[torch.randint(len(words), (positions,), generator=generator)]
    for start in torch.randint(positions - 4, (positions // 8,), generator=generator).tolist():
        length = int(torch.randint(1, 5, (1,), generator=generator))
        labels[start : start + length] = number_ids[torch.randint(len(number_ids), (length,), generator=generator)]
    labels[torch.rand(positions, generator=generator) < 0.05] = -100
    return labels


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().double().cpu(), reference.double()
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def fused_errors(nv, labels, logits64, kind, device, dtype, group=None, columns=None) -> tuple[float, float]:
    """Loss and gradient errors of `ce_ntl_loss` on the device, against float64 on CPU."""
    rounded = logits64.to(dtype).double().requires_grad_()
    reference = ce_ntl_loss(rounded, labels, nv, kind=kind, ntl_weight=NTL_WEIGHT)
    reference.loss.backward()
    lo, hi = columns or (0, logits64.shape[-1])
    logits = rounded.detach()[:, lo:hi].to(device, dtype).requires_grad_()
    out = ce_ntl_loss(logits, labels.to(device), nv.to(device), kind=kind, ntl_weight=NTL_WEIGHT, group=group,
                      vocab_start=lo)  # fmt: skip
    out.loss.backward()
    return relative_error(out.loss, reference.loss), relative_error(logits.grad, rounded.grad[:, lo:hi])


def chunked_errors(nv, labels, hidden64, weight64, kind, device, dtype, group=None, rows=None) -> tuple[float, float]:
    """Loss and gradient (hidden and weight, the larger) errors of `linear_ce_ntl_loss`, against float64 on CPU."""
    hidden_ref = hidden64.to(dtype).double().requires_grad_()
    weight_ref = weight64.to(dtype).double().requires_grad_()
    reference = ce_ntl_loss(hidden_ref @ weight_ref.T, labels, nv, kind=kind, ntl_weight=NTL_WEIGHT)
    reference.loss.backward()
    lo, hi = rows or (0, weight64.shape[0])
    hidden = hidden_ref.detach().to(device, dtype).requires_grad_()
    weight = weight_ref.detach()[lo:hi].to(device, dtype).requires_grad_()
    out = linear_ce_ntl_loss(hidden, weight, labels.to(device), nv.to(device), kind=kind, ntl_weight=NTL_WEIGHT,
                             chunk_size=POSITIONS // 3 + 1, group=group, vocab_start=lo)  # fmt: skip
    out.loss.backward()
    hidden_grad = hidden.grad
    if group is not None:  # each rank holds its shard's share of the hidden gradient
        dist.all_reduce(hidden_grad, group=group)
    grad = max(relative_error(hidden_grad, hidden_ref.grad), relative_error(weight.grad, weight_ref.grad[lo:hi]))
    return relative_error(out.loss, reference.loss), grad


def inputs(nv: NumberVocab, seed: int) -> dict[str, torch.Tensor]:
    """The same draws on every rank (the vocabulary-parallel check splits one problem)."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = nv.vocab_size
    return {
        "labels": draw_labels(nv, generator),
        "logits": torch.randn(POSITIONS, vocab_size, generator=generator, dtype=torch.float64) * 3,
        "hidden": torch.randn(POSITIONS, HIDDEN, generator=generator, dtype=torch.float64),
        "weight": torch.randn(vocab_size, HIDDEN, generator=generator, dtype=torch.float64) * 0.5,
    }


def worst(errors: dict[str, tuple[float, float]], tolerance: tuple[float, float]) -> tuple[bool, str]:
    loss_case = max(errors, key=lambda case: errors[case][0])
    grad_case = max(errors, key=lambda case: errors[case][1])
    ok = all(loss <= tolerance[0] and grad <= tolerance[1] for loss, grad in errors.values())
    figure = f"worst loss {errors[loss_case][0]:.1e} ({loss_case}), gradient {errors[grad_case][1]:.1e} " \
        f"({grad_case}); tolerance {tolerance[0]:g} / {tolerance[1]:g}"  # fmt: skip
    return ok, figure


def device_cases(path: str, dtype: torch.dtype, device: torch.device, data: dict) -> dict[str, tuple[float, float]]:
    errors = {}
    for vocab_name, (nv, drawn) in data.items():
        for kind in KINDS:
            if path == "fused":
                errors[f"{vocab_name} {kind}"] = fused_errors(nv, drawn["labels"], drawn["logits"], kind, device, dtype)
            else:
                errors[f"{vocab_name} {kind}"] = chunked_errors(
                    nv, drawn["labels"], drawn["hidden"], drawn["weight"], kind, device, dtype
                )
    return errors


def vocab_parallel_cases(device: torch.device, data: dict) -> dict[str, tuple[float, float]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    errors = {}
    for vocab_name, (nv, drawn) in data.items():
        bounds = vocab_bounds(nv.vocab_size, world)
        span = (bounds[rank], bounds[rank + 1])
        for kind in KINDS:
            errors[f"fused {vocab_name} {kind}"] = fused_errors(
                nv, drawn["labels"], drawn["logits"], kind, device, torch.float32, dist.group.WORLD, span
            )
            errors[f"chunked {vocab_name} {kind}"] = chunked_errors(
                nv, drawn["labels"], drawn["hidden"], drawn["weight"], kind, device, torch.float32, dist.group.WORLD,
                span,
            )  # fmt: skip
    return errors


def loss_check(device: torch.device) -> list[Check]:
    data = {name: (nv, inputs(nv, seed)) for seed, (name, nv) in enumerate(vocabularies().items())}
    checks = []
    for path, dtype in TOLERANCES:
        errors = device_cases(path, dtype, device, data)
        ok, figure = worst(errors, TOLERANCES[path, dtype])
        dtype_name = str(dtype).removeprefix("torch.")
        checks.append(Check(f"loss {path} {dtype_name}", ok, f"{len(errors)} cases: {figure}", errors))
    name = "loss vocab-parallel fp32"
    if dist.get_world_size() == 1:
        return [*checks, Check(name, None, "1 rank: run the doctor on 2+ ranks to check it")]
    errors = vocab_parallel_cases(device, data)
    ok, figure = worst(errors, TOLERANCES["fused", torch.float32])
    return [*checks, Check(name, ok, f"{dist.get_world_size()} ranks, {len(errors)} cases: {figure}", errors)]
