"""The loss and the output layer in bf16 on a GPU: ours (torch and Triton backends) against torch's cross-entropy,
and against Liger-Kernel's cross-entropy and fused linear cross-entropy where its wheel is installed.
Forward+backward, round-robin, fastest of 3 after a warm-up (CUDA events), and each method's peak allocated memory
above its inputs (the doctor's `speed` helpers).

    python bench/gpu_heads.py --out heads.json [--positions 8192 --vocab 128256 --hidden 4096] [--dtype bf16]
        [--kernel-kinds None was digits number] [--kernel-archs sm_80 sm_90]

Loss on logits [N, V]: `F.cross_entropy` on the logits upcast to fp32 (the baseline: what transformers' loss
does), `ce_ntl_loss` CE-only (kind None) and CE+0.3·NTL of the kinds was, mse, digits and number with each backend,
and Liger's `LigerCrossEntropyLoss`; then `ce_ntl_training_loss` (the dense head's: the gradient formed in forward)
with the Triton backend, CE-only and with WAS, digits and number (`training loss` rows). Output layer (hidden [N, H],
weight [V, H]): the dense head (`hidden @ W.T`, then `F.cross_entropy`; the baseline), our chunked head
(`linear_ce_ntl_loss`) CE-only and with NTL-WAS with each backend, and Liger's `LigerFusedLinearCrossEntropyLoss` (CE
only: Liger has no NTL). The vocabulary is Llama-3-like (1-3 digit chunks; at least 2,110 tokens). Before timing, the
Triton backend's loss and logit gradient are compared with the torch backend's on the same inputs, per kind
(`agreement`: the largest difference relative to the largest value). Then issue 57's and 70's targets, as ratios of
rows of this run (`targets`). Beside each time: the host ops of one call (aten ops dispatched, forward and backward; a
Triton kernel's own work left out) and our Triton kernel launches.
Then the registers and spill bytes a thread of our Triton kernels for `--kernel-kinds`, compiled offline for each of
`--kernel-archs` at this run's vocabulary and dtype (loss/triton_resources.py; `kernels`). Liger runs on CUDA only,
Triton on CUDA or under TRITON_INTERPRET=1; elsewhere their rows are left out and the report says why. Prints one
line per method and writes every figure to `--out` as JSON. bench/gpu_first_run.sh runs it on the first GPU
(docs/doctor.md, "The first GPU"). `--sweep` instead times the training loss's CE-only and WAS rows at each row
block and warp count of `SWEEP` (the kernels' defaults were never swept on a GPU), beside Liger's CE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ntl_pretrain.doctor.loss_checks import draw_labels, multi_digit_vocab
from ntl_pretrain.doctor.speed import backward_of, fastest, peak_mib
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.backend import interpreter_ready, why_triton_cannot_run
from ntl_pretrain.loss.ce_ntl import ce_ntl_training_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.loss.triton_resources import ARCHS, loss_kernel_resources, offline_compile_unavailable

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
Steps = dict[str, Callable[[], None]]
TRITON = " [triton]"  # the suffix of a row's name with backend="triton" (the others: backend="torch")
LOSS_ROWS = {"CE only": None, "CE+NTL-WAS": "was", "CE+NTL-mse": "mse", "CE+NTL-digits": "digits",
             "CE+NTL-number": "number"}  # fmt: skip
"""The loss rows' kinds: mse's kernels are also mae's and huber's."""
# Issue 57's targets: (block, row, against row, at most): row's time over the other's.
TARGETS = {
    "loss CE only, Triton over Liger's CE": ("loss", "ce_ntl_loss CE only" + TRITON, "Liger cross-entropy", 1.2),
    **{f"loss {name}, Triton over Liger's CE": ("loss", f"ce_ntl_loss {name}" + TRITON, "Liger cross-entropy", 1.5)
       for name in ("CE+NTL-WAS", "CE+NTL-mse", "CE+NTL-number")},
    "loss, digits over WAS (Triton)": ("loss", "ce_ntl_loss CE+NTL-digits" + TRITON, "ce_ntl_loss CE+NTL-WAS" + TRITON,
                                       1.0),
    "output layer CE+NTL-WAS, Triton over Liger's fused linear CE": (
        "head", "chunked head CE+NTL-WAS" + TRITON, "Liger fused linear CE", 1.0),
    # issue 70's: the dense training loss (gradient formed in forward, as Liger's) against Liger's CE
    "training loss CE only, Triton over Liger's CE": ("loss", "training loss CE only" + TRITON, "Liger cross-entropy",
                                                      1.0),
    **{f"training loss {name}, Triton over Liger's CE": ("loss", f"training loss {name}" + TRITON,
                                                         "Liger cross-entropy", 1.2)
       for name in ("CE+NTL-WAS", "CE+NTL-digits", "CE+NTL-number")},
}  # fmt: skip
TRAINING_ROWS = ("CE only", "CE+NTL-WAS", "CE+NTL-digits", "CE+NTL-number")
"""The loss rows timed as the dense head runs them too (`ce_ntl_training_loss`, Triton only)."""
SWEEP = [(block, warps) for block in (4096, 8192, 16384, 32768) for warps in (8, 16, 32)]
"""`--sweep`: (row block BLOCK_V, warps) of the Triton kernels tried on the training loss's CE-only and WAS rows."""
SWEEP_ROWS = ("CE only", "CE+NTL-WAS")
AGREEMENT_KINDS = ("was", "digits", "number", "mse", None)
KERNEL_KINDS = ("None", "was", "digits", "number")
"""Kinds whose kernels' registers and spills are printed: number's kernels are those of mse, mae and huber too."""
AGREEMENT_POSITIONS = 1024


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


