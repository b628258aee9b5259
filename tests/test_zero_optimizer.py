"""What the trainer replaces inside DeepSpeed's ZeRO optimizers (ntl_pretrain/train/zero_optimizer.py): each
replacement is set only where the DeepSpeed code it rests on is the code read, on every rank alike, and an engine with
them trains exactly as DeepSpeed's own: the same weights and losses bit for bit at stages 1, 2 and 3 in bf16, at
stage 2 in fp32 and with bf16 communication, 2 ranks, three parameter groups, 2 micro-batches a step, clipping that
bites, and a planted inf and NaN gradient skipped as DeepSpeed skips it. With optimizer offload, where DeepSpeed
0.19.8 itself keeps skipping every step after a NaN, the steps after the skipped ones train as DeepSpeed's own run
without the skipped steps' batches."""

from __future__ import annotations

import importlib.metadata
import inspect
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
from ntl_pretrain.train.source_fingerprint import UNREADABLE, fingerprint, fingerprint_source

EVERY_REPLACEMENT = ["foreach_gradient_norm", "skip_gradient_scan", "reduce_into_partition", "keep_weights_in_place"]
PLANTED = {2: float("inf"), 3: float("nan")}  # step -> the value planted in one gradient element on rank 1
STEPS = 4
CLIP = 0.05  # below every step's gradient norm: clipping scales each step


def test_every_replaced_deepspeed_function_is_the_one_read():
    """A DeepSpeed whose code differs from what the replacements were written against keeps its own (slower) code:
    this fails first, so that someone reads the new code, checks each replacement against it and updates READ."""
    changed = [path for path, read in zero_optimizer.READ.items() if fingerprint(path) != read]
    installed = importlib.metadata.version("deepspeed")
    assert not changed, f"DeepSpeed {installed} changed what was read in {zero_optimizer.READ_FROM}: {changed}"
    reads = {path for replacement in zero_optimizer.REPLACEMENTS for paths in replacement.reads.values()
             for path in paths}  # fmt: skip
    assert reads == set(zero_optimizer.READ)
    assert fingerprint(f"{zero_optimizer.ZERO_1_AND_2}.renamed_in_a_later_version") == UNREADABLE
    assert fingerprint("deepspeed.runtime.moved_in_a_later_version.combine_grad_norm_groups") == UNREADABLE


