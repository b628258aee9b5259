"""What the trainer replaces in ZeRO-3's parameter bookkeeping (ntl_pretrain/train/zero3_bookkeeping.py): each
replacement is set only on the DeepSpeed code it was read from, a DeepSpeed that changed keeps its own code and the
trainer says so, and a trainer with them trains exactly as DeepSpeed's own: the same losses and weights bit for bit
over 20 steps of 2 micro-batches on 2 gloo ranks, with a checkpoint saved between. Under DeepCompile (train.compile
at ZeRO-3) none is set and the engine compiles through DeepSpeed's backend."""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.launches import TINY

from ntl_pretrain.config.deepspeed import deepspeed_on_this_machine
from ntl_pretrain.train import zero3_bookkeeping, zero3_linear
from ntl_pretrain.train.source_fingerprint import fingerprint
from ntl_pretrain.train.zero_optimizer import FastPath

STEPS, SAVE_AT = 20, 10


def test_every_replaced_deepspeed_function_is_the_one_read():
    """A DeepSpeed whose code differs from what the replacements were written against keeps its own (slower) code:
    this fails first, so that someone reads the new code, checks each replacement against it and updates READ."""
    with deepspeed_on_this_machine():
        import deepspeed.runtime.zero.stage3  # noqa: F401 (imports every module READ names)
    installed = importlib.metadata.version("deepspeed")
    with zero3_bookkeeping.deepspeeds_own_process_wide():  # DeepSpeed's own, where a test before replaced them
        changed = sorted(path for path, read in zero3_bookkeeping.READ.items() if fingerprint(path) != read)
    assert not changed, f"DeepSpeed {installed} changed what was read in {zero3_bookkeeping.READ_FROM}: {changed}"
    reads = {path for replacement in zero3_bookkeeping.REPLACEMENTS for paths in replacement.reads.values()
             for path in paths}  # fmt: skip
    assert reads == set(zero3_bookkeeping.READ)


def trainer(folder: Path, *overrides: str):
    from ntl_pretrain.config.deepspeed import load_run
    from ntl_pretrain.train.trainer import Trainer

    run_overrides = ["data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=4",
                     f"train.max_steps={STEPS}", "train.eval_every_steps=null", "logging.progress_bar=false",
                     f"train.output_dir={folder}", "train.resume=null", *overrides]  # fmt: skip
    return Trainer(*load_run(TINY, run_overrides, torch.distributed.get_world_size()))


def train(folder: Path, ours: bool, *overrides: str) -> dict:
    """STEPS steps on fixed batches, a checkpoint at SAVE_AT; the losses, the weights after the last step, the
    checkpoint's tensors and how often DeepSpeed's own release of every parameter ran. Not `ours`: the trainer
    without `streamline_zero3` (DeepSpeed's bookkeeping and autograd Functions as DeepSpeed sets them)."""
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    deepspeeds = mock.patch("ntl_pretrain.train.trainer.streamline_zero3", lambda engine: FastPath((), {}, {}, {}, {}))
    with contextlib.nullcontext() if ours else deepspeeds:
        run = trainer(folder, *overrides)
    persistent = len(run.engine.optimizer.persistent_parameters)
    record = {"replaced": replaced(run.engine), "losses": [], "persistent": persistent}
    release = PartitionedParameterCoordinator.release_and_reset_all
    with mock.patch.object(PartitionedParameterCoordinator, "release_and_reset_all", autospec=True,
                           side_effect=release) as deepspeeds_release:  # fmt: skip
        batches = iter(run.loader)
        for run.step in range(1, STEPS + 1):
            record["losses"].append(run.train_step([next(batches), next(batches)])["loss"])
            if run.step == SAVE_AT:
                run.save()
    record["deepspeeds_releases"] = deepspeeds_release.call_count
    with deepspeed.zero.GatheredParameters(list(run.engine.module.parameters())):
        record["weights"] = [param.detach().clone() for param in run.engine.module.parameters()]
    saved = folder / "checkpoints" / f"step_{SAVE_AT}"
    record["saved"] = {path.name: torch.load(path, map_location="cpu", weights_only=False)
                       for path in sorted(saved.glob("*.pt"))}  # fmt: skip
    return record


def replaced(engine) -> set[str]:
    """Which of DeepSpeed's functions are the trainer's now, instance by instance and process-wide."""
    from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator
    from deepspeed.utils import nvtx

    offload = engine.optimizer.parameter_offload
    hooks = {f"{when}_sub_module_{phase}_function" for when in ("pre", "post") for phase in ("forward", "backward")}
    instances = {*vars(engine.optimizer), *vars(engine), *vars(offload.get_param_coordinator()), *vars(offload)} & {
        "_partition_all_parameters", "_post_step", "_forward_prologue", "_forward_epilogue",
        "reduce_ready_partitions_and_remove_grads", "partition_grads", "fetch_sub_module", *hooks,
        "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"}  # fmt: skip
    process_wide = {
        "print_rank_0": partition_parameters.print_rank_0,
        "iter_params": partitioned_param_coordinator.iter_params,
        "offload's iter_params": parameter_offload.iter_params,
        "F.linear": torch.nn.functional.linear,
    }
    modules = {zero3_bookkeeping.__name__, zero3_linear.__name__}
    ours = {name for name, function in process_wide.items() if function.__module__ in modules}
    return instances | ours | ({"nvtx off"} if not nvtx.enable_nvtx else set())


