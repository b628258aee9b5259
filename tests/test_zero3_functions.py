"""ZeRO-3's autograd Functions run classically (ntl_pretrain/train/zero3_functions.py): DeepSpeed's linear layer gives
the same outputs and gradients bit for bit, reads the weight's data at backward as ZeRO-3 re-gathers it, binds no
signature per call and still runs under functorch transforms; a ZeRO-3 trainer step binds no signature and trains
the losses of DeepSpeed's own Functions exactly."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.distributed import run_distributed

from ntl_pretrain.config.deepspeed import deepspeed_on_this_machine
from ntl_pretrain.train.zero3_functions import classic_linear

REPO = Path(__file__).resolve().parents[1]


def deepspeed_linear_function():
    with deepspeed_on_this_machine():
        from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
    return LinearFunctionForZeroStage3


@contextlib.contextmanager
def signatures_bound() -> Iterator[list[object]]:
    """Every function whose signature `inspect` takes inside (torch's `Function.apply` does, to bind the arguments of a
    Function with `setup_context`)."""
    bound, signature = [], inspect.signature

    def counted(function, *args, **kwargs):
        bound.append(function)
        return signature(function, *args, **kwargs)

    inspect.signature = counted
    try:
        yield bound
    finally:
        inspect.signature = signature


def linear_and_gradients(linear, shape: tuple, bias: bool, autocast: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(3, shape[-1], generator=generator))
    b = torch.nn.Parameter(torch.randn(3, generator=generator)) if bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = linear(x, weight, b)
    (y.float() * torch.randn(y.shape, generator=generator)).sum().backward()
    return [y, x.grad, weight.grad, *([b.grad] if bias else [])]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 8), (5, 8), (8,)])
def test_classic_linear_is_deepspeeds_linear_bit_for_bit_and_binds_no_signature(shape, bias, autocast):
    deepspeeds = deepspeed_linear_function()
    with signatures_bound() as bound:
        expected = linear_and_gradients(deepspeeds.apply, shape, bias, autocast)
    assert bound, "DeepSpeed's linear no longer binds its signature at each call: classic_linear is moot"
    with signatures_bound() as bound:
        found = linear_and_gradients(classic_linear(deepspeeds), shape, bias, autocast)
    assert not bound
    assert [tensor.dtype for tensor in found] == [tensor.dtype for tensor in expected]
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))


def test_classic_linear_reads_the_weight_at_backward_as_zero3_regathers_it():
    """ZeRO-3 frees a weight's data after its module's forward and gathers it again for backward: the Parameter itself
    is saved (a `weight.t()` view would hold the forward's storage), so backward multiplies by the data it finds."""
    linear = classic_linear(deepspeed_linear_function())
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 8))
    y = linear(x, weight)
    gathered_again = torch.randn(3, 8)
    weight.data = torch.empty(0)
    weight.data = gathered_again
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones(4, 3) @ gathered_again)


def test_inside_a_functorch_transform_deepspeeds_linear_runs():
    linear = classic_linear(deepspeed_linear_function())
    x, weight = torch.randn(4, 8), torch.randn(3, 8)
    grad = torch.func.grad(lambda inputs: linear(inputs, weight).square().sum())(x)
    torch.testing.assert_close(grad, 2 * (x @ weight.T) @ weight)


def steps_with_and_without_classic_functions(folder: str, steps: int) -> None:
    """Two ZeRO-3 trainers from the same seed and batches: one with the classic Functions (the trainer's default), one
    with DeepSpeed's as it applies them."""
    import deepspeed
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from ntl_pretrain.config.deepspeed import load_run
    from ntl_pretrain.train import trainer as trainer_module
    from ntl_pretrain.train import zero3_bookkeeping
    from ntl_pretrain.train.zero3_functions import MODULE_FUNCTIONS

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")

    def trainer(output_dir: str) -> trainer_module.Trainer:
        overrides = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
                     "train.eval_every_steps=null", "logging.progress_bar=false", f"train.output_dir={output_dir}",
                     "train.resume=null"]  # fmt: skip
        return trainer_module.Trainer(*load_run(REPO / "recipes" / "tiny-cpu.yaml", overrides, 1))

    classic = trainer(f"{folder}/classic")
    hooked = [module for module in classic.engine.module.modules() if "pre_bwd_fn" in module.__dict__]
    functions = [getattr(module, name) for module in hooked for name in MODULE_FUNCTIONS]
    assert hooked and all("setup_context" not in vars(function) for function in functions)
    assert F.linear is not zero3_linear_wrap and F.linear.__name__ == "zero3_linear"
    with mock.patch.object(zero3_bookkeeping, "apply_zero3_functions_classically", lambda module: None):
        deepspeeds = trainer(f"{folder}/deepspeeds")
    loader = iter(classic.loader)
    for batches in [[next(loader)] for _ in range(steps)]:
        with signatures_bound() as bound:
            loss = classic.train_step(batches)["loss"]
        assert not bound, bound
        with mock.patch.object(F, "linear", zero3_linear_wrap):
            assert deepspeeds.train_step(batches)["loss"] == loss


@pytest.mark.slow
def test_a_zero3_step_binds_no_signature_and_trains_deepspeeds_losses_exactly(tmp_path):
    run_distributed(steps_with_and_without_classic_functions, 1, str(tmp_path), 3, timeout_s=300)