def test_a_fingerprint_ignores_comments_docstrings_layout_and_profiling_but_not_code():
    """DeepSpeed's own `allreduce_bucket` rewritten without changing what it does keeps its fingerprint; one
    changed operator, constant or name does not. Under `instrument_w_nvtx` the wrapped function is read, and the
    decorator left out."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(DeepSpeedZeroOptimizer.allreduce_bucket)
    read = fingerprint_source(source)
    assert read == zero_optimizer.READ[f"{zero_optimizer.ZERO_1_AND_2}.allreduce_bucket"]
    reworded = source.replace("        tensor = self.flatten(bucket)\n",
                              '        """Reduce the bucket."""  # flatten first\n\n        tensor = (\n'
                              "            self.flatten(bucket)  # one buffer\n        )\n")  # fmt: skip
    assert reworded != source and fingerprint_source(reworded) == read
    edits = (("div_", "mul_"), ("float(self.sequence_parallel_size)", "float(1)"), ("rank is None", "rank"))
    for before, after in edits:
        assert before in source and fingerprint_source(source.replace(before, after, 1)) != read, before
    wrapped = DeepSpeedZeroOptimizer_Stage3._get_norm_groups
    assert wrapped.__name__ == "wrapped_fn"  # instrument_w_nvtx
    inner = inspect.getclosurevars(wrapped).nonlocals["func"]
    lines = inspect.getsource(inner).splitlines(keepends=True)
    undecorated = "".join(line for line in lines if "@instrument_w_nvtx" not in line)
    assert fingerprint(f"{zero_optimizer.ZERO_3}._get_norm_groups") == fingerprint_source(undecorated)


def test_only_the_span_of_the_bucket_this_rank_owns_is_converted():
    """`train.reduce_dtype: bf16`: the reduced bf16 bucket's owned slices are upcast, not the whole bucket (once a
    ~200 MB transient in fp32), and they add the values DeepSpeed's per-slice add gives."""
    generator = torch.Generator().manual_seed(0)
    bucket = [torch.randn(size, generator=generator).bfloat16() for size in (7, 5, 11, 3, 9)]
    reduced_N = torch.cat(bucket) * 0.5
    outputs = [None, torch.randn(5, generator=generator), None, torch.randn(3, generator=generator), None]
    expected = [None if output is None else output.clone() for output in outputs]
    offset = 0
    for tensor, output in zip(bucket, expected, strict=True):  # DeepSpeed's _add_to_grad_partition_buffer
        if output is not None:
            output.add_(reduced_N.narrow(0, offset, tensor.numel()).to(output.dtype))
        offset += tensor.numel()
    converted = []

    class Conversions(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to:
                converted.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    with Conversions():
        zero_optimizer._add_owned_slices(reduced_N, bucket, outputs)
    assert converted == [5 + 11 + 3]  # from the first owned slice to the end of the last, of a 35-element bucket
    assert all(torch.equal(a, b) for a, b in zip(outputs[1::2], expected[1::2], strict=True))


def deepspeed_config(stage: int, precision: str, reduce_dtype: str | None = None, offload: bool = False) -> dict:
    """The trainer's config for a run of 2 ranks x 1 row x 2 micro-batches, small buckets (a bucket holds a few
    tensors, and stage 2's partitions split tensors between the ranks); with `offload`, the optimizer on the CPU
    stepped by torch's AdamW (DeepSpeed's CPU Adam would compile for minutes first)."""
    overrides = [f"train.precision={precision}", f"deepspeed.zero_stage={stage}", "train.micro_batch_size=1",
                 "train.global_batch_size=4", f"optimizer.grad_clip={CLIP}",
                 *([f"train.reduce_dtype={reduce_dtype}"] if reduce_dtype else [])]  # fmt: skip
    config = build_deepspeed_config(load_recipe(TINY, overrides), 2)
    config["zero_optimization"].update(reduce_bucket_size=3000, stage3_param_persistence_threshold=0)
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def plant(step: dict, planted: dict):
    """A tensor hook putting the planted value into one element of a gradient, on rank 1 at the planted steps."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1 and step["now"] in planted and step["micro"] == 1:
            grad = grad.clone()
            grad.view(-1)[3] = planted[step["now"]]
        return grad

    return hook


def three_groups(lm) -> list[dict]:
    """Decayed matrices, undecayed norms, and the embeddings at half the learning rate."""
    embeddings = [lm.model.embed_tokens.weight]
    rest = [param for param in lm.parameters() if param is not embeddings[0]]
    return [{"params": [param for param in rest if param.dim() >= 2], "weight_decay": 0.1},
            {"params": [param for param in rest if param.dim() < 2], "weight_decay": 0.0},
            {"params": embeddings, "weight_decay": 0.0, "lr": 5e-3}]  # fmt: skip


def tiny_engine(config: dict):
    """A tiny Llama from seed 0 in a DeepSpeed engine of `config`, AdamW over three parameter groups."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 (ZeRO-3 builds the model partitioned while it lives)
    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96)  # fmt: skip
    lm = AutoModelForCausalLM.from_config(llama, dtype=torch.float32)
    optimizer = torch.optim.AdamW(three_groups(lm), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=lm, optimizer=optimizer, config=engine_config(config, Recipe(), lm))
    return engine, lm


