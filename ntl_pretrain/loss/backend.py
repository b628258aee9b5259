"""Which implementation computes CE + NTL: the `backend` argument of `ce_ntl_loss` and `linear_ce_ntl_loss`, and
the recipe key `loss.backend`.

- "torch": the reference, on every device and dtype (fused.py).
- "triton": the kernels of triton_kernels.py, in fp32 from fp32/bf16/fp16 logits, on CUDA tensors; on CPU tensors
  only under Triton's interpreter (`TRITON_INTERPRET=1`, slow: for tests).
- "auto": triton on CUDA where the `triton` package imports and the logits are not fp64, else torch.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

BACKENDS = ("auto", "torch", "triton")
KERNELS_MODULE = "ntl_pretrain.loss.triton_kernels"


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, key: str = "backend") -> str:
    """The backend, torch or triton, that computes a loss on `device` from logits of `dtype`; a "triton" that cannot
    run here is a one-line error naming `key` (the argument, or the recipe key the heads pass)."""
    if backend not in BACKENDS:
        raise ValueError(f"{key} must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and why_triton_cannot_run("cuda", dtype) is None else "torch"
    reason = why_triton_cannot_run(device.type, dtype, interpreter_ready())
    if reason is not None:
        raise ValueError(f"{key}: triton cannot run here: {reason}; use auto or torch")
    return "triton"


def why_triton_cannot_run(device_type: str, dtype: torch.dtype | None = None, interpreted: bool = False) -> str | None:
    """Why the Triton kernels cannot take logits of `dtype` on a `device_type` device, `interpreted` or compiled
    (None: they can)."""
    error = triton_import_error()
    if error is not None:
        return f"the triton package does not import ({error})"
    if device_type == "cpu" and not interpreted:
        return "its kernels run on CUDA GPUs, and this is the CPU (TRITON_INTERPRET=1 interprets them there, slowly)"
    if device_type not in ("cpu", "cuda"):
        return f"its kernels run on CUDA GPUs, and this is {device_type}"
    if dtype == torch.float64:
        return "its kernels compute in fp32, and the logits are fp64"
    return None


@functools.cache
def triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import means the backend cannot run
        return f"{type(error).__name__}: {error}"
    return None


def interpreter_ready() -> bool:
    """Whether this process's kernels run on CPU tensors: triton 3.x reads TRITON_INTERPRET when `@triton.jit`
    decorates a function, so what counts is the variable when the kernels module was first imported (or will be)."""
    kernels = sys.modules.get(KERNELS_MODULE)
    if kernels is not None:
        return kernels.INTERPRETED
    return interpreter_asked()


def interpreter_asked() -> bool:
    """Whether the environment asks Triton to interpret kernels (what a launched rank will see)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