def triton_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton backend's rows are left out here (None: they run)."""
    return why_triton_cannot_run(device.type, dtype, interpreter_ready())


def backends(triton_reason: str | None) -> dict[str, str]:
    """{row-name suffix: backend} of the rows to time."""
    return {"": "torch"} if triton_reason else {"": "torch", TRITON: "triton"}


def loss_steps(nv, labels_N, logits_NV, liger, triton_reason) -> Steps:
    steps = {"F.cross_entropy": backward_of(lambda: F.cross_entropy(logits_NV.float(), labels_N), logits_NV)}
    for suffix, backend in backends(triton_reason).items():
        for name, kind in LOSS_ROWS.items():
            loss = lambda k=kind, b=backend: ce_ntl_loss(logits_NV, labels_N, nv, kind=k, backend=b).loss
            steps[f"ce_ntl_loss {name}{suffix}"] = backward_of(loss, logits_NV)
    steps.update(training_steps(nv, labels_N, logits_NV, TRAINING_ROWS, triton_reason))
    if not isinstance(liger, str):
        liger_ce = liger[0]()
        steps["Liger cross-entropy"] = backward_of(lambda: liger_ce(logits_NV, labels_N), logits_NV)
    return steps


def training_steps(nv, labels_N, logits_NV, rows, triton_reason) -> Steps:
    """`ce_ntl_training_loss` on the Triton backend (none where it cannot run) for the loss rows named in `rows`."""
    if triton_reason:
        return {}
    steps = {}
    for name in rows:
        loss = lambda k=LOSS_ROWS[name]: ce_ntl_training_loss(logits_NV, labels_N, nv, kind=k, backend="triton").loss
        steps[f"training loss {name}{TRITON}"] = backward_of(loss, logits_NV)
    return steps


def block_sweep(nv, labels_N, logits_NV, device) -> dict[str, dict[str, float]]:
    """{"BLOCK_V/warps": {row: seconds}}: the training loss's CE-only and WAS rows with each row block and warp count
    of `SWEEP` (set on triton_ops for the sweep, restored after)."""
    from ntl_pretrain.loss import triton_ops

    saved = triton_ops.MAX_BLOCK_V, triton_ops._warps
    found = {}
    try:
        for block, warps in SWEEP:
            triton_ops.MAX_BLOCK_V, triton_ops._warps = block, lambda _, warps=warps: warps
            found[f"{block}/{warps}"] = fastest(training_steps(nv, labels_N, logits_NV, SWEEP_ROWS, None), device)
    finally:
        triton_ops.MAX_BLOCK_V, triton_ops._warps = saved
    return found


def head_steps(nv, labels_N, hidden_NH, weight_VH, liger, triton_reason) -> Steps:
    leaves = (hidden_NH, weight_VH)
    steps = {
        "dense head + F.cross_entropy": backward_of(
            lambda: F.cross_entropy((hidden_NH @ weight_VH.T).float(), labels_N), *leaves
        ),
    }
    for suffix, backend in backends(triton_reason).items():
        for name, kind in (("CE only", None), ("CE+NTL-WAS", "was")):
            loss = lambda k=kind, b=backend: linear_ce_ntl_loss(hidden_NH, weight_VH, labels_N, nv, kind=k,
                                                                 backend=b).loss  # fmt: skip
            steps[f"chunked head {name}{suffix}"] = backward_of(loss, *leaves)
    if not isinstance(liger, str):
        fused = liger[1]()
        steps["Liger fused linear CE"] = backward_of(lambda: fused(weight_VH, hidden_NH, labels_N), *leaves)
    return steps


