"""Registers and spills of the Triton backend's kernels, without a GPU: Triton's offline compile for a CUDA target
(`triton.compiler.ASTSource` + `GPUTarget`; triton's wheels ship ptxas and cuobjdump) of exactly the launches a loss
call makes. The call runs with its kernels recorded instead of launched (`recorded_launches`), each launch is
specialised as Triton's runtime would (argument types, 16-byte divisibility), compiled for the target, and the cubin's
resource usage read (`cuobjdump --dump-resource-usage`): registers a thread, and its local-memory stack frame, which
for these kernels (no local arrays) holds only spilled registers. On a GPU, Triton's `CompiledKernel.n_spills` is
that frame in 4-byte words.

bench/gpu_heads.py prints them beside its times; tests/test_triton_resources.py asserts that no kernel spills on
sm_80 and sm_90. Uses Triton internals (docs/compatibility.md): the JIT's argument binder and `_pack_args`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ntl_pretrain.loss import backend as backend_module
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberVocab

ARCHS = {"sm_80": 80, "sm_90": 90}
"""The GPU architectures checked: A100 and H100/H200."""
KERNELS_FILE = Path(__file__).with_name("triton_kernels.py")
CAPPED = LogitTransform(scale=0.5, softcap=30.0)
"""A transform with both steps, so that the kernels' transform code is compiled too."""
ROWS = 4  # rows of the recorded calls: enough for labels of every class, the launches do not depend on it


@dataclass(frozen=True)
class Launch:
    """One kernel launch a loss call made: the kernel's name, its arguments and keyword arguments."""

    kernel: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    """The kernel and the flags it was specialised with (those that are set)."""
    registers: int
    """Registers a thread."""
    spill_bytes: int
    """Local-memory stack frame a thread, in bytes: 0 when nothing spills."""


def offline_compile_unavailable() -> str | None:
    """Why kernels cannot be compiled offline here (None: they can): Triton's CUDA tools must be installed."""
    try:
        _tool_path("cuobjdump")
    except Exception as error:  # noqa: BLE001 - any failure to find the tools means no offline compile
        return f"triton's CUDA tools are not available ({type(error).__name__}: {error})"
    return None


def loss_kernel_resources(
    kind: str | None, arch: str, nv: NumberVocab, dtype: torch.dtype = torch.bfloat16
) -> list[KernelResources]:
    """Every distinct kernel launch of `ce_ntl_loss` (forward and backward) and `linear_ce_ntl_loss` with NTL `kind`
    in `dtype` over the vocabulary `nv`, plain and with a scaled, soft-capped transform, compiled for `arch`."""
    launches = recorded_launches(lambda: _loss_calls(kind, nv, dtype))
    unique = {_launch_key(launch): launch for launch in launches}
    return [compile_resources(launch, ARCHS[arch]) for launch in unique.values()]


def _loss_calls(kind: str | None, nv: NumberVocab, dtype: torch.dtype) -> None:
    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.loss.chunked import linear_ce_ntl_loss

    generator = torch.Generator().manual_seed(0)
    labels = nv.number_ids[torch.randint(len(nv.number_ids), (ROWS,), generator=generator)]
    logits = torch.randn(ROWS, nv.vocab_size, generator=generator).to(dtype).requires_grad_()
    ce_ntl_loss(logits, labels, nv, kind=kind, backend="triton").loss.backward()
    hidden = torch.randn(ROWS, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(nv.vocab_size, 16, generator=generator).to(dtype).requires_grad_()
    for transform in (IDENTITY, CAPPED):
        linear_ce_ntl_loss(hidden, weight, labels, nv, kind=kind, transform=transform, backend="triton").loss.backward()


def recorded_launches(call: Callable[[], None]) -> list[Launch]:
    """The kernel launches `call` makes through the Triton backend on CPU tensors, recorded rather than run (their
    outputs stay unwritten: what the call computes from them is meaningless, and never read)."""
    from ntl_pretrain.loss import triton_ops

    launches: list[Launch] = []
    with _backend_on_cpu(), _swapped(triton_ops, "kernels", _Recorder(triton_ops.kernels, launches)):
        call()
    return launches


class _Recorder:
    """Stands in for the kernels module: `kernel[grid](*args, **kwargs)` appends a Launch."""

    def __init__(self, module, launches: list[Launch]):
        self.module, self.launches = module, launches

    def __getattr__(self, name: str):
        if not name.endswith("_kernel"):
            return getattr(self.module, name)
        return _RecordingKernel(name, self.launches)


class _RecordingKernel:
    def __init__(self, name: str, launches: list[Launch]):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.name, args, kwargs))


@contextlib.contextmanager
def _backend_on_cpu() -> Iterator[None]:
    """Let `backend="triton"` take CPU tensors (as under the interpreter) while launches are recorded."""
    with _swapped(backend_module, "interpreter_ready", lambda: True):
        yield


@contextlib.contextmanager
def _swapped(owner, name: str, value) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _launch_key(launch: Launch) -> tuple:
    """What decides the compiled kernel: its name, its flags and its arguments' types and alignment."""
    kinds = tuple(_argument_kind(arg) for arg in launch.args)
    return launch.kernel, tuple(sorted(launch.kwargs.items())), kinds


def _argument_kind(arg) -> tuple:
    if isinstance(arg, torch.Tensor):
        return "tensor", arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool | float):
        return type(arg).__name__, arg
    return "int", -(2**31) <= arg < 2**31, arg % 16 == 0, arg == 1


def compile_resources(launch: Launch, capability: int) -> KernelResources:
    """Compile `launch` for a CUDA GPU of `capability` (80: sm_80) and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = getattr(_compiled_kernels(), launch.kernel)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                              options)  # fmt: skip
    source = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    registers, stack = _resource_usage(compiled.asm["cubin"])
    flags = ", ".join(f"{k}={v}" for k, v in sorted(launch.kwargs.items()) if v and k.isupper() and "BLOCK" not in k)
    return KernelResources(f"{launch.kernel}({flags})", registers, stack)


@functools.cache
def _compiled_kernels():
    """triton_kernels.py decorated for compiling (not interpreting), whatever TRITON_INTERPRET says: a second copy
    of the module, so that the backend's own (maybe interpreted) kernels stay as they are."""
    from triton import knobs

    spec = importlib.util.spec_from_file_location("ntl_pretrain_triton_kernels_compiled", KERNELS_FILE)
    module = importlib.util.module_from_spec(spec)
    with _swapped(knobs.runtime, "interpret", False):
        spec.loader.exec_module(module)
    return module


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the one kernel in `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([_tool_path("cuobjdump"), "--dump-resource-usage", file.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage!r}")
    return int(found.group(1)), int(found.group(2))


def _tool_path(name: str) -> str:
    """A CUDA tool from Triton's NVIDIA backend (its wheels ship ptxas, cuobjdump and nvdisasm)."""
    from triton import knobs

    path = Path(knobs.nvidia.ptxas.path).with_name(name)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return str(path)
