"""Run a training launcher so that stopping it stops the whole run, and nothing of the run outlives it.

    python -m ntl_pretrain.runtime.supervisor [--grace-seconds S] -- deepspeed ... --module ntl_pretrain.train RECIPE

`ntl-pretrain train` runs its launcher this way; launch/multinode.sh and launch/slurm/train.sbatch wrap each node's
launcher in it. The launcher (DeepSpeed's runner, its per-node `launch.py`, the ranks) starts in a session of its
own, so a terminal's Ctrl-C or a scheduler's signal reaches the supervisor alone, which forwards SIGTERM, SIGINT
or SIGUSR1 once to each training rank: the ranks save at the next step boundary and exit with
`stopping.EXIT_STOPPED` (stopping.py), then the launcher exits with their code. Before any rank exists the signal
goes to the launcher's whole session instead (nothing to save yet). Whatever is left of the session when the
launcher has exited, or `--grace-seconds` after the first signal, is killed; a second signal is forwarded too
(the ranks then stop at once). A rank still alive when the grace has passed is named before the kill: it could not
run its signal handler (frozen in a collective or in I/O).

The ranks die with the supervisor whatever ends it, and report to it whether they finished or stopped with a
checkpoint, so that the supervisor exits with 0 or `EXIT_STOPPED` also when the signal reached DeepSpeed's
launchers, which then exit 143 or 1 (`lifeline.py`); a rank that refused its input after launch reports the line
that says why, which the supervisor repeats last, exiting 2.

The launcher's stdout and stderr reach the console through `console_relay.py`, so a console that stops reading (a
full pipe, `| head`, a closed terminal) drops lines instead of freezing or killing a rank; SIGHUP (the terminal went
away) stops the run like SIGTERM, unless the supervisor started with SIGHUP ignored (`nohup`): then the launcher and
the ranks inherit the ignored SIGHUP and the run goes on (`stopping.caught_stop_signals`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from ntl_pretrain.errors import EXIT_BAD_INPUT
from ntl_pretrain.runtime import lifeline
from ntl_pretrain.runtime.console_relay import CONSOLE_TTY_ENV, ConsoleRelay, console_is_terminal
from ntl_pretrain.runtime.stopping import EXIT_STOPPED, caught_stop_signals

RANK_MODULE = "ntl_pretrain.train"
SILENCE_TICK_S = 4.5  # rank 0's console says something every 4 s (logging.console_every_seconds); this is a backstop
# DeepSpeed's launcher logs (on stdout) `[ERROR] [launch.py:N:sigkill_handler] [cmd] exits with return code = 75`
# when a run stops as asked, and `= 2` when a rank refuses its input: a line with the whole rank command, where
# `stop_line` or the rank's own refusal (said last, `lifeline.report_refusal`) says what happened. Other codes pass.
LAUNCHER_NOISE = re.compile(rb"(?m)^[^\n]*\[ERROR\] \[launch\.py:\d+:sigkill_handler\] [^\n]* exits with return code = "
                            + f"({EXIT_STOPPED}|{EXIT_BAD_INPUT})".encode() + rb"\r?\n")  # fmt: skip
# Past the ranks' own grace (train.stop_grace_seconds), they exit by themselves; this margin only catches a frozen
# rank, and is shorter than the 30 s after which DeepSpeed's launch.py kills the ranks left beside one that exited,
# so that the supervisor still finds the frozen rank to name it.
EXIT_MARGIN_S = 15.0
DEFAULT_GRACE_SECONDS = 300.0 + EXIT_MARGIN_S  # train.stop_grace_seconds' default
# After the launcher's session is gone, how long the relay may still be copying its last output.
RELAY_DRAIN_S = 5.0


def training_ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's descendants that run `python -m ntl_pretrain.train` (not their forked data-loader workers,
    whose parent is a rank; DeepSpeed's runner names the module after `--module`, not `-m`)."""
    ranks = []
    for process in launcher.children(recursive=True):
        try:
            if _is_rank(process) and not _is_rank(process.parent()):
                ranks.append(process)
        except psutil.Error:  # it exited while we looked
            continue
    return ranks