def train(config: dict, ours: bool, steps=range(1, STEPS + 1), planted: dict = PLANTED) -> dict:
    """`steps` of a tiny Llama on fixed batches (drawn by step number); per step the loss, whether it was applied,
    the gradient norm, the weights after it, and the device synchronizations DeepSpeed asked for."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    config = dict(config)
    if not ours:
        del config["timers"]  # DeepSpeed's own throughput timer
    engine, lm = tiny_engine(config)
    step = {"now": 0, "micro": 0}
    lm.model.layers[1].mlp.down_proj.weight.register_hook(plant(step, planted))
    fast_path = zero_optimizer.streamline(engine.optimizer) if ours else None
    record = {"on": fast_path and list(fast_path.on), "losses": [], "stepped": [], "norms": [], "weights": [],
              "syncs": 0}  # fmt: skip
    synchronize = get_accelerator().synchronize

    def counted(*args, **kwargs):
        record["syncs"] += 1
        return synchronize(*args, **kwargs)

    stage3 = config["zero_optimization"]["stage"] == 3
    with mock.patch.object(type(get_accelerator()), "synchronize", lambda self, *a, **k: counted(*a, **k)):
        for step["now"] in steps:
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
            record["norms"].append(float(engine.get_global_grad_norm()))
            with deepspeed.zero.GatheredParameters(list(lm.parameters()), enabled=stage3):
                record["weights"].append([param.detach().float().clone() for param in lm.parameters()])
    return record


def same_weights(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def trains_past_the_planted_steps(record: dict, case: str) -> None:
    """The planted steps are skipped, each leaving every weight as the step before left it; the others train,
    clipped."""
    assert record["stepped"] == [step not in PLANTED for step in range(1, STEPS + 1)], case
    for planted in PLANTED:
        assert same_weights(record["weights"][planted - 2], record["weights"][planted - 1]), (case, planted)
    after = record["weights"][max(PLANTED)]  # the first step after them
    assert not any(torch.equal(a, b) for a, b in zip(after, record["weights"][max(PLANTED) - 1], strict=True))
    stepped = zip(record["norms"], record["stepped"], strict=True)
    assert all(norm > CLIP for norm, applied in stepped if applied), record["norms"]


def same_training(stage: int, precision: str, reduce_dtype: str | None = None) -> None:
    case = (stage, precision, reduce_dtype)
    config = deepspeed_config(stage, precision, reduce_dtype)
    theirs, ours = train(config, ours=False), train(config, ours=True)
    expected = {
        1: [],  # bf16 weights with fp32 accumulation at stage 1 run DeepSpeed's BF16_Optimizer, which scans nothing
        2: EVERY_REPLACEMENT if precision == "bf16" else ["foreach_gradient_norm", "keep_weights_in_place"],
        3: ["foreach_gradient_norm"],
    }[stage]
    assert ours["on"] == expected, (case, ours["on"])
    assert ours["losses"] == theirs["losses"], case
    assert ours["stepped"] == theirs["stepped"] and ours["norms"] == theirs["norms"], case
    for index, (mine, their) in enumerate(zip(ours["weights"], theirs["weights"], strict=True)):
        assert same_weights(mine, their), (case, index + 1)
    trains_past_the_planted_steps(ours, str(case))
    assert ours["syncs"] == 0 and theirs["syncs"] > 0  # DeepSpeed's throughput timer synchronizes, ours is off


def offload_trains_after_a_skipped_step() -> None:
    """bf16 ZeRO-2 with `offload_optimizer`: DeepSpeed 0.19.8's own run skips every step after the planted NaN
    (the NaN stays in its fp32 gradient partition); ours trains on, and each of its steps equals DeepSpeed's own
    run that never saw the planted steps' batches."""
    config = deepspeed_config(2, "bf16", offload=True)
    theirs, ours = train(config, ours=False), train(config, ours=True)
    assert theirs["stepped"] == [True, False, False, False]  # DeepSpeed's fault, which ours mends
    assert ours["on"] == ["clear_skipped_gradients"]
    trains_past_the_planted_steps(ours, "offload")
    unplanted = [step for step in range(1, STEPS + 1) if step not in PLANTED]
    reference = train(config, ours=False, steps=unplanted, planted={})
    assert ours["losses"][: min(PLANTED) - 1] == theirs["losses"][: min(PLANTED) - 1]
    assert [ours["losses"][step - 1] for step in unplanted] == reference["losses"]
    for weights, step in zip(reference["weights"], unplanted, strict=True):
        assert same_weights(ours["weights"][step - 1], weights), step


