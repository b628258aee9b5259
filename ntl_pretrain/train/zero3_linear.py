"""ZeRO-3's linear layer without the Python around its arithmetic (issue 73; docs/benchmarks.md, "ZeRO-3
bookkeeping").

Building a model under ZeRO-3 puts DeepSpeed's `zero3_linear_wrap` (its autograd Function `LinearFunctionForZeroStage3`)
in place of `torch.nn.functional.linear`, process-wide: it saves the weight Parameter itself for backward, so that
releasing a gathered weight after its module's forward frees the storage. Each call then asks the accelerator for its
device name twice, reads the autocast state through two try/except helpers, enters and leaves a `torch.autocast` context
in backward even where autocast is off everywhere, and compares the weight's status by its enum name. `Zero3Linear` is
the same Function (the same ops on the same tensors, the same tensors saved, the weight gathered and released in
backward where it is partitioned) that reads the device once and enters the autocast context only where autocast is or
was on (with autocast off at forward and at backward, DeepSpeed's context, `enabled=False`, changes nothing an op sees),
and is applied through autograd's own apply, as torch's `Function.apply` does outside functorch transforms, without that
method's Python. One layer's forward and backward: 20 Python calls against 69 as the trainer ran DeepSpeed's Function
before (classically, train/zero3_functions.py) and 180 as DeepSpeed applies it (tests/test_zero3_linear.py); 8.2k fewer
a step on the CPU toy of bench/step_overhead.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LINEAR = "deepspeed.runtime.zero.linear"
# The DeepSpeed functions `Zero3Linear` reproduces or stands in for (fingerprinted in train/zero3_bookkeeping.py).
LINEAR_READS = tuple(f"{LINEAR}.{name}" for name in (
    "LinearFunctionForZeroStage3.forward", "LinearFunctionForZeroStage3.setup_context",
    "LinearFunctionForZeroStage3.backward", "zero3_linear_wrap", "_is_autocast_enabled", "_get_autocast_dtype")
    ) + ("deepspeed.runtime.zero.utils.is_zero_param",)  # fmt: skip


def lean_zero3_linear(device_type: str) -> Callable[..., torch.Tensor]:
    """`F.linear` under ZeRO-3 on `device_type` (DeepSpeed's accelerator's device name), as `Zero3Linear`; inside a
    functorch transform (`torch.func.vmap`, `grad`, ...) DeepSpeed's own Function, whose vmap rule is generated."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    # What torch's `Function.apply` does outside functorch transforms, without its Python: each tensor argument
    # unwrapped where it is a dead functorch wrapper, then autograd's own apply.
    apply, unwrap = super(torch.autograd.Function, Zero3Linear).apply, torch._C._functorch.unwrap_if_dead

    def zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch._C._are_functorch_transforms_active():
            return LinearFunctionForZeroStage3.apply(input, weight, bias)
        return apply(unwrap(input), unwrap(weight), None if bias is None else unwrap(bias), device_type)

    return zero3_linear


def is_deepspeeds(linear: Callable) -> bool:
    """Whether `linear` is DeepSpeed's ZeRO-3 linear: `zero3_linear_wrap`, or the trainer's classic run of its
    Function (train/zero3_functions.py)."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

    return linear is zero3_linear_wrap or getattr(linear, "runs", None) is LinearFunctionForZeroStage3


class Zero3Linear(torch.autograd.Function):
    """DeepSpeed's `LinearFunctionForZeroStage3` (0.19.8) in the classic style, the device type passed in."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, device_type: str):
        if input.dim() == 2 and bias is not None:
            output = torch.addmm(bias, input, weight.t())
        else:
            output = input.matmul(weight.t())
            if bias is not None:
                output += bias
        ctx.device_type = device_type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(input, weight, bias)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        enabled, dtype = ctx.autocast
        if enabled or torch.is_autocast_enabled(ctx.device_type):  # backward under forward's autocast state
            with torch.autocast(device_type=ctx.device_type, enabled=enabled, dtype=dtype):
                return (*_gradients(ctx, grad_output), None)
        return (*_gradients(ctx, grad_output), None)


def _gradients(ctx, grad_output: torch.Tensor) -> tuple:
    """The input's, weight's and bias's gradients, the weight gathered for them where ZeRO-3 had released it."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    input, weight, bias = ctx.saved_tensors
    grad_input = grad_weight = grad_bias = None
    partitioned = hasattr(weight, "ds_id") and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    if partitioned:
        weight.all_gather()
    try:
        dim = grad_output.dim()
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                    input.reshape(-1, input.shape[-1]))  # fmt: skip
            elif dim == 1:
                grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            if dim > 2:
                grad_bias = grad_output.sum(list(range(dim - 1)))
            elif dim == 1:
                grad_bias = grad_output
            else:
                grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias
    finally:
        if partitioned:
            weight.partition()
