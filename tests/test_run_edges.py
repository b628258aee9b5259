"""The edges of a run's end (issue 33): a stop asked for during the last step ends the run finished; the stop
record names the signal whichever rank got it (2 gloo ranks); a checkpoint folder the rotation cannot delete is
left with a warning; the supervisor takes the ranks' word on how the run ended over its launcher's exit code."""

from __future__ import annotations

import logging
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers.distributed import run_distributed

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.reporting.profiling import StepProfiler
from ntl_pretrain.runtime import supervisor
from ntl_pretrain.runtime.stopping import EXIT_STOPPED
from ntl_pretrain.train.trainer import Trainer


class ScriptedTrainer(Trainer):
    """`Trainer.train`'s loop over stubs: every rank agrees to stop from step `stop_from` on."""

    def __init__(self, max_steps: int, stop_from: int):
        self.recipe = types.SimpleNamespace(
            train=types.SimpleNamespace(max_steps=max_steps),
            loss=types.SimpleNamespace(ntl=types.SimpleNamespace(kind=None)),
        )
        self.step, self.stop_from, self.grad_accum, self.loader, self.ends = 0, stop_from, 1, range(100), []

    def resume(self) -> None:
        pass

    def _announce_start(self) -> None:
        pass

    def _make_console(self):
        return types.SimpleNamespace(step=lambda record: None, close=lambda: None)

    def _make_logger(self):
        return types.SimpleNamespace(log=lambda record: None, progress=lambda record: None, close=lambda: None)

    def _make_profiler(self) -> StepProfiler:
        return StepProfiler(None, Path("unused"), torch.device("cpu"), 0, print)  # no window: profiles nothing

    def _take_output_dir(self, resumed_at: int) -> None:
        pass

    def _step_batches(self):
        while True:  # no data, and no slow-work group to wait in: one process, no collectives
            yield []

    def train_step(self, batches: list, data_seconds: float = 0.0) -> dict:
        self.step += 1
        return {"step": self.step}

    def _stop_if_nonfinite(self) -> None:
        pass

    def _save_and_evaluate_when_due(self) -> None:
        pass

    def _stop_agreed(self) -> bool:
        return self.step >= self.stop_from

    def _stop_early(self) -> None:
        self.ends.append(("stopped", self.step))

    def _finish(self) -> None:
        self.ends.append(("finished", self.step))


@pytest.mark.parametrize(
    ("stop_from", "finished", "ends"), [(3, True, [("finished", 3)]), (2, False, [("stopped", 2)])]
)
def test_a_stop_during_the_last_step_finishes_the_run(stop_from, finished, ends):
    """A signal during step 3 of 3 (its save, say): the run is done, not "stopped at step 3 of 3" with exit 75."""
    trainer = ScriptedTrainer(max_steps=3, stop_from=stop_from)
    assert trainer.train() is finished
    assert trainer.ends == ends


def _stop_signal_of_rank_1() -> None:
    import torch.distributed as dist

    stop = types.SimpleNamespace(signal_name="SIGUSR1" if dist.get_rank() == 1 else None)
    trainer = types.SimpleNamespace(world_size=2, stop=stop)
    assert Trainer._stop_signal(trainer) == "SIGUSR1"


def test_the_stop_record_names_the_signal_one_rank_got():
    run_distributed(_stop_signal_of_rank_1, 2)


