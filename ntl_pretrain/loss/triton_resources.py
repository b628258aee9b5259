"""Registers and spills of the Triton backend's kernels, without a GPU: Triton's offline compile for a CUDA target
(`triton.compiler.ASTSource` + `GPUTarget`; triton's wheels ship ptxas and cuobjdump) of exactly the launches a loss
call makes. The call runs with its kernels recorded instead of launched (`recorded_launches`), each launch is
specialised as Triton's runtime would (argument types, 16-byte divisibility), compiled for the target, and the cubin's
resource usage read (`cuobjdump --dump-resource-usage`): registers a thread, and its local-memory stack frame, which
for these kernels (no local arrays) holds only spilled registers. On a GPU, Triton's `CompiledKernel.n_spills` is
that frame in 4-byte words.

The compile runs in a child process (`python -m ntl_pretrain.loss.triton_resources`) with TRITON_INTERPRET unset:
triton decides when it is imported whether its own library functions (`tl.max`, `tl.sum`) are interpreted, and a
process that interprets kernels (the test suite) cannot compile them. bench/gpu_heads.py prints the figures;
tests/test_triton_resources.py asserts that no kernel spills on sm_80 and sm_90. Uses Triton internals
(docs/compatibility.md): the JIT's argument binder and `_pack_args`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ntl_pretrain.loss import backend as backend_module
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberVocab

ARCHS = {"sm_80": 80, "sm_90": 90}
"""The GPU architectures checked: A100 and H100/H200."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LLAMA3_VOCAB = 128_256
RAGGED_VOCABS = (30_522, 50_257, 199_999)
"""Widths that are not multiples of 16 (BERT, GPT-2, o200k): rows then start off a 16-byte boundary."""
CAPPED = LogitTransform(scale=0.5, softcap=30.0)
"""A transform with both steps, so that the kernels' transform code is compiled too."""
ROWS = 4  # rows of the recorded calls: enough for labels of every class, the launches do not depend on it
COMPILE_TIMEOUT_S = 900


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
    kinds: tuple[str, ...]
    """The NTL kinds whose calls launch it ("None": CE only)."""
    vocab_sizes: tuple[int, ...]
    """The vocabulary widths whose calls launch it: Triton specialises a width only by whether 16 divides it."""
    dtype: str
    """The logits' dtype."""
    arch: str
    registers: int
    """Registers a thread."""
    spill_bytes: int
    """Local-memory stack frame a thread, in bytes: 0 when nothing spills."""


def offline_compile_unavailable() -> str | None:
    """Why kernels cannot be compiled offline here (None: they can): triton and its CUDA tools must be installed."""
    try:
        _tool_path("cuobjdump")
    except Exception as error:  # noqa: BLE001 - any failure to find the tools means no offline compile
        return f"triton's CUDA tools are not available ({type(error).__name__}: {error})"
    return None


def loss_kernel_resources(
    kinds, vocab_sizes=(LLAMA3_VOCAB,), archs=tuple(ARCHS), dtypes=("bf16",)
) -> list[KernelResources]:
    """Every distinct kernel that `ce_ntl_loss` (forward and backward), `ce_ntl_training_loss` and
    `linear_ce_ntl_loss` (plain, and with a scaled, soft-capped transform) launch for each NTL kind of `kinds` (None:
    CE only), on logits of each of `dtypes` over Llama-3-like vocabularies of each of `vocab_sizes` tokens (the
    kernels' blocks and specialisations follow them), compiled for each of `archs`, in a child process per
    architecture (they run side by side); calls that launch the same kernel share its entry."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", __name__, "--kinds", *map(str, kinds), "--vocab-sizes", *map(str, vocab_sizes),
               "--dtypes", *dtypes]  # fmt: skip
    pipes = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    children = [subprocess.Popen([*command, "--archs", arch], **pipes) for arch in archs]
    found = []
    for child in children:
        stdout, stderr = child.communicate(timeout=COMPILE_TIMEOUT_S)
        if child.returncode != 0:
            raise RuntimeError(f"compiling the kernels offline failed: {stderr.strip()[-2000:]}")
        for entry in json.loads(stdout):
            found.append(KernelResources(**{**entry, "kinds": tuple(entry["kinds"]),
                                            "vocab_sizes": tuple(entry["vocab_sizes"])}))  # fmt: skip
    return found


def _resources_here(kinds, vocab_sizes, archs, dtypes) -> list[KernelResources]:
    unique: dict[tuple, tuple[Launch, dict, dict]] = {}  # each launch, and the kinds and widths that make it (in order)
    for dtype in dtypes:
        for vocab_size in vocab_sizes:
            for kind in kinds:
                for launch in distinct_launches(kind, vocab_size, DTYPES[dtype]):
                    _, by_kind, by_width = unique.setdefault(_launch_key(launch), (launch, {}, {}))
                    by_kind[str(kind)] = by_width[vocab_size] = None
    return [
        KernelResources(
            _described(launch),
            tuple(by_kind),
            tuple(by_width),
            _dtype_name(launch),
            arch,
            *compile_resources(launch, ARCHS[arch]),
        )
        for launch, by_kind, by_width in unique.values()
        for arch in archs
    ]


def distinct_launches(kind: str | None, vocab_size: int, dtype: torch.dtype) -> list[Launch]:
    """The launches the loss calls of one kind make at one width and dtype, one per compiled kernel."""
    nv = llama3_like_vocab(vocab_size)
    launches = recorded_launches(lambda: _loss_calls(kind, nv, dtype))
    return list({_launch_key(launch): launch for launch in launches}.values())


def _dtype_name(launch: Launch) -> str:
    """The dtype of the launch's first argument (the logits, or what the kernel scales)."""
    return next(name for name, dtype in DTYPES.items() if dtype == launch.args[0].dtype)