def measure(steps: Steps, device: torch.device, baseline: str) -> dict[str, dict]:
    times = fastest(steps, device)
    peaks = {name: peak_mib(step, device) for name, step in steps.items()}
    return {name: {"seconds": times[name], "time_ratio": times[name] / times[baseline], "peak_mib": peaks[name],
                   "memory_ratio": None if peaks[name] is None else peaks[name] / peaks[baseline],
                   **host_ops(step)}
            for name, step in steps.items()}  # fmt: skip


class HostOps(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on (each a host-side call; most launch a kernel on a GPU), except
    while `paused`, and the launches of our Triton kernels counted into `launches`."""

    def __init__(self):
        super().__init__()
        self.ops = self.launches = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not self.paused
        return func(*args, **(kwargs or {}))


def host_ops(step: Callable[[], None]) -> dict[str, int]:
    """The aten ops and our Triton kernel launches of one call of `step` (forward and backward). The kernels'
    own work is left out: under TRITON_INTERPRET=1 on CPU it is aten ops too, on a GPU it dispatches none."""
    counter = HostOps()
    with _launches_counted(counter), counter:
        step()
    return {"host_ops": counter.ops, "triton_launches": counter.launches}


@contextlib.contextmanager
def _launches_counted(counter: HostOps) -> Iterator[None]:
    """Our kernels, each launch counted and its own ops paused, while on (nothing where triton does not import)."""
    if why_triton_cannot_run("cuda") is not None:
        yield
        return
    from ntl_pretrain.loss import triton_ops

    kernels = triton_ops.kernels

    class Counted:
        def __getattr__(self, name):
            kernel = getattr(kernels, name)
            return _CountedKernel(kernel, counter) if name.endswith("_kernel") else kernel

    triton_ops.kernels = Counted()
    try:
        yield
    finally:
        triton_ops.kernels = kernels


class _CountedKernel:
    def __init__(self, kernel, counter: HostOps):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter.launches += 1
            self.counter.paused = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.counter.paused = False

        return launch


def kernel_resources(args: argparse.Namespace) -> dict:
    """Registers and spill bytes a thread of our Triton kernels, per kind, compiled offline for each architecture
    of `args.kernel_archs` at this run's vocabulary and dtype ({"left_out": why} where they cannot be)."""
    reason = offline_compile_unavailable()
    if reason is None:
        try:
            found = loss_kernel_resources(args.kernel_kinds, (args.vocab,), args.kernel_archs, (args.dtype,))
        except Exception as error:  # noqa: BLE001 - the timings stand without these figures
            reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        return {"left_out": reason}
    return {"kernels": [vars(entry) | {"kinds": list(entry.kinds)} for entry in found],
            "spilling": sum(entry.spill_bytes > 0 for entry in found)}  # fmt: skip


def agreement(nv, labels_N, logits_NV) -> dict[str, float]:
    """Per kind, the largest difference between the Triton and torch backends' loss and logit gradient on the first
    `AGREEMENT_POSITIONS` positions, relative to the largest value (bf16 gradients: a few 2^-8 at most)."""
    logits_NV, labels_N = logits_NV[:AGREEMENT_POSITIONS].detach(), labels_N[:AGREEMENT_POSITIONS]
    found = {}
    for kind in AGREEMENT_KINDS:
        results = []
        for backend in ("triton", "torch"):
            leaf = logits_NV.clone().requires_grad_(True)
            loss = ce_ntl_loss(leaf, labels_N, nv, kind=kind, reweigh=kind == "mse", backend=backend).loss
            loss.backward()
            results.append((loss.detach().float(), leaf.grad.float()))
        (loss, grad), (want_loss, want_grad) = results
        found[str(kind)] = max(float((loss - want_loss).abs() / want_loss.abs()),
                               float((grad - want_grad).abs().max() / want_grad.abs().max()))  # fmt: skip
    return found


def target_ratios(measured: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Each target of `TARGETS` whose rows ran: the ratio, its bound, and whether it is met."""
    ratios = {}
    for name, (block, row, against, bound) in TARGETS.items():
        if row in measured[block] and against in measured[block]:
            ratio = measured[block][row]["seconds"] / measured[block][against]["seconds"]
            ratios[name] = {"ratio": ratio, "at_most": bound, "met": ratio <= bound}
    return ratios


def print_table(title: str, measured: dict[str, dict]) -> None:
    print(title)
    for name, figures in measured.items():
        memory = "" if figures["peak_mib"] is None else \
            f"  peak {figures['peak_mib']:9.1f} MiB ({figures['memory_ratio']:.2f}x)"  # fmt: skip
        ops = f"  {figures['host_ops']:4d} host ops, {figures['triton_launches']} Triton launches"
        print(f"  {name:30} {figures['seconds'] * 1e3:9.3f} ms ({figures['time_ratio']:.2f}x){memory}{ops}")


def print_kernels(resources: dict) -> None:
    if "left_out" in resources:
        print(f"kernel registers and spills left out: {resources['left_out']}")
        return
    print("our Triton kernels, offline compile: registers / spill bytes a thread")
    for entry in resources["kernels"]:
        print(f"  {entry['arch']} {entry['kernel']:80} {entry['registers']:3d} regs {entry['spill_bytes']:5d} B  "
              f"(kinds {', '.join(entry['kinds'])})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernel-kinds", nargs="+", default=list(KERNEL_KINDS), help="kinds whose kernels to compile")
    parser.add_argument("--kernel-archs", nargs="+", choices=sorted(ARCHS), default=sorted(ARCHS))
    parser.add_argument("--sweep", action="store_true", help="only the row block / warps sweep of the training loss")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    liger, triton_reason = liger_losses(), triton_available(device, dtype)
    nv, labels_N, logits_NV, hidden_NH, weight_VH = inputs(args, device, dtype)
    shape = f"N={args.positions} V={args.vocab} H={args.hidden} {args.dtype} on {device_name(device)}"
    if args.sweep:
        return sweep_report(args, shape, nv, labels_N, logits_NV, device, liger, triton_reason)
    agreed = {} if triton_reason else agreement(nv, labels_N, logits_NV)
    loss = measure(loss_steps(nv, labels_N, logits_NV, liger, triton_reason), device, "F.cross_entropy")
    del logits_NV  # the head's rows measure their own logits, not these
    head = measure(head_steps(nv, labels_N, hidden_NH, weight_VH, liger, triton_reason), device,
                   "dense head + F.cross_entropy")  # fmt: skip
    targets = target_ratios({"loss": loss, "head": head})
    resources = kernel_resources(args)
    for kind, difference in agreed.items():
        print(f"Triton vs torch backend, kind {kind}: largest relative difference {difference:.1e}")
    print_table(f"loss on logits, {shape}", loss)
    print_table(f"output layer, {shape}", head)
    print_kernels(resources)
    for name, target in targets.items():
        print(f"target {name}: {target['ratio']:.2f}x (at most {target['at_most']}x): "
              f"{'met' if target['met'] else 'missed'}")  # fmt: skip
    liger_note = liger if isinstance(liger, str) else "measured"
    for what, reason in (("Liger", liger if isinstance(liger, str) else None), ("Triton", triton_reason)):
        if reason:
            print(f"{what} rows left out: {reason}")
    report = {"shape": shape, "torch": torch.__version__, "liger": liger_note, "triton": triton_reason or "measured",
              "agreement": agreed, "loss": loss, "head": head, "targets": targets, "kernels": resources}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def sweep_report(args, shape, nv, labels_N, logits_NV, device, liger, triton_reason) -> int:
    """`--sweep`: each row block / warps pair's times, over Liger's CE on the same logits where it runs."""
    if triton_reason:
        raise SystemExit(f"gpu_heads --sweep: the Triton backend cannot run here: {triton_reason}")
    liger_seconds = None
    if not isinstance(liger, str):
        liger_ce = liger[0]()
        liger_seconds = fastest({"liger": backward_of(lambda: liger_ce(logits_NV, labels_N), logits_NV)}, device)
        liger_seconds = liger_seconds["liger"]
    sweep = block_sweep(nv, labels_N, logits_NV, device)
    print(f"row block / warps sweep of the training loss, {shape} (Liger CE: {liger_seconds})")
    for config, times in sweep.items():
        print(f"  {config:>12}  " + "  ".join(f"{name} {seconds * 1e3:8.3f} ms" for name, seconds in times.items()))
    report = {"shape": shape, "liger": liger if isinstance(liger, str) else "measured", "liger_seconds": liger_seconds,
              "sweep": sweep}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


if __name__ == "__main__":
    sys.exit(main())
