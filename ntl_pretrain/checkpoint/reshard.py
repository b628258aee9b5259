"""Resume a ZeRO-3 checkpoint on another number of data-parallel ranks, through DeepSpeed's universal checkpoint.

ZeRO-3 saves each rank's flat shard of the fp32 weights and Adam moments, which only the same number of ranks can
load. DeepSpeed's `ds_to_universal` merges the shards into one file per parameter and state
(`step_<N>/universal/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`); an engine built with
`checkpoint.load_universal: true` then cuts its own partitions from them, on any number of ranks. The data stream
is re-partitioned by `ntl_pretrain.data` (`PackedLoader.load_world_state`).

The conversion runs once, on global rank 0, into the step folder itself (so pruning old checkpoints removes it),
while the other ranks wait in the slow-work group (`process_group.slow_work_group`: it takes longer than the
training group's `train.dist_timeout_seconds` allows at 8B); every rank reads it, so checkpoints must live on a
filesystem all nodes share, as ZeRO-3 resumes already require.
For very large models convert ahead of the relaunch:
`python -m ntl_pretrain.checkpoint.reshard <output_dir>/checkpoints/step_N`.
Either way the checkpoint is verified against its manifest first (the trainer does so on all ranks before
`prepare_resume`), so a damaged shard stops the resume instead of being merged into the universal copy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.checkpoint.manifest import UNIVERSAL
from ntl_pretrain.runtime.process_group import slow_work_group

# One optimizer-state file per data-parallel rank; bf16 runs prefix it with "bf16_".
OPTIMIZER_SHARDS = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"


def saved_world_size(folder: Path) -> int:
    """Data-parallel ranks that wrote the ZeRO-3 checkpoint in `folder`."""
    shards = list(folder.glob(OPTIMIZER_SHARDS))
    if not shards:
        raise FileNotFoundError(f"train.resume: {folder} holds no ZeRO-3 optimizer shards ({OPTIMIZER_SHARDS})")
    return len(shards)


def convert_to_universal(folder: Path, workers: int = 4) -> Path:
    """`folder/universal`, written once: into a temporary folder, with a manifest of its files, renamed when complete.
    A copy there already is reused while it is as its manifest says; else it is converted again from the step's
    shards (verified by the caller), saying why: the copy is derived, so damage to it costs a conversion."""
    target = folder / UNIVERSAL
    if target.is_dir():
        if (damage := manifest.universal_damage(target)) is None:
            return target
        print(f"{target}: {damage}; converting it again from {folder.name}'s shards", file=sys.stderr, flush=True)
        shutil.rmtree(target)
    temp = folder / f"{UNIVERSAL}.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    # A child process: the converter starts worker pools, which a rank holding a process group should not fork.
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
               "--output_folder", str(temp), "--num_extract_workers", str(workers),
               "--num_merge_workers", str(workers)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed on {folder}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    manifest.write(temp, manifest.describe(temp, manifest.all_files(temp)))
    os.replace(temp, target)
    return target


def prepare_resume(folder: Path | None, ds_config: dict, world_size: int) -> dict:
    """The DeepSpeed config to build the engine with. When `folder` was saved by another number of ranks, rank 0
    writes its universal copy (the others wait) and the config asks DeepSpeed to load that copy."""
    if folder is None or saved_world_size(folder) == world_size:
        return ds_config
    failure = [None]
    if dist.get_rank() == 0:
        try:
            convert_to_universal(folder)
        except (OSError, RuntimeError) as error:
            failure = [f"{type(error).__name__}: {error}"]
    # Every rank fails alike instead of waiting forever; the others wait in the slow-work group, whose timeout fits
    # the conversion (`train.dist_timeout_seconds` bounds the training group's collectives).
    dist.broadcast_object_list(failure, src=0, group=slow_work_group())
    if failure[0] is not None:
        raise RuntimeError(f"train.resume: cannot re-partition {folder} for {world_size} ranks: {failure[0]}")
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def load(engine, folder: Path) -> dict:
    """`checkpoint.load`, from the universal copy when the engine was built for it; returns the client state."""
    if not engine.load_universal_checkpoint():
        return checkpoint.load(engine, folder)
    with universal_files_mapped(folder / UNIVERSAL):
        state = checkpoint.load(engine, folder / UNIVERSAL)
    if engine.zero_optimization_stage() == 3:  # stages 1 and 2 restore the groups and steps as saved
        repair_universal_load(engine.optimizer, folder / UNIVERSAL)
    return state


@contextlib.contextmanager
def universal_files_mapped(universal: Path) -> Iterator[None]:
    """While it runs, `torch.load` memory-maps the universal copy's files. DeepSpeed's ZeRO-3 universal load reads
    each parameter's whole fp32 and Adam files on every rank to keep its 1/W partition: W times the checkpoint from
    shared storage (at 8B on 64 ranks, ~25 TB). Mapped, a rank reads only the pages of its partition."""
    plain_load, zero = torch.load, (universal / "zero").resolve()

    def load(source, *args, **kwargs):
        if isinstance(source, (str, os.PathLike)) and zero in Path(source).resolve().parents:
            kwargs.setdefault("mmap", True)
        return plain_load(source, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = plain_load


def repair_universal_load(optimizer, universal: Path) -> None:
    """Undo two departures of DeepSpeed 0.19's ZeRO-3 universal load from the saved optimizer state.

    It copies param group 0's hyper-parameters into every group, which would decay the norms and embeddings
    (group 1, weight_decay 0) like the matrices; and it gives every sub-group the same `step` tensor, which AdamW
    then increments once per sub-group and step, so the bias corrections run ahead. Either changes the loss curve.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, DynamicLossScaler]):
        saved = torch.load(universal / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=True)
    saved_groups = saved["optimizer_state_dict"]["param_groups"]
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ntl_pretrain.checkpoint.reshard", description=convert_to_universal.__doc__
    )
    parser.add_argument("step_folder", type=Path, help="<output_dir>/checkpoints/step_<N>")
    parser.add_argument("--workers", type=int, default=4, help="converter processes")
    args = parser.parse_args(argv)
    checkpoint.verify_before_reading(args.step_folder)
    print(convert_to_universal(args.step_folder, args.workers))


if __name__ == "__main__":
    main()