def llama3_like_vocab(vocab_size: int) -> NumberVocab:
    """Llama-3's number tokens: every chunk of 1-3 digits ("7", "07", "007"), after 1,000 word tokens."""
    chunks = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(100)] + [f"{i:03d}" for i in range(1000)]
    return NumberVocab.from_surfaces([None] * 1000 + chunks + [None] * (vocab_size - 1000 - len(chunks)))


def _loss_calls(kind: str | None, nv: NumberVocab, dtype: torch.dtype) -> None:
    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.loss.ce_ntl import VALUE_KINDS, ce_ntl_training_loss
    from ntl_pretrain.loss.chunked import linear_ce_ntl_loss

    generator = torch.Generator().manual_seed(0)
    labels = nv.number_ids[torch.randint(len(nv.number_ids), (ROWS,), generator=generator)]
    logits = torch.randn(ROWS, nv.vocab_size, generator=generator).to(dtype).requires_grad_()
    ce_ntl_loss(logits, labels, nv, kind=kind, backend="triton").loss.backward()
    (2 * ce_ntl_training_loss(logits, labels, nv, kind=kind, backend="triton").loss).backward()
    hidden = torch.randn(ROWS, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(nv.vocab_size, 16, generator=generator).to(dtype).requires_grad_()
    # reweighing takes the head's unfused path (a chunk's statistics, then its gradient), as a group does
    for reweigh in (False, True) if kind in VALUE_KINDS else (False,):
        for transform in (IDENTITY, CAPPED):
            linear_ce_ntl_loss(hidden, weight, labels, nv, kind=kind, reweigh=reweigh, transform=transform,
                               backend="triton").loss.backward()  # fmt: skip


def recorded_launches(call: Callable[[], None]) -> list[Launch]:
    """The kernel launches `call` makes through the Triton backend on CPU tensors, recorded rather than run (their
    outputs stay unwritten: what the call computes from them is meaningless, and never read)."""
    from ntl_pretrain.loss import triton_ops

    launches: list[Launch] = []
    with _swapped(backend_module, "interpreter_ready", lambda: True), \
            _swapped(triton_ops, "kernels", _Recorder(triton_ops.kernels, launches)):  # fmt: skip
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


def compile_resources(launch: Launch, capability: int) -> tuple[int, int]:
    """Compile `launch` for a CUDA GPU of `capability` (80: sm_80): (registers, spill bytes) a thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from ntl_pretrain.loss import triton_kernels

    if triton_kernels.INTERPRETED:
        raise RuntimeError("the kernels are interpreted in this process (TRITON_INTERPRET=1): compile in another")
    kernel = getattr(triton_kernels, launch.kernel)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                              options)  # fmt: skip
    source = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    return _resource_usage(compiled.asm["cubin"])


def _described(launch: Launch) -> str:
    """The kernel's name and the flags set in its launch (blocks and warps left out)."""
    flags = ", ".join(f"{k}={v}" for k, v in sorted(launch.kwargs.items()) if v and k.isupper() and "BLOCK" not in k)
    return f"{launch.kernel}({flags})"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Registers and spill bytes of the loss's Triton kernels, as JSON.")
    parser.add_argument("--kinds", nargs="+", required=True, help="NTL kinds; None for CE only")
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[LLAMA3_VOCAB])
    parser.add_argument("--archs", nargs="+", choices=sorted(ARCHS), default=sorted(ARCHS))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    args = parser.parse_args(argv)
    kinds = [None if kind == "None" else kind for kind in args.kinds]
    found = _resources_here(kinds, args.vocab_sizes, args.archs, args.dtypes)
    print(json.dumps([asdict(entry) for entry in found]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
