"""What the trainer replaces inside DeepSpeed's ZeRO optimizers (ntl_pretrain/train/zero_optimizer.py): each
replacement is set only on the DeepSpeed code it was read from, and an engine with them trains exactly as DeepSpeed's
own: the same weights and losses bit for bit at stages 1, 2 and 3 in bf16 and at stage 2 in fp32, 2 ranks, 2
micro-batches a step, clipping on, and a planted inf and NaN gradient skipped as DeepSpeed skips it."""

from __future__ import annotations

import importlib.metadata
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.launches import TINY
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.config.deepspeed import build_deepspeed_config
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.train import zero_optimizer
from ntl_pretrain.train.engine import engine_config

EVERY_REPLACEMENT = ["foreach_gradient_norm", "skip_gradient_scan", "reduce_into_partition", "keep_weights_in_place"]
PLANTED = {2: float("inf"), 3: float("nan")}  # step -> the value planted in one gradient element on rank 1
STEPS = 4


def test_every_replaced_deepspeed_function_is_the_one_read():
    """A DeepSpeed whose code differs from what the replacements were written against keeps its own (slower) code:
    this fails first, so that someone reads the new code, checks each replacement against it and updates READ."""
    changed = [path for path, read in zero_optimizer.READ.items() if zero_optimizer.source_fingerprint(path) != read]
    installed = importlib.metadata.version("deepspeed")
    assert not changed, f"DeepSpeed {installed} changed what was read in {zero_optimizer.READ_FROM}: {changed}"
    reads = (zero_optimizer.NORM_READS, zero_optimizer.SCAN_READS, zero_optimizer.REDUCE_READS,
             zero_optimizer.WEIGHTS_READS)  # fmt: skip
    assert {path for paths in reads for path in paths} == set(zero_optimizer.READ)
    gone = f"{zero_optimizer.ZERO_1_AND_2}.renamed_in_a_later_version"  # is not read: the replacement is not set
    assert zero_optimizer.source_fingerprint(gone) == "unreadable"


def deepspeed_config(stage: int, precision: str) -> dict:
    """The trainer's config for a run of 2 ranks x 1 row x 2 micro-batches, small buckets (a bucket holds a few
    tensors, and stage 2's partitions split tensors between the ranks)."""
    overrides = [f"train.precision={precision}", f"deepspeed.zero_stage={stage}", "train.micro_batch_size=1",
                 "train.global_batch_size=4", "optimizer.grad_clip=0.05"]  # fmt: skip
    config = build_deepspeed_config(load_recipe(TINY, overrides), 2)
    config["zero_optimization"].update(reduce_bucket_size=3000, stage3_param_persistence_threshold=0)
    return config


def plant(step: dict):
    """A tensor hook putting the planted value into one element of a gradient, on rank 1 at the planted steps."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and step["now"] in PLANTED and step["micro"] == 1:
            grad = grad.clone()
            grad.view(-1)[3] = PLANTED[step["now"]]
        return grad

    return hook


def train(stage: int, precision: str, ours: bool) -> dict:
    """STEPS steps of a tiny Llama from seed 0 on fixed batches; per step the loss, whether it was applied, the
    weights after it and the device synchronizations DeepSpeed asked for."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers.integrations import HfDeepSpeedConfig

    config = deepspeed_config(stage, precision)
    if not ours:
        del config["timers"]  # DeepSpeed's own throughput timer
    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 (ZeRO-3 builds the model partitioned while it lives)
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96)  # fmt: skip
    lm = AutoModelForCausalLM.from_config(llama, dtype=torch.float32)
    step = {"now": 0, "micro": 0}
    lm.model.layers[1].mlp.down_proj.weight.register_hook(plant(step))
    engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.AdamW(lm.parameters(), lr=1e-2),
                                      config=engine_config(config, Recipe(), lm))  # fmt: skip
    applied = zero_optimizer.streamline(engine.optimizer) if ours else []
    record = {"applied": applied, "losses": [], "stepped": [], "weights": [], "syncs": 0}
    synchronize = get_accelerator().synchronize

    def counted(*args, **kwargs):
        record["syncs"] += 1
        return synchronize(*args, **kwargs)

    with mock.patch.object(type(get_accelerator()), "synchronize", lambda self, *a, **k: counted(*a, **k)):
        for step["now"] in range(1, STEPS + 1):
            loss = 0.0
            for step["micro"] in range(2):
                generator = torch.Generator().manual_seed(100 * step["now"] + 10 * step["micro"] + dist.get_rank())
                ids = torch.randint(0, 96, (1, 16), generator=generator)
                out = engine(input_ids=ids, labels=ids)
                engine.backward(out.loss)
                engine.step()
                loss += out.loss.item()
            record["losses"].append(loss)
            record["stepped"].append(engine.was_step_applied())
            with deepspeed.zero.GatheredParameters(list(lm.parameters()), enabled=stage == 3):
                record["weights"].append([param.detach().float().clone() for param in lm.parameters()])
    return record


def same_training(stage: int, precision: str) -> None:
    theirs, ours = train(stage, precision, ours=False), train(stage, precision, ours=True)
    expected = {
        1: [],  # bf16 weights with fp32 accumulation at stage 1 run DeepSpeed's BF16_Optimizer, which scans nothing
        2: EVERY_REPLACEMENT if precision == "bf16" else ["foreach_gradient_norm", "keep_weights_in_place"],
        3: ["foreach_gradient_norm"],
    }[stage]
    assert ours["applied"] == expected, (stage, precision, ours["applied"])
    assert ours["losses"] == theirs["losses"], (stage, precision)
    assert ours["stepped"] == theirs["stepped"] == [step not in PLANTED for step in range(1, STEPS + 1)]
    for index, (mine, their) in enumerate(zip(ours["weights"], theirs["weights"], strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(mine, their, strict=True)), (stage, precision, index + 1)
    for planted in PLANTED:  # a skipped step leaves every weight as the step before left it
        before, after = ours["weights"][planted - 2], ours["weights"][planted - 1]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (stage, precision, planted)
    last, before_last = ours["weights"][-1], ours["weights"][-2]
    assert not any(torch.equal(a, b) for a, b in zip(last, before_last, strict=True))  # the step after them trains
    assert ours["syncs"] == 0 and theirs["syncs"] > 0  # DeepSpeed's throughput timer synchronizes, ours is off


def a_changed_deepspeed_keeps_its_own_code() -> None:
    import deepspeed

    config = deepspeed_config(2, "bf16")
    lm = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.AdamW(lm.parameters()), config=config)
    changed = {**zero_optimizer.READ, f"{zero_optimizer.ZERO_1_AND_2}.average_tensor": "0" * 16}
    with mock.patch.object(zero_optimizer, "READ", changed):
        applied = zero_optimizer.streamline(engine.optimizer)
    assert applied == ["foreach_gradient_norm", "skip_gradient_scan", "keep_weights_in_place"]
    assert "allreduce_and_copy_with_multiple_ranks" not in vars(engine.optimizer)


def check_every_stage() -> None:
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    # fp32 at stage 2 takes the other gradient path (no fp32 partition buffer beside the weights); at stage 3 fp32
    # and bf16 gradients are normed alike (fp32 partitions)
    for stage, precision in ((1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp32")):
        same_training(stage, precision)
    a_changed_deepspeed_keeps_its_own_code()


@pytest.mark.slow
def test_our_zero_step_trains_as_deepspeeds_and_skips_a_planted_inf_and_nan():
    run_distributed(check_every_stage, 2, timeout_s=600)
