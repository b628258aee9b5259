"""The loss and the output layer in bf16 on a GPU: ours against torch's cross-entropy, and against Liger-Kernel's
fused linear cross-entropy where its wheel is installed. Forward+backward, round-robin, fastest of 3 after a warm-up
(CUDA events), and each method's peak allocated memory above its inputs (the doctor's `speed` helpers).

    python bench/gpu_heads.py --out heads.json [--positions 8192 --vocab 128256 --hidden 4096] [--dtype bf16]

Loss on logits [N, V]: `F.cross_entropy` on the logits upcast to fp32 (the baseline: what transformers' loss
does), `ce_ntl_loss` CE-only (kind None) and CE+0.3·NTL-WAS, and Liger's `LigerCrossEntropyLoss`. Output layer
(hidden [N, H], weight [V, H]): the dense head (`hidden @ W.T`, then `F.cross_entropy`; the baseline), our chunked
head (`linear_ce_ntl_loss`) CE-only and with NTL-WAS, and Liger's `LigerFusedLinearCrossEntropyLoss` (CE only:
Liger has no NTL). The vocabulary is Llama-3-like (1-3 digit chunks; at least 2,110 tokens). Liger runs on CUDA only
(Triton); on CPU its rows are left out and the report says why. Prints one line per method and writes every figure
to `--out` as JSON. bench/gpu_first_run.sh runs it on the first GPU (docs/doctor.md, "The first GPU").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ntl_pretrain.doctor.loss_checks import draw_labels, multi_digit_vocab
from ntl_pretrain.doctor.speed import backward_of, fastest, peak_mib
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
Steps = dict[str, Callable[[], None]]


def liger_losses() -> tuple[type, type] | str:
    """Liger's (cross-entropy, fused linear cross-entropy) classes, or why they cannot run here."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # noqa: BLE001 - any import failure is a reason to leave its rows out
        return f"liger-kernel not importable ({type(error).__name__}: {error})"
    if not torch.cuda.is_available():
        return "liger-kernel runs on CUDA only (Triton)"
    return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss


def inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(number vocabulary, labels_N, logits_NV, hidden_NH, weight_VH) on the device; leaves that take gradients."""
    nv = multi_digit_vocab(args.vocab)
    generator = torch.Generator().manual_seed(0)
    labels_N = draw_labels(nv, generator, args.positions).to(device)
    logits_NV = torch.randn(args.positions, args.vocab, generator=generator).to(device, dtype).requires_grad_()
    hidden_NH = torch.randn(args.positions, args.hidden, generator=generator).to(device, dtype).requires_grad_()
    weight_VH = (torch.randn(args.vocab, args.hidden, generator=generator) * args.hidden**-0.5).to(device, dtype)
    return nv.to(device), labels_N, logits_NV, hidden_NH, weight_VH.requires_grad_()


def loss_steps(nv, labels_N, logits_NV, liger) -> Steps:
    steps = {
        "F.cross_entropy": backward_of(lambda: F.cross_entropy(logits_NV.float(), labels_N), logits_NV),
        "ce_ntl_loss CE only": backward_of(lambda: ce_ntl_loss(logits_NV, labels_N, nv, kind=None).loss, logits_NV),
        "ce_ntl_loss CE+NTL-WAS": backward_of(lambda: ce_ntl_loss(logits_NV, labels_N, nv).loss, logits_NV),
    }
    if not isinstance(liger, str):
        liger_ce = liger[0]()
        steps["Liger cross-entropy"] = backward_of(lambda: liger_ce(logits_NV, labels_N), logits_NV)
    return steps


def head_steps(nv, labels_N, hidden_NH, weight_VH, liger) -> Steps:
    leaves = (hidden_NH, weight_VH)
    steps = {
        "dense head + F.cross_entropy": backward_of(
            lambda: F.cross_entropy((hidden_NH @ weight_VH.T).float(), labels_N), *leaves
        ),
        "chunked head CE only": backward_of(
            lambda: linear_ce_ntl_loss(hidden_NH, weight_VH, labels_N, nv, kind=None).loss, *leaves
        ),
        "chunked head CE+NTL-WAS": backward_of(
            lambda: linear_ce_ntl_loss(hidden_NH, weight_VH, labels_N, nv).loss, *leaves
        ),
    }
    if not isinstance(liger, str):
        fused = liger[1]()
        steps["Liger fused linear CE"] = backward_of(lambda: fused(weight_VH, hidden_NH, labels_N), *leaves)
    return steps


def measure(steps: Steps, device: torch.device, baseline: str) -> dict[str, dict]:
    times = fastest(steps, device)
    peaks = {name: peak_mib(step, device) for name, step in steps.items()}
    return {name: {"seconds": times[name], "time_ratio": times[name] / times[baseline], "peak_mib": peaks[name],
                   "memory_ratio": None if peaks[name] is None else peaks[name] / peaks[baseline]}
            for name in steps}  # fmt: skip


def print_table(title: str, measured: dict[str, dict]) -> None:
    print(title)
    for name, figures in measured.items():
        memory = "" if figures["peak_mib"] is None else \
            f"  peak {figures['peak_mib']:9.1f} MiB ({figures['memory_ratio']:.2f}x)"  # fmt: skip
        print(f"  {name:30} {figures['seconds'] * 1e3:9.3f} ms ({figures['time_ratio']:.2f}x){memory}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    liger = liger_losses()
    nv, labels_N, logits_NV, hidden_NH, weight_VH = inputs(args, device, dtype)
    shape = f"N={args.positions} V={args.vocab} H={args.hidden} {args.dtype} on {device_name(device)}"
    loss = measure(loss_steps(nv, labels_N, logits_NV, liger), device, "F.cross_entropy")
    del logits_NV  # the head's rows measure their own logits, not these
    head = measure(head_steps(nv, labels_N, hidden_NH, weight_VH, liger), device, "dense head + F.cross_entropy")
    print_table(f"loss on logits, {shape}", loss)
    print_table(f"output layer, {shape}", head)
    liger_note = liger if isinstance(liger, str) else "measured"
    if isinstance(liger, str):
        print(f"Liger rows left out: {liger}")
    report = {"shape": shape, "torch": torch.__version__, "liger": liger_note, "loss": loss, "head": head}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


if __name__ == "__main__":
    sys.exit(main())