def test_a_checkpoint_the_rotation_cannot_delete_is_left_with_a_warning(tmp_path, monkeypatch, caplog):
    root = checkpoint.checkpoints_root(tmp_path)
    for step in (10, 20, 30):
        (root / f"step_{step}").mkdir(parents=True)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if path == root / "step_10":
            raise PermissionError(13, "Permission denied", str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        checkpoint._prune(root, root / "step_30", keep_last=1)
    assert sorted(path.name for path in root.iterdir()) == ["step_10", "step_30"]
    assert f"cannot delete {root / 'step_10'}" in caplog.text and "Permission denied" in caplog.text


@pytest.mark.parametrize(("outcome", "code"), [("finished", 0), ("stopped", EXIT_STOPPED), (None, 143)])
def test_the_supervisor_exits_with_what_the_ranks_reported(outcome, code):
    """A launcher killed by SIGTERM (143) while its ranks finished or stopped with a checkpoint."""
    outcome_file = "pathlib.Path(os.environ['NTL_SUPERVISOR'].split(':', 2)[2])"
    report = "" if outcome is None else f"{outcome_file}.write_text('{outcome}'); "
    script = f"import os, pathlib, signal; {report}os.kill(os.getpid(), signal.SIGTERM)"
    assert supervisor.supervise([sys.executable, "-c", script], grace_seconds=5) == code


class FailingSave(ScriptedTrainer):
    """The loop of `ScriptedTrainer`, whose save at step 2 fails as a full disk or `ulimit -f` fails it."""

    def __init__(self, output_dir: Path, resumed: Path | None):
        super().__init__(max_steps=4, stop_from=100)
        self.recipe.checkpoint = types.SimpleNamespace(keep_last=2)
        self.output_dir, self.rank, self.world_size, self.engine = output_dir, 0, 1, None
        self.tokens_seen, self.skipped_steps = 0, 0
        self.last_saved_step, self.last_checkpoint = (None, None) if resumed is None else (1, resumed)

    def _save_and_evaluate_when_due(self) -> None:
        if self.step == 2:
            self.save()


def test_a_failed_save_is_never_named_as_an_intact_checkpoint(tmp_path, monkeypatch, capsys):
    """`ulimit -f 3000` on the first save ended with "there is no earlier checkpoint; ... checkpoints (step_2) ...
    are intact" though no step folder existed; a full disk with "step_4 ... intact" right after "step_4 was not
    saved" (issue 72). The line names the checkpoint the run wrote or resumed from, by its folder's name."""
    from ntl_pretrain.train import main as rank_main

    def no_room(engine, root, step, *args):
        raise checkpoint.CheckpointWriteError(f"checkpoint step_{step} was not saved: rank 0: the disk is full")

    monkeypatch.setattr(checkpoint, "save", no_room)
    monkeypatch.setattr(rank_main.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    resumed = checkpoint.checkpoints_root(tmp_path) / "step_7"  # a checkpoint of step 1 under another label
    for before, named in ((None, "none saved yet"), (resumed, "step_7")):
        with pytest.raises(SystemExit):
            rank_main.train_reporting_failures(FailingSave(tmp_path, before))
        line = capsys.readouterr().err.strip()
        assert line.startswith("ntl-pretrain: rank 0: after step 2: CheckpointWriteError: checkpoint step_2 was not "
                               "saved: rank 0: the disk is full; traceback in "), line  # fmt: skip
        assert line.endswith(f"; checkpoints ({named}) and metrics.jsonl are intact"), line


def test_a_failed_write_on_an_almost_full_disk_is_called_a_full_disk(tmp_path, monkeypatch):
    """torch's zip writer with 1 MiB left says only "unexpected pos"; the save's message must say why."""
    error = RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                         "data/0: file write failed; unexpected pos 128 vs 0")  # fmt: skip
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    said = checkpoint._describe_write_error(error, tmp_path)
    assert said.startswith(f"the disk is full ({tmp_path}, 1,048,576 bytes free; RuntimeError: ") and "pos 128" in said
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=10 << 30))
    assert checkpoint._describe_write_error(error, tmp_path).startswith("RuntimeError: [enforce fail")


def test_a_failed_write_names_a_file_size_limit_a_permission_or_a_read_only_disk(tmp_path, monkeypatch):
    """`ulimit -f` makes torch's zip writer say "unexpected pos 2034624 vs 2034516" (measured: a tiny run's first
    save under `ulimit -f 2000`); the save's message must say it is the file-size limit, and name the errno causes."""
    import errno
    import resource

    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2034624 vs 2034516")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (2000 * 1024, resource.RLIM_INFINITY))
    said = checkpoint._describe_write_error(short_write, tmp_path)
    assert said.startswith(f"a file reached the file-size limit: 2,048,000 bytes (ulimit -f) ({tmp_path}; Runtime")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert checkpoint._describe_write_error(short_write, tmp_path).startswith("RuntimeError: [enforce fail")
    too_large = OSError(errno.EFBIG, "File too large")
    assert checkpoint._describe_write_error(too_large, tmp_path).startswith("a file reached the file-size limit (")
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "step_2.tmp"))
    assert checkpoint._describe_write_error(denied, tmp_path).startswith(f"permission denied ({tmp_path}; Permission")
    read_only = OSError(errno.EROFS, "Read-only file system")
    assert checkpoint._describe_write_error(read_only, tmp_path).startswith("the filesystem is read-only (")