def ranks_agree_where_one_rank_reads_other_code() -> None:
    """Rank 1's DeepSpeed differs in `average_tensor` (another install on its node): neither rank sets the
    replacements resting on it (one would call a collective fewer than the other), and rank 0 says where and why."""
    engine, _ = tiny_engine(deepspeed_config(2, "bf16"))
    changed = f"{zero_optimizer.ZERO_1_AND_2}.average_tensor"
    read = {**zero_optimizer.READ, **({changed: "0" * 16} if dist.get_rank() == 1 else {})}
    with mock.patch.object(zero_optimizer, "READ", read):
        fast_path = zero_optimizer.streamline(engine.optimizer)
    assert fast_path.on == ("foreach_gradient_norm", "skip_gradient_scan", "keep_weights_in_place")
    assert "allreduce_and_copy_with_multiple_ranks" not in vars(engine.optimizer)
    assert fast_path.line() == (
        "DeepSpeed fast path: on: foreach_gradient_norm, skip_gradient_scan, keep_weights_in_place; not for this run: "
        "clear_skipped_gradients (no optimizer offload); off, as DeepSpeed 0.19.8 (on rank 1) differs from the "
        "0.19.8 these were read in (in DeepSpeedZeroOptimizer.average_tensor): reduce_into_partition"
    )
    assert f"{changed}: read {zero_optimizer.READ[changed]} in DeepSpeed 0.19.8; installed: rank 1 " in (
        fast_path.details())  # fmt: skip
    weights_are_repointed_when_their_strides_differ(engine)


def weights_are_repointed_when_their_strides_differ(engine) -> None:
    """A weight at its slice's address with its shape but transposed strides is not the view DeepSpeed's re-pointing
    makes: `keep_weights_in_place` re-points it."""
    optimizer = engine.optimizer
    group = next(index for index, params in enumerate(optimizer.round_robin_bit16_groups)
                 if any(param.dim() == 2 and param.shape[0] == param.shape[1] for param in params))  # fmt: skip
    square = next(param for param in optimizer.round_robin_bit16_groups[group]
                  if param.dim() == 2 and param.shape[0] == param.shape[1])  # fmt: skip
    assert zero_optimizer._weights_in_place(optimizer, group)
    before = square.data.clone()
    square.data = square.data.t()  # the same address and shape
    assert not zero_optimizer._weights_in_place(optimizer, group)
    optimizer._update_model_bit16_weights(group)
    assert zero_optimizer._weights_in_place(optimizer, group) and torch.equal(square.data, before)


def a_changed_deepspeed_keeps_its_own_code() -> None:
    engine, _ = tiny_engine(deepspeed_config(2, "bf16"))
    changed = {**zero_optimizer.READ, f"{zero_optimizer.UTILS}.combine_grad_norm_groups": "0" * 16}
    with mock.patch.object(zero_optimizer, "READ", changed):
        fast_path = zero_optimizer.streamline(engine.optimizer)
    assert fast_path.on == ("reduce_into_partition", "keep_weights_in_place")
    assert {"get_grad_norm_direct", "check_overflow"}.isdisjoint(vars(engine.optimizer))
    assert fast_path.changed == {name: (f"{zero_optimizer.UTILS}.combine_grad_norm_groups",)
                                 for name in ("foreach_gradient_norm", "skip_gradient_scan")}  # fmt: skip


def check_every_stage() -> None:
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    # fp32 at stage 2 takes the other gradient path (no fp32 partition buffer beside the weights); at stage 3 fp32
    # and bf16 gradients are normed alike (fp32 partitions)
    for stage, precision, reduce_dtype in ((1, "bf16", None), (2, "bf16", None), (3, "bf16", None),
                                           (2, "fp32", None), (2, "bf16", "bf16")):  # fmt: skip
        same_training(stage, precision, reduce_dtype)
    offload_trains_after_a_skipped_step()
    ranks_agree_where_one_rank_reads_other_code()
    a_changed_deepspeed_keeps_its_own_code()


@pytest.mark.slow
def test_our_zero_step_trains_as_deepspeeds_and_skips_a_planted_inf_and_nan():
    run_distributed(check_every_stage, 2, timeout_s=600)
