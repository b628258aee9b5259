"""Check 4: speed and memory of the loss and the output layer on this device, as ratios measured side by side.

Time: the methods run round-robin and each keeps its fastest forward+backward (CUDA events on GPU), so that a
shared machine's noise falls on all of them alike. Memory (GPU): the peak allocated above what was allocated
before the call. On CPU, memory is not measured here: one process's peak RSS cannot be split between methods
(bench/loss.py and bench/chunked_head.py measure each in its own process).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ntl_pretrain.doctor.loss_checks import draw_labels, multi_digit_vocab
from ntl_pretrain.doctor.report import Check
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.chunked import default_chunk_rows, linear_ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

# (positions, vocabulary, hidden): Llama-3's vocabulary and an 8B model's hidden size on GPU; a tenth on CPU.
SIZES = {"cuda": (8192, 128_256, 4096), "cpu": (1024, 32_768, 512)}
REPEATS = 3


def seconds(step: Callable[[], None], device: torch.device) -> float:
    if device.type != "cuda":
        started = time.perf_counter()
        step()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def fastest(steps: dict[str, Callable[[], None]], device: torch.device) -> dict[str, float]:
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(REPEATS + 1):  # the first round warms up (allocator, kernels)
        for name, step in steps.items():
            best[name] = min(best[name], seconds(step, device))
    return best


def peak_mib(step: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def backward_of(loss_fn: Callable[[], torch.Tensor], *leaves: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        for leaf in leaves:
            leaf.grad = None

    return step


def labelled(device: torch.device, seed: int) -> tuple[NumberVocab, torch.Tensor, torch.Generator]:
    """The Llama-3-like vocabulary of this device's size on the device, labels drawn from it, and the generator
    that drew them (to draw the inputs next)."""
    positions, vocab_size, _ = SIZES[device.type]
    nv = multi_digit_vocab(vocab_size)
    generator = torch.Generator().manual_seed(seed)
    labels = draw_labels(nv, generator, positions).to(device)
    return nv.to(device), labels, generator


def loss_steps(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    positions, vocab_size, _ = SIZES[device.type]
    nv, labels, generator = labelled(device, seed=0)
    logits = torch.randn(positions, vocab_size, generator=generator).to(device, dtype).requires_grad_()
    return {
        "F.cross_entropy": backward_of(lambda: F.cross_entropy(logits, labels), logits),
        "ce_ntl_loss was": backward_of(lambda: ce_ntl_loss(logits, labels, nv, kind="was").loss, logits),
        "ce_ntl_loss digits": backward_of(lambda: ce_ntl_loss(logits, labels, nv, kind="digits").loss, logits),
        "ce_ntl_loss number": backward_of(lambda: ce_ntl_loss(logits, labels, nv, kind="number").loss, logits),
    }


def head_steps(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    positions, vocab_size, hidden_size = SIZES[device.type]
    nv, labels, generator = labelled(device, seed=1)
    hidden = torch.randn(positions, hidden_size, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=generator) * hidden_size**-0.5).to(device, dtype)
    weight.requires_grad_()
    chunk_rows = default_chunk_rows(vocab_size)
    return {
        "dense head": backward_of(lambda: ce_ntl_loss(hidden @ weight.T, labels, nv, kind="was").loss, hidden, weight),
        "chunked head": backward_of(
            lambda: linear_ce_ntl_loss(hidden, weight, labels, nv, kind="was").loss, hidden, weight
        ),
        # the weight gradient one chunk per matmul, as before grouping (loss/chunked.py): on a GPU where bf16 products
        # accumulate in fp32 the default groups chunks, and this row's ratio beside it is what the grouping gains
        "chunked head, a weight-gradient matmul per chunk": backward_of(
            lambda: linear_ce_ntl_loss(hidden, weight, labels, nv, kind="was", weight_grad_rows=chunk_rows).loss,
            hidden,
            weight,
        ),
    }


def ratios(steps: dict[str, Callable[[], None]], device: torch.device, baseline: str) -> dict[str, dict]:
    times = fastest(steps, device)
    peaks = {name: peak_mib(step, device) for name, step in steps.items()}
    return {name: {"seconds": times[name], "time_ratio": times[name] / times[baseline], "peak_mib": peaks[name],
                   "memory_ratio": None if peaks[name] is None else peaks[name] / peaks[baseline]}
            for name in steps}  # fmt: skip


def describe(measured: dict[str, dict], baseline: str) -> str:
    parts = []
    for name, figures in measured.items():
        if name == baseline:
            continue
        memory = "" if figures["memory_ratio"] is None else f", memory {figures['memory_ratio']:.2f}x"
        parts.append(f"{name} time {figures['time_ratio']:.2f}x{memory}")
    return f"vs {baseline}: " + "; ".join(parts)


def speed_check(device: torch.device) -> list[Check]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    positions, vocab_size, hidden_size = SIZES[device.type]
    shape = f"{positions} positions x V={vocab_size:,} {str(dtype).removeprefix('torch.')}"
    loss = ratios(loss_steps(device, dtype), device, "F.cross_entropy")
    head = ratios(head_steps(device, dtype), device, "dense head")
    return [
        Check("speed loss", True, f"{shape}: {describe(loss, 'F.cross_entropy')}", loss),
        Check("speed output layer", True, f"{shape}, H={hidden_size}: {describe(head, 'dense head')}", head),
    ]
