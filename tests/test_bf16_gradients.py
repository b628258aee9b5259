"""bf16 runs add micro-batch gradients and reduce them over ranks in fp32 (deepspeed_config.set_bf16_gradient_dtypes):
the generated DeepSpeed config, and a 2-rank bf16 ZeRO-3 engine built from it whose accumulated gradient keeps what
bf16 sums would round away."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.launches import REPO, TINY

from ntl_pretrain.config.deepspeed import build_deepspeed_config
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError

MICRO_BATCHES = 16
# 2 ranks x 1 row x 16 micro-batches = 32 sequences: 16 micro-batches per step, as the 8B recipe on 8 GPUs.
BF16_OVERRIDES = ["train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=32"]


def test_bf16_runs_accumulate_and_reduce_gradients_in_fp32():
    config = build_deepspeed_config(load_recipe(TINY, BF16_OVERRIDES), 2)
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["communication_data_type"] == "fp32"
    fp32 = build_deepspeed_config(load_recipe(TINY, ["train.precision=fp32"]), 2)
    assert "data_types" not in fp32 and "communication_data_type" not in fp32


def test_the_recipe_chooses_the_reduction_dtype_and_a_disagreeing_json_is_refused(tmp_path):
    config = build_deepspeed_config(load_recipe(TINY, [*BF16_OVERRIDES, "train.reduce_dtype=bf16"]), 2)
    assert config["communication_data_type"] == "bf16" and config["data_types"] == {"grad_accum_dtype": "fp32"}
    chosen = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    chosen["communication_data_type"] = "fp32"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(chosen))
    with pytest.raises(
        RecipeError, match=r"train.reduce_dtype: bf16, but .*ds.json sets communication_data_type: fp32"
    ):
        build_deepspeed_config(
            load_recipe(TINY, [*BF16_OVERRIDES, "train.reduce_dtype=bf16", f"deepspeed.config={path}"]), 2
        )
    with pytest.raises(RecipeError, match=r"train.reduce_dtype: only for precision bf16"):
        load_recipe(TINY, ["train.precision=fp32", "train.reduce_dtype=bf16"])


def test_a_deepspeed_json_may_choose_bf16_reduction(tmp_path):
    chosen = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    chosen["communication_data_type"] = "bf16"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(chosen))
    config = build_deepspeed_config(load_recipe(TINY, [*BF16_OVERRIDES, f"deepspeed.config={path}"]), 2)
    assert config["communication_data_type"] == "bf16"
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}


def accumulate_sixteen_micro_batches(config: dict) -> None:
    """d loss / d w = x for loss = w·x. Rank 0's first micro-batch has x = 256, every other x = 1: the exact mean
    over ranks of the summed micro-batch gradients, each scaled by 1/16, is (256 + 15 + 16) / 2 / 16 = 8.96875.
    bf16 (spacing 0.125 at 16) rounds 16 + 1/16 back to 16 in the reduction and in the accumulation (8.9375)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 1, bias=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.communication_data_type == torch.float32
    for micro in range(MICRO_BATCHES):
        x = torch.full((1, 4), 256.0 if micro == 0 and dist.get_rank() == 0 else 1.0, dtype=torch.bfloat16)
        engine.backward(engine(x).sum())
        if micro < MICRO_BATCHES - 1:
            engine.step()  # not yet a boundary: DeepSpeed only accumulates
    accumulated = engine.optimizer.grad_partitions_flat_buffer
    assert accumulated.dtype == torch.float32
    torch.testing.assert_close(accumulated, torch.full_like(accumulated, 8.96875), rtol=0, atol=0)


@pytest.mark.slow
def test_a_bf16_engine_from_the_generated_config_accumulates_in_fp32(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    config = build_deepspeed_config(load_recipe(TINY, BF16_OVERRIDES), 2)
    assert config["gradient_accumulation_steps"] == MICRO_BATCHES
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition the 4-element weight too
    run_distributed(accumulate_sixteen_micro_batches, 2, config)
