"""DeepSpeed ZeRO-3's autograd Functions run without binding a signature at every call (issue 47; docs/benchmarks.md,
"Step overhead").

At every step ZeRO-3 (DeepSpeed 0.19) runs three kinds of autograd Function, each defined with `setup_context` (the
style functorch transforms need):
- its linear layer, which building a model under ZeRO-3 puts in place of `torch.nn.functional.linear` process-wide
  (`zero3_linear_wrap`). It saves the weight Parameter itself for backward, so that releasing a gathered weight
  after its module's forward frees the storage (`F.linear` saves a `weight.t()` view, which would keep the gathered
  storage alive until backward);
- the two that fire each hooked module's pre- and post-backward work (`module.pre_bwd_fn`, `module.post_bwd_fn`).
For a Function with `setup_context`, torch's `Function.apply` binds the arguments to `forward`'s signature with
`inspect` at every call: ~290 calls and ~30k Python calls a step for a 30-layer model. `classic(function)` runs the
same Function in the classic `forward(ctx, ...)` style: its own forward, then its own `setup_context` on the same
ctx, and its own backward; so the same ops, the same saved tensors and the same autocast handling. Inside a
functorch transform (`torch.func.vmap`, `grad`, ...) DeepSpeed's Function runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MODULE_FUNCTIONS = ("pre_bwd_fn", "post_bwd_fn")  # the attributes ZeRO-3 gives each module it hooks


def classic(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """`function`, a Function with `forward(*args)` and `setup_context`, as a classic `forward(ctx, *args)` one."""

    class Classic(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output = function.forward(*args)
            function.setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grad_outputs):
            return function.backward(ctx, *grad_outputs)

        @classmethod
        def apply(cls, *args):
            if torch._C._are_functorch_transforms_active():
                return function.apply(*args)
            return super().apply(*args)

    Classic.__name__ = Classic.__qualname__ = f"Classic{function.__name__}"
    return Classic


def apply_zero3_functions_classically(module: nn.Module) -> None:
    """After ZeRO-3 has hooked `module`: its modules' backward Functions, and `F.linear` where DeepSpeed has put its
    own there (a ZeRO-3 build with `memory_efficient_linear`, its default), run classically. DeepSpeed puts its
    linear in place only of torch's own, so a later ZeRO-3 build keeps this one."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

    if F.linear is zero3_linear_wrap:
        F.linear = classic_linear(LinearFunctionForZeroStage3)
    for hooked in module.modules():
        for name in MODULE_FUNCTIONS:
            if name in hooked.__dict__:
                setattr(hooked, name, classic(hooked.__dict__[name]))


def classic_linear(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """`F.linear` under ZeRO-3 with `function` (DeepSpeed's `LinearFunctionForZeroStage3`) run classically."""
    apply = classic(function).apply

    def zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply(input, weight, bias)

    zero3_linear.runs = function
    return zero3_linear
