"""`<output_dir>.lock` (ntl_pretrain/run_lock.py): who may take an output folder. A live holder on this host or any
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

from ntl_pretrain import run_lock


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
