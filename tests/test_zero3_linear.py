"""ZeRO-3's linear layer without DeepSpeed's Python around it (ntl_pretrain/train/zero3_linear.py): the same outputs
and gradients bit for bit as DeepSpeed's `LinearFunctionForZeroStage3` with autocast on or off at forward and at
backward, the weight gathered for backward and released after it where ZeRO-3 had released it, DeepSpeed's own
inside a functorch transform, and a fraction of its Python calls. (On 2 gloo ranks through the trainer:
tests/test_zero3_bookkeeping.py.)"""

from __future__ import annotations

import contextlib
import cProfile
import pstats

import pytest
import torch

from ntl_pretrain.config.deepspeed import deepspeed_on_this_machine
from ntl_pretrain.train.zero3_functions import classic_linear
from ntl_pretrain.train.zero3_linear import lean_zero3_linear


def deepspeeds_function():
    with deepspeed_on_this_machine():
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
    return LinearFunctionForZeroStage3


def autocast(on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def outputs_and_gradients(linear, shape: tuple, bias: bool, forward_autocast: bool, backward_autocast: bool) -> list:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(3, shape[-1], generator=generator))
    b = torch.nn.Parameter(torch.randn(3, generator=generator)) if bias else None
    with autocast(forward_autocast):
        y = linear(x, weight, b)
    with autocast(backward_autocast):
        (y.float() * torch.randn(y.shape, generator=generator)).sum().backward()
    return [y, x.grad, weight.grad, *([b.grad] if bias else [])]


@pytest.mark.parametrize("forward_autocast, backward_autocast", [(False, False), (True, True), (True, False),
                                                                 (False, True)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 8), (5, 8), (8,)])
def test_the_lean_linear_is_deepspeeds_bit_for_bit(shape, bias, forward_autocast, backward_autocast):
    """Backward under an autocast region the forward was not in (or the other way round) runs as DeepSpeed's does:
    in the forward's autocast state."""
    autocasts = (forward_autocast, backward_autocast)
    expected = outputs_and_gradients(deepspeeds_function().apply, shape, bias, *autocasts)
    found = outputs_and_gradients(lean_zero3_linear("cpu"), shape, bias, *autocasts)
    assert [tensor.dtype for tensor in found] == [tensor.dtype for tensor in expected]
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))


def released_weight(gathered: torch.Tensor, calls: list[str]) -> torch.nn.Parameter:
    """A weight as ZeRO-3 leaves it after its module's forward: its status NOT_AVAILABLE, its data gone (NaN here, so
    that autograd can still give it a gradient of its shape); gathering puts `gathered` back, partitioning takes it
    away again (each call recorded)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    weight = torch.nn.Parameter(gathered.clone())
    weight.ds_id = 0

    def all_gather() -> None:
        calls.append("gather")
        weight.data, weight.ds_status = gathered.clone(), ZeroParamStatus.AVAILABLE

    def partition() -> None:
        calls.append("partition")
        weight.data, weight.ds_status = torch.full_like(gathered, torch.nan), ZeroParamStatus.NOT_AVAILABLE

    weight.all_gather, weight.partition = all_gather, partition
    return weight


@pytest.mark.parametrize("make_linear", [lambda: deepspeeds_function().apply, lambda: lean_zero3_linear("cpu")],
                         ids=["deepspeeds", "lean"])  # fmt: skip
def test_a_released_weight_is_gathered_for_backward_and_released_after_it(make_linear):
    linear, calls = make_linear(), []
    gathered = torch.randn(3, 8)
    weight = released_weight(gathered, calls)
    x = torch.randn(4, 8, requires_grad=True)
    y = linear(x, weight)
    weight.partition()  # what ZeRO-3 does after the module's forward
    y.backward(torch.ones_like(y))
    assert calls == ["partition", "gather", "partition"]
    assert torch.equal(x.grad, torch.ones(4, 3) @ gathered) and weight.isnan().all()


def test_inside_a_functorch_transform_deepspeeds_linear_runs():
    x, weight = torch.randn(4, 8), torch.randn(3, 8)
    grad = torch.func.grad(lambda inputs: lean_zero3_linear("cpu")(inputs, weight).square().sum())(x)
    torch.testing.assert_close(grad, 2 * (x @ weight.T) @ weight)


def python_calls(linear) -> int:
    """Python calls of one forward and backward through `linear`, above those of `torch.matmul`'s (the backward
    driver's own)."""

    def calls(linear) -> int:
        x, weight = torch.randn(4, 8, requires_grad=True), torch.nn.Parameter(torch.randn(3, 8))
        linear(x, weight).sum().backward()  # warm: imports and caches outside the count
        profiler = cProfile.Profile()
        profiler.enable()
        linear(x, weight).sum().backward()
        profiler.disable()
        return pstats.Stats(profiler).total_calls

    return calls(linear) - calls(lambda x, weight: torch.matmul(x, weight.t()))


def test_the_lean_linear_makes_a_third_of_the_python_calls_of_the_trainers_previous_one():
    """Against DeepSpeed's Function run classically (train/zero3_functions.py, which the trainer used before) and as
    DeepSpeed runs it; measured 20, 69 and 180 (torch's backward machinery is most of the 20)."""
    lean, classic = python_calls(lean_zero3_linear("cpu")), python_calls(classic_linear(deepspeeds_function()))
    deepspeeds = python_calls(deepspeeds_function().apply)
    assert lean * 2.5 < classic < deepspeeds, (lean, classic, deepspeeds)