def _is_rank(process: psutil.Process | None) -> bool:
    if process is None:
        return False
    command = process.cmdline()
    return any(option == "-m" and module == RANK_MODULE for option, module in zip(command, command[1:], strict=False))


def supervise(
    command: list[str],
    env: dict | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    last_line: Callable[[int], str | None] | None = None,
    silence_tick_s: float = SILENCE_TICK_S,
    log: Path | None = None,
) -> int:
    """Run `command` in a session of its own until it exits; forward stop signals to its ranks. Returns 0 when the
    ranks reported that they finished, `EXIT_STOPPED` when they stopped on a signal with a checkpoint, else the
    command's exit code (128 + signal when a signal ended it). `last_line(code)`: a line for stderr after the run's
    own output (through the same relay, so that it cannot block either). Whenever the run has written nothing for
    `silence_tick_s`, a line says so: until rank 0's first line that it is still starting (the ranks import torch
    and build the model: 30 s and more), after it that the ranks still run. Once the ranks reported their outcome
    and exited, the launchers' own teardown (seconds of polling and interpreter exit) is cut short. `log`: a file
    that each line of the supervisor's own is appended to as well (`OwnLines`), whatever the console does."""
    handle, name = tempfile.mkstemp(prefix="ntl-pretrain-outcome-")
    os.close(handle)
    outcome_file = Path(name)
    relays = ConsoleRelay(_descriptor(sys.stdout, 1), LAUNCHER_NOISE), ConsoleRelay(_descriptor(sys.stderr, 2))
    terminal = {CONSOLE_TTY_ENV: "1"} if console_is_terminal(relays[1].destination_fd) else {}
    say = OwnLines(relays[1], log).say
    try:
        env = {**(env or os.environ), **lifeline.environment(outcome_file), **terminal}
        code = _run(command, env, grace_seconds, relays, silence_tick_s, outcome_file, say)
        outcome = lifeline.reported_outcome(outcome_file)
        code = {lifeline.FINISHED: 0, lifeline.STOPPED: EXIT_STOPPED, lifeline.REFUSED: EXIT_BAD_INPUT}.get(
            outcome, code
        )
        if outcome == lifeline.REFUSED:  # the rank's line, not the launcher's (gloo's, DeepSpeed's sigkill_handler)
            line = f"ntl-pretrain: {lifeline.reported_refusal(outcome_file)}"
        else:
            line = last_line(code) if last_line is not None else None
        _close_relays(relays, line, say)
        return code
    finally:
        outcome_file.unlink(missing_ok=True)


class OwnLines:
    """The supervisor's own lines: to the console through the stderr relay (bounded, never blocking), and appended
    to `log` with the time (`<output_dir>/logs/supervisor.log` under `ntl-pretrain train`), so that a console that
    failed or went away (a closed ssh session, `>/dev/full`) loses none of them. A log that cannot be written
    (a full disk) costs its lines, never the run."""

    def __init__(self, relay: ConsoleRelay, log: Path | None):
        self.relay, self.log = relay, log

    def say(self, line: str) -> None:
        self.relay.say(line)
        if self.log is None:
            return
        try:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a", encoding="utf-8") as file:
                file.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
        except OSError:
            pass


def _descriptor(stream, default: int) -> int:
    """The file descriptor behind `stream`; the process's own (1, 2) where a test or a notebook replaced it."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return default


def _close_relays(relays: tuple[ConsoleRelay, ConsoleRelay], line: str | None, say: Callable[[str], None]) -> None:
    """Copy what is left of the run's output, then the last line and a count of what the console did not take."""
    for relay in relays:
        relay.wait_for_child_output(RELAY_DRAIN_S)
    stdout, stderr = relays
    if line is not None:
        say(line)
    dropped = stdout.dropped_bytes + stderr.dropped_bytes
    if dropped:
        say(f"ntl-pretrain: the console did not take {dropped:,} bytes of the run's output (metrics.jsonl has every "
            f"record)")  # fmt: skip
    for relay in relays:
        relay.close()


