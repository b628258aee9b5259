"""The ranks' side of `supervisor.py`: a rank dies with its supervisor, and tells it how the run ended.

The supervisor puts `NTL_SUPERVISOR=<host>:<pid>:<outcome file>` into its launcher's environment; DeepSpeed's
runner and `launch.py` hand it to every rank they start on that node (pdsh carries no `NTL_` variable to other
nodes, and a value from another host is ignored).

- `watch_supervisor`: whatever ends the supervisor (SIGKILL, the OOM killer, a node agent), a thread of every rank
  sees it within `POLL_S` and kills the rank's process group: the session the supervisor started its launcher in,
  so DeepSpeed's runner, `launch.py`, every rank and data-loader worker go with it, and nothing of the run trains
  beside the job that replaces it. A rank that starts after its supervisor is gone ends the group at once.
- `report_outcome` / `reported_outcome`: the ranks write whether they finished or stopped on a signal with a
  checkpoint; the supervisor then exits with 0 or `stopping.EXIT_STOPPED` whatever its launcher returned (a
  SIGTERM to every process of the run ends DeepSpeed's runner with 143 and `launch.py` with 1 while the ranks save
  and exit 75, or finish the last step).
- `report_refusal` / `reported_refusal`: a rank that refuses its input after launch (a recipe a resume cannot
  continue, a source that gives it no document) writes the line that says why; the supervisor exits 2, as for
  input refused before launch, and says that line last, after the launcher's and the other ranks' lines.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import psutil

VARIABLE = "NTL_SUPERVISOR"
FINISHED, STOPPED, REFUSED = "finished", "stopped", "refused"
POLL_S = 0.5


def environment(outcome_file: Path) -> dict[str, str]:
    """The variable the supervisor (this process) gives its launcher."""
    return {VARIABLE: f"{socket.gethostname()}:{os.getpid()}:{outcome_file}"}


def _parse() -> tuple[int, Path] | None:
    """(supervisor pid, outcome file) when this process runs under a supervisor on this host."""
    value = os.environ.get(VARIABLE)
    if not value:
        return None
    host, pid, outcome_file = value.split(":", 2)
    return (int(pid), Path(outcome_file)) if host == socket.gethostname() else None


def watch_supervisor(who: str) -> None:
    """Start the thread that ends this rank's process group when the supervisor is gone (no-op without one)."""
    found = _parse()
    if found is None:
        return
    try:
        supervisor = psutil.Process(found[0])
        alive = supervisor in psutil.Process().parents()  # a reused pid is not our ancestor
    except psutil.NoSuchProcess:
        alive = False
    if not alive:
        _end_run(who, found[0])  # does not return: the SIGKILL reaches this process too
    threading.Thread(target=_wait_for, args=(supervisor, who), daemon=True, name="ntl-lifeline").start()


def _wait_for(supervisor: psutil.Process, who: str) -> None:
    while _running(supervisor):
        time.sleep(POLL_S)
    _end_run(who, supervisor.pid)


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (a killed supervisor stays one until its own parent reaps it)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _end_run(who: str, supervisor_pid: int) -> None:
    try:  # the supervisor relayed this process's output: with it gone, the pipe may be too (EPIPE)
        print(f"ntl-pretrain: {who}the supervisor (pid {supervisor_pid}) is gone: ending this node's processes of "
              f"the run", file=sys.stderr, flush=True)  # fmt: skip
    except OSError:
        pass
    os.killpg(os.getpgid(0), signal.SIGKILL)


def report_outcome(finished: bool) -> None:
    """Tell the supervisor how the ranks ended: `finished` (train.max_steps reached) or stopped on a signal with a
    checkpoint."""
    found = _parse()
    if found is not None:
        found[1].write_text(FINISHED if finished else STOPPED)


def supervised() -> bool:
    """Whether a supervisor on this host runs this process's launch (and so says what the ranks report)."""
    return _parse() is not None


def report_refusal(line: str) -> None:
    """Tell the supervisor that this rank refused its input, and why (`line`, one line)."""
    found = _parse()
    if found is not None:
        found[1].write_text(f"{REFUSED}\n{line}")


def reported_outcome(outcome_file: Path) -> str | None:
    """`FINISHED`, `STOPPED`, `REFUSED`, or None when no rank reported (supervisor side)."""
    text = outcome_file.read_text().strip() if outcome_file.is_file() else ""
    outcome = text.split("\n", 1)[0]
    return outcome if outcome in (FINISHED, STOPPED, REFUSED) else None


def reported_refusal(outcome_file: Path) -> str | None:
    """The line a rank refused its input with (`report_refusal`), or None."""
    if reported_outcome(outcome_file) != REFUSED:
        return None
    return outcome_file.read_text().split("\n", 1)[1].strip()
