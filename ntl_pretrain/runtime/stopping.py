"""A graceful stop for training ranks: SIGTERM, SIGINT, SIGUSR1 or SIGHUP saves a checkpoint at the next step boundary
(SIGHUP not under `nohup`: a SIGHUP ignored when the process started stays ignored).

The first signal only sets a flag. After every step the ranks agree on it (`Trainer`: one small all-reduce, so a
signal to any rank stops them all at the same step), save a checkpoint of the step just finished, flush the
metrics and exit with `EXIT_STOPPED`; the command that started the run then continues it (`train.resume: auto`).
Signals that arrive within `DUPLICATE_WINDOW_S` of the first are the same request delivered twice (Ctrl-C reaches
every process of the terminal's group, and launchers forward it too). A later signal, or `train.stop_grace_seconds`
passing without the save done, exits at once: a save writes `step_N.tmp` and renames it only when whole, so the
previous checkpoint stays intact either way.

Slurm: `--signal=USR1@<seconds>` asks a job to stop before its time limit; launch/slurm/train.sbatch requeues the job
when it exits with `EXIT_STOPPED` (docs/multinode.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_STOPPED = 75
"""Exit code of a run stopped by a signal before train.max_steps (EX_TEMPFAIL: run the same command again)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""SIGHUP too: a closed terminal or a dropped ssh session should save and stop, not lose the steps since the last
checkpoint; unless the process started with SIGHUP ignored (`caught_stop_signals`)."""
DUPLICATE_WINDOW_S = 2.0


def caught_stop_signals() -> list[signal.Signals]:
    """STOP_SIGNALS, but SIGHUP where this process started with it ignored: `nohup` (or a parent that ignores it)
    asked the run to outlive its terminal, and the launcher and ranks inherit that disposition."""
    ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    return [signum for signum in STOP_SIGNALS if not (ignored and signum == signal.SIGHUP)]


class StopRequest:
    """Whether this process was asked to stop, set from signal handlers (`install`)."""

    def __init__(self, grace_seconds: float, who: str = ""):
        self.grace_seconds, self.who = grace_seconds, who
        self.signal_name: str | None = None
        self._first_at: float | None = None

    @property
    def requested(self) -> bool:
        return self._first_at is not None

    def install(self) -> None:
        for signum in caught_stop_signals():
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at, self.signal_name = now, signal.Signals(signum).name
            timer = threading.Timer(self.grace_seconds, self._give_up)
            timer.daemon = True  # a run that stops in time exits without waiting for it
            timer.start()
            self._say(f"{self.signal_name}: saving a checkpoint after this step, then stopping (a second signal "
                      f"stops at once)")  # fmt: skip
        elif now - self._first_at > DUPLICATE_WINDOW_S:
            self._say(f"{signal.Signals(signum).name} again: stopping now; the previous checkpoint is intact")
            os._exit(EXIT_STOPPED)

    def _give_up(self) -> None:
        self._say(f"not done {self.grace_seconds:g} s after {self.signal_name} (train.stop_grace_seconds): stopping "
                  f"now without this checkpoint; the previous one is intact")  # fmt: skip
        os._exit(EXIT_STOPPED)

    def _say(self, message: str) -> None:
        print(f"ntl-pretrain: {self.who}{message}", file=sys.stderr, flush=True)