def _run(command: list[str], env: dict, grace_seconds: float, relays: tuple[ConsoleRelay, ConsoleRelay],
         silence_tick_s: float, outcome_file: Path, say: Callable[[str], None]) -> int:  # fmt: skip
    stdout, stderr = relays
    silence = SilenceLine(relays, silence_tick_s)
    launcher = subprocess.Popen(command, env=env, start_new_session=True, stdout=stdout.write_fd,
                                stderr=stderr.write_fd)  # fmt: skip
    for relay in relays:
        relay.start()
    first_signal: list[tuple[float, str]] = []

    def forward(signum: int, _frame) -> None:
        first_signal[:] = first_signal or [(time.monotonic(), signal.Signals(signum).name)]
        ranks = training_ranks(psutil.Process(launcher.pid))
        if not ranks:
            _signal_session(launcher.pid, signum)
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.Error:
                pass

    previous = {signum: signal.signal(signum, forward) for signum in caught_stop_signals()}
    try:
        while launcher.poll() is None:
            if first_signal and time.monotonic() - first_signal[0][0] > grace_seconds:
                _name_frozen_ranks(launcher, grace_seconds, first_signal[0][1], say)
                _signal_session(launcher.pid, signal.SIGKILL)
                launcher.wait()
                break
            if _ranks_done(outcome_file, launcher):
                _signal_session(launcher.pid, signal.SIGKILL)
                launcher.wait()
                break
            if (line := silence.line()) is not None:
                say(line)
            time.sleep(0.2)
        deadline = first_signal[0][0] + grace_seconds if first_signal else time.monotonic()
        _end_session(launcher.pid, deadline)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    code = launcher.returncode
    return 128 - code if code < 0 else code


class SilenceLine:
    """What the supervisor says when the run has written nothing for `tick_s` (its own lines count as lines)."""

    def __init__(self, relays: tuple[ConsoleRelay, ...], tick_s: float, clock: Callable[[], float] = time.monotonic):
        self.relays, self.tick_s, self.clock = relays, tick_s, clock
        self.started = self.said_at = clock()

    def line(self) -> str | None:
        now = self.clock()
        heard = max([self.said_at, *(relay.received_at for relay in self.relays if relay.received_at is not None)])
        if now - heard < self.tick_s:
            return None
        self.said_at = now
        if not any(relay.said_own_line for relay in self.relays):
            elapsed = now - self.started
            return f"ntl-pretrain: still starting ({elapsed:.0f} s): the ranks import torch and DeepSpeed, then " \
                "build the model"  # fmt: skip
        return f"ntl-pretrain: still running ({now - heard:.0f} s without a line from the ranks)"


def _ranks_done(outcome_file: Path, launcher: subprocess.Popen) -> bool:
    """The ranks reported how the run ended and none is left: what remains is the launchers' teardown."""
    if lifeline.reported_outcome(outcome_file) is None:
        return False
    try:
        return not training_ranks(psutil.Process(launcher.pid))
    except psutil.Error:
        return False


def _name_frozen_ranks(
    launcher: subprocess.Popen, grace_seconds: float, signal_name: str, say: Callable[[str], None]
) -> None:
    """One line per rank that outlived the grace: it never ran its signal handler, so it is stuck where Python
    cannot interrupt it (a collective whose peer is gone, a hung file system)."""
    for rank in training_ranks(psutil.Process(launcher.pid)):
        try:
            number, status = rank.environ().get("RANK", "?"), rank.status()
        except psutil.Error:
            continue
        say(f"ntl-pretrain: supervisor: rank {number} (pid {rank.pid}, {status}) has not stopped {grace_seconds:g} s "
            f"after {signal_name}: frozen where it cannot run its signal handler (a collective whose peer is gone, "
            f"a hung file system); killing the run")  # fmt: skip


def _signal_session(session_id: int, signum: int) -> None:
    try:
        os.killpg(session_id, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _end_session(session_id: int, deadline: float) -> None:
    """Let what is left of the launcher's session (ranks still saving) finish until `deadline`, then kill it."""
    while _session_alive(session_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_session(session_id, signal.SIGKILL)


def _session_alive(session_id: int) -> bool:
    try:
        os.killpg(session_id, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ntl_pretrain.runtime.supervisor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_SECONDS,
                        help="after the first stop signal, kill what is left of the run this much later")  # fmt: skip
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launcher command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the launcher command after --")
    sys.exit(supervise(command, grace_seconds=args.grace_seconds))


if __name__ == "__main__":
    main()