def same_training(folder: str, *overrides: str) -> None:
    root = Path(folder)
    theirs = train(root / "theirs", False, *overrides)  # first: the process-wide replacements are not set yet
    ours = train(root / "ours", True, *overrides)
    assert theirs["replaced"] == set()
    assert ours["replaced"] == {"_partition_all_parameters", "_post_step", "_forward_prologue", "_forward_epilogue",
                                "reduce_ready_partitions_and_remove_grads", "partition_grads", "fetch_sub_module",
                                "pre_sub_module_forward_function", "post_sub_module_forward_function",
                                "pre_sub_module_backward_function", "post_sub_module_backward_function",
                                "print_rank_0", "iter_params", "offload's iter_params", "F.linear",
                                "nvtx off"} | ({"_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"}
                                               if torch.distributed.get_world_size() == 1 else set())  # fmt: skip
    assert ours["persistent"] == theirs["persistent"] > 0  # gathered again after each step (made available at 1 rank)
    assert ours["losses"] == theirs["losses"]
    assert all(torch.equal(a, b) for a, b in zip(ours["weights"], theirs["weights"], strict=True))
    # DeepSpeed's release of every parameter ran at each optimizer step (a global batch of 4 rows: the 20 calls of 2
    # micro-batches are 20 steps on 2 ranks, 10 on 1); ours replaced it
    assert ours["deepspeeds_releases"] == 0
    assert theirs["deepspeeds_releases"] >= STEPS * torch.distributed.get_world_size() // 2
    assert sorted(ours["saved"]) == sorted(theirs["saved"])
    for name in ours["saved"]:
        assert_same_tensors(ours["saved"][name], theirs["saved"][name], name)


def assert_same_tensors(mine: object, their: object, where: str) -> None:
    """Every tensor in two checkpoint files' nested state equal (paths and other values may differ: folders)."""
    if torch.is_tensor(mine):
        assert torch.equal(mine, their), where
    elif isinstance(mine, dict):
        for key in mine:
            assert_same_tensors(mine[key], their[key], f"{where}.{key}")
    elif isinstance(mine, list | tuple):
        for index, (a, b) in enumerate(zip(mine, their, strict=True)):
            assert_same_tensors(a, b, f"{where}[{index}]")


def a_changed_deepspeed_keeps_its_own_code_and_says_so(folder: str) -> None:
    """`free_param` read differently on rank 1 only: the release stays DeepSpeed's on both ranks (they agree), and
    the run's line names it."""
    import torch.distributed as dist

    freeing = f"{zero3_bookkeeping.PARTITIONING}.free_param"
    changed = {**zero3_bookkeeping.READ, **({freeing: "0" * 16} if dist.get_rank() == 1 else {})}
    with mock.patch.object(zero3_bookkeeping, "READ", changed):
        run = trainer(Path(folder) / "changed")
    assert "_partition_all_parameters" not in vars(run.engine.optimizer)
    assert "release_every_parameter" in run.fast_path.changed and "fetch_in_one_pass" in run.fast_path.on
    line = run.fast_path.line()
    assert "off, as DeepSpeed" in line and "partition_parameters.free_param" in line and "(on rank 1)" in line, line


def deepcompile_takes_the_hooks(folder: str) -> None:
    """Under DeepCompile (its config made where CUDA would be) nothing is replaced and the engine compiles with
    DeepSpeed's backend (on CPU DeepSpeed's build of its op fails: docs/compatibility.md, so the call is recorded)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    with mock.patch("ntl_pretrain.config.deepcompile.ranks_on_cpu", return_value=False):
        with mock.patch.object(DeepSpeedEngine, "compile", autospec=True) as compiled:
            run = trainer(Path(folder) / "deepcompile", "train.compile=true")
    assert run.engine.is_deepcompile_enabled() and run.engine.zero_optimization_stage() == 3
    compiled.assert_called_once_with(run.engine)
    assert "_partition_all_parameters" not in vars(run.engine.optimizer)
    assert set(run.fast_path.unfit.values()) >= {"DeepCompile, which takes ZeRO-3's hooks out"}
    assert not run.engine.module.lm.model.layers[0].__dict__.get("_compiled_call_impl")


def check_everything(folder: str) -> None:
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    same_training(folder)
    a_changed_deepspeed_keeps_its_own_code_and_says_so(folder)
    deepcompile_takes_the_hooks(folder)


def check_one_rank(folder: str, precision: str) -> None:
    """One rank: the persistent parameters are not gathered, only made available (`gather_persistent_at_once`), and
    the gradients are their own partitions (`scatter_alone`): in fp32 as they are, in bf16 converted to the fp32 they
    are reduced in (`train.reduce_dtype`'s default) as DeepSpeed converts them."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    same_training(folder, f"train.precision={precision}")


@pytest.mark.slow
def test_our_zero3_bookkeeping_trains_as_deepspeeds_and_says_when_it_is_off(tmp_path):
    run_distributed(check_everything, 2, str(tmp_path), timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_one_rank_our_zero3_bookkeeping_trains_as_deepspeeds(tmp_path, precision):
    run_distributed(check_one_rank, 1, str(tmp_path), precision, timeout_s=600)
