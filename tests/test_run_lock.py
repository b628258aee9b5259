"""`<output_dir>.lock` (runtime/run_lock.py): who may take an output folder. A live holder on this host or any
holder on another host is refused naming it; a dead process, a reused pid and an earlier attempt of the same Slurm
job are taken over; a lock file that is not a record is refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import psutil
import pytest

from ntl_pretrain.runtime import run_lock


def holder(**changes) -> dict:
    return {**run_lock.this_process(), **changes}


def parent() -> dict:
    """The record of a live process that is not this one."""
    return holder(pid=os.getppid(), process_start=psutil.Process(os.getppid()).create_time())


def finished_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


TAKEN_OVER = {
    "a process that exited": lambda: holder(pid=finished_pid()),
    "a reused pid": lambda: holder(process_start=1.0),
    "an earlier attempt of this Slurm job": lambda: holder(host="gpu07", slurm_job="4242"),
}
REFUSED = {
    "a live process here": (lambda: parent(), f"pid {os.getppid()} on host {socket.gethostname()}"),
    "a process on another host": (lambda: holder(host="gpu07", slurm_job="17"), "on host gpu07, Slurm job 17"),
    "a torn lock file": (lambda: None, "an unreadable lock file"),
}


@pytest.mark.parametrize("case", sorted(TAKEN_OVER))
def test_the_lock_of_a_run_that_is_gone_is_taken_over(case, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_lock.lock_path(tmp_path).write_text(json.dumps(TAKEN_OVER[case]()))
    run_lock.check_free(tmp_path)
    path = run_lock.acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    run_lock.release(path)
    assert not path.exists()


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_live_or_unknown_holder_is_refused_naming_it_and_the_way_out(case, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    make, named = REFUSED[case]
    record = make()
    text = '{"host": "gpu' if record is None else json.dumps(record)
    run_lock.lock_path(tmp_path).write_text(text)
    for attempt in (run_lock.check_free, run_lock.acquire):
        with pytest.raises(run_lock.RunLocked, match="is in use by another run") as refused:
            attempt(tmp_path)
        assert named in str(refused.value) and f"delete {run_lock.lock_path(tmp_path)}" in str(refused.value)
    assert run_lock.lock_path(tmp_path).read_text() == text  # untouched
    run_lock.release(run_lock.lock_path(tmp_path))  # not ours: kept
    assert run_lock.lock_path(tmp_path).read_text() == text


def test_one_folder_is_one_lock_however_it_is_spelled(tmp_path):
    """Issue 42: a second run through a symlink (or `..`) to a live run's folder is refused like the same spelling."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    (tmp_path / "link").symlink_to(folder)
    path = run_lock.acquire(folder)
    try:
        for spelling in (tmp_path / "link", tmp_path / "runs" / ".." / "runs" / "a"):
            assert run_lock.lock_path(spelling) == path
            with pytest.raises(run_lock.RunLocked, match="is in use by another run"):
                run_lock.check_free(spelling)
    finally:
        run_lock.release(path)


def test_a_study_never_deletes_a_run_folder_that_a_live_run_holds(tmp_path):
    """Issue 42: a second `study` on the same --runs-dir refused, the first one's live run folder left whole."""
    from ntl_pretrain.study.commands import run_all
    from ntl_pretrain.study.runs import StudyRun

    run = StudyRun("ce", 0, tmp_path / "ce.yaml", tmp_path / "runs" / "ce-seed0")
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    path = run_lock.acquire(run.run_dir)  # the first study's training rank holds it
    try:
        with pytest.raises(run_lock.RunLocked, match="is in use by another run"):
            run_all([run], [], [], jobs=1, env={}, logs=tmp_path / "logs", device="cpu")
    finally:
        run_lock.release(path)
    assert (run.run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
