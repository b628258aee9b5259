"""Work that one rank does while the others wait stays out of the training group's collective timeout
(`process_group.slow_work_group`, checkpoint pruning on a thread, shards checksummed while written): 2 gloo ranks
whose collectives time out after 2 s survive a 3 s checkpoint rotation, a 6 s universal-checkpoint conversion, a
3 s share of a resume verification and a 3 s first batch, each on rank 0 alone."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed, tiny_zero3_engine

from ntl_pretrain.checkpoint import manifest, reshard
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.train.trainer import Trainer

pytestmark = pytest.mark.slow
TIMEOUT_S = 2  # of every collective of the default group, once the ranks are set up


def shorten_the_collective_timeout() -> None:
    """Imports and engine creation take seconds, unevenly, on a busy machine: the short timeout starts after them."""
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))


def on_rank_0_slowly(seconds: float, work):
    def slow(*args, **kwargs):
        if dist.get_rank() == 0:
            time.sleep(seconds)
        return work(*args, **kwargs)

    return slow


def train_for(seconds: float) -> None:
    """What the ranks do between saves: a collective every 0.1 s (each would time out if a peer were busy). The
    count is fixed, not read off each rank's clock: ranks leaving a timed loop after different counts would pair
    one rank's extra all_reduce with its peer's next barrier."""
    for _ in range(round(seconds / 0.1)):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


def saves_survive_a_slow_rotation(run: Path) -> None:
    engine = tiny_zero3_engine()
    root = checkpoint.checkpoints_root(run)
    shorten_the_collective_timeout()
    checkpoint._prune = on_rank_0_slowly(3, checkpoint._prune)
    read_back = []
    checksum = manifest.checksum
    manifest.checksum = lambda path: read_back.append(path.name) or checksum(path)
    for step in (1, 2):
        checkpoint.save(engine, root, step, {"step": step}, 1, lambda folder: None)
        train_for(4)
    manifest.checksum = checksum
    assert not [name for name in read_back if "zero_pp_rank" in name], read_back  # checksummed while written
    dist.barrier()
    checkpoint.old_checkpoints_pruned()
    if dist.get_rank() == 0:
        assert [folder.name for folder in checkpoint.published_steps(root)] == ["step_2"]
        assert manifest.verify(root / "step_2") == []


def slow_work_waits_in_its_own_group(scratch: Path) -> None:
    shorten_the_collective_timeout()
    folder = scratch / "checkpoints" / "step_3"  # written by one rank, resumed on two: a universal copy is needed
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")
        manifest.write(folder, manifest.describe(folder, ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]))
    dist.barrier()

    def convert(folder: Path) -> Path:
        (folder / reshard.UNIVERSAL).mkdir()
        return folder / reshard.UNIVERSAL

    reshard.convert_to_universal = on_rank_0_slowly(6, convert)
    config = reshard.prepare_resume(folder, {"zero_optimization": {"stage": 3}}, dist.get_world_size())
    assert config["checkpoint"] == {"load_universal": True}

    manifest.check = on_rank_0_slowly(3, manifest.check)
    assert checkpoint.agree_on_problems(folder, "checksum") == []

    first_batch = on_rank_0_slowly(3, lambda: {"input_ids": torch.ones(1)})
    steps = Trainer._step_batches(SimpleNamespace(loader=iter(lambda: first_batch(), None), grad_accum=2))
    assert len(next(steps)) == 2
    dist.all_reduce(torch.ones(1))  # the step's first collective


def test_one_rank_slow_work_outlasts_the_collective_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_distributed(saves_survive_a_slow_rotation, 2, tmp_path / "run")
    run_distributed(slow_work_waits_in_its_own_group, 2, tmp_path / "resume")
