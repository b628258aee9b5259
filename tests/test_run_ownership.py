"""A run owns its processes and its folder, and ends the way a scheduler expects (issue 33), on 2 CPU ranks through
`ntl-pretrain train`.

- A second identical command on a live run is refused at once (exit code 2) and changes nothing in its folder.
- `kill -9` of `ntl-pretrain train` takes DeepSpeed's launchers and both ranks with it within seconds.
- The same command then takes over the dead run's lock and continues; SIGTERM to every process of the run at once
  (what Slurm and cgroup agents do) saves and exits with 75, although DeepSpeed's launchers then exit 143 and 1.
- A rank frozen where it cannot run its signal handler is named by the supervisor before it kills the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.launches import logged_steps, wait_for

from ntl_pretrain.runtime.stopping import EXIT_STOPPED

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
TIMEOUT_S = 300


def command(output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2",
            f"train.output_dir={output_dir}", "train.max_steps=1000", "checkpoint.every_steps=2", "data.seq_len=32",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every_steps=null",
            "logging.progress_bar=false", *overrides]  # fmt: skip


@pytest.fixture
def started(tmp_path):
    """Start commands in sessions of their own. At the end every process whose command line names `tmp_path` is
    killed: a failing test must leave no training run behind, orphans included."""

    def start(argv: list[str], log: Path) -> subprocess.Popen:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

    yield start
    left = [process for process in psutil.process_iter(["cmdline"])
            if any(str(tmp_path) in arg for arg in process.info["cmdline"] or [])]  # fmt: skip
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def ranks_of(process: subprocess.Popen) -> dict[int, psutil.Process]:
    found = {}
    for member in psutil.Process(process.pid).children(recursive=True):
        command_line = member.cmdline()
        if "ntl_pretrain.train" in command_line and "RANK" in member.environ():
            found.setdefault(int(member.environ()["RANK"]), member)
    return found


def folder_state(output_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file's (size, mtime) except metrics.jsonl and the checkpoints the live run keeps writing."""
    return {str(path.relative_to(output_dir)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in output_dir.glob("*") if path.is_file() and path.name != "metrics.jsonl"}  # fmt: skip


def test_a_live_run_refuses_a_second_command_dies_with_its_supervisor_and_stops_with_75_on_a_group_sigterm(
    started, tmp_path
):
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    argv = command(output_dir)
    first = started(argv, log)
    wait_for(lambda: (output_dir / "checkpoints" / "step_2").is_dir(), first, log, TIMEOUT_S)
    rank0 = ranks_of(first)[0]

    before = folder_state(output_dir)
    second = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"is in use by another run (pid {rank0.pid} on host" in second.stderr
    assert f"delete {output_dir}.lock" in second.stderr
    assert folder_state(output_dir) == before

    run = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    assert len(ranks_of(first)) == 2
    os.kill(first.pid, signal.SIGKILL)  # the OOM killer, a node agent: the supervisor cannot clean up
    killed = time.monotonic()
    psutil.wait_procs(run[1:], timeout=10)
    assert not alive(run[1:]), [member.cmdline() for member in alive(run[1:])]
    gone_after = time.monotonic() - killed
    print(f"kill -9 of ntl-pretrain train: its {len(run) - 1} processes were gone after {gone_after:.1f} s")
    assert gone_after < 10
    assert first.wait(timeout=10) == -signal.SIGKILL

    resumed_from = max(logged_steps(output_dir))
    third = started(argv, log)
    continued = lambda: max(logged_steps(output_dir)) > resumed_from + 2 and len(ranks_of(third)) == 2  # noqa: E731
    wait_for(continued, third, log, TIMEOUT_S)
    assert "resuming from" in log.read_text()
    run = [psutil.Process(third.pid), *psutil.Process(third.pid).children(recursive=True)]
    for member in run:  # Slurm, a cgroup agent: every process of the run at once
        member.send_signal(signal.SIGTERM)
    assert third.wait(timeout=120) == EXIT_STOPPED, log.read_text()[-4000:]
    psutil.wait_procs(run, timeout=30)
    assert not alive(run)
    stops = [record for record in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
             if record.get("split") == "stop"]  # fmt: skip
    assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM"
    assert (output_dir / "checkpoints" / "latest").read_text() == f"step_{stops[0]['step']}"
    assert not Path(f"{output_dir}.lock").exists()


def test_the_supervisor_names_a_frozen_rank_before_it_kills_the_run(started, tmp_path):
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    process = started(command(output_dir, "train.stop_grace_seconds=2"), log)
    wait_for(lambda: 2 in logged_steps(output_dir) and len(ranks_of(process)) == 2, process, log, TIMEOUT_S)
    frozen = ranks_of(process)[1]
    frozen.suspend()  # SIGSTOP: like a rank stuck in a collective, it cannot run its signal handler
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) != 0
    assert f"supervisor: rank 1 (pid {frozen.pid}, stopped) has not stopped 17 s after SIGTERM" in log.read_text()
