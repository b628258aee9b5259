"""The console can neither freeze nor kill a run (issue 42): the supervisor relays the launcher's output, drops what a
console does not take, and stops the run on SIGHUP like on SIGTERM.

The launcher here is a small Python program (no DeepSpeed): what is tested is the supervisor between a run and its
console. Each case runs the supervisor in a process of its own whose stdout is a pipe nobody reads, or a pipe whose
reader has gone (`| head`), and checks that the "run" writes everything it means to and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.launches import LAUNCH_TIMEOUT_S, TINY, environment, records

from ntl_pretrain.runtime.console_relay import CONSOLE_TTY_ENV
from ntl_pretrain.runtime.stopping import EXIT_STOPPED, STOP_SIGNALS, StopRequest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
# Writes 8 MiB to stdout (128x a pipe's buffer) in lines, then a marker file: a rank logging while nobody reads.
NOISY_RUN = """
import sys, pathlib
line = "x" * 1023 + "\\n"
for _ in range(8 * 1024):
    sys.stdout.write(line)
sys.stdout.flush()
print("run: finished", file=sys.stderr, flush=True)
pathlib.Path(sys.argv[1]).write_text("done")
"""
# Waits for a stop signal, as a rank does, and records which one came.
STOPPABLE_RUN = """
import os, signal, sys, time, pathlib
from ntl_pretrain.runtime.stopping import STOP_SIGNALS
def stop(signum, _frame):
    pathlib.Path(sys.argv[1]).write_text(signal.Signals(signum).name)
    sys.exit(75)
for signum in STOP_SIGNALS:
    signal.signal(signum, stop)
pathlib.Path(sys.argv[1] + ".ready").write_text(os.environ.get("NTL_PRETRAIN_CONSOLE_TTY", ""))
time.sleep(120)
"""


# A rank's stop handling (`StopRequest`) for a few seconds: which signal stopped it, or that it ran to its end.
RANK_FOR_A_WHILE = """
import os, sys, time, pathlib
from ntl_pretrain.runtime.stopping import StopRequest
stop = StopRequest(grace_seconds=60)
stop.install()
pathlib.Path(sys.argv[1] + ".ready").write_text(str(os.getpid()))
deadline = time.monotonic() + 4
while not stop.requested and time.monotonic() < deadline:
    time.sleep(0.05)
pathlib.Path(sys.argv[1]).write_text(stop.signal_name or "ran to its end")
sys.exit(75 if stop.requested else 0)
"""


def supervised(program: str, marker: Path, stdout, stderr, log: Path | None = None, **popen) -> subprocess.Popen:
    """The supervisor, in a process of its own, running `program` as its launcher (its own lines also to `log`)."""
    launcher = [sys.executable, "-c", program, str(marker)]
    log_file = "None" if log is None else f"Path({str(log)!r})"
    supervisor = "import sys; from pathlib import Path; from ntl_pretrain.runtime.supervisor import supervise; " \
        f"sys.exit(supervise({launcher!r}, grace_seconds=30, log={log_file}))"  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", supervisor], stdout=stdout, stderr=stderr, env=env, **popen)


def test_a_console_nobody_reads_neither_blocks_the_run_nor_keeps_its_supervisor(tmp_path):
    marker, errors = tmp_path / "marker", tmp_path / "stderr.txt"
    read_end, write_end = os.pipe()  # nobody reads: 64 KiB fill it, and a plain child would block at once
    try:
        with errors.open("wb") as stderr:
            process = supervised(NOISY_RUN, marker, write_end, stderr)
            started = time.monotonic()
            assert process.wait(timeout=TIMEOUT_S) == 0
        elapsed = time.monotonic() - started
    finally:
        os.close(write_end)
        os.close(read_end)
    assert marker.read_text() == "done", "the run must write everything it means to"
    said = errors.read_text()
    assert "run: finished" in said
    assert "the console did not take" in said and "metrics.jsonl has every record" in said
    assert elapsed < 30, f"the supervisor waited {elapsed:.0f} s for a console that does not read"


def test_a_closed_console_drops_the_output_and_the_run_ends_normally(tmp_path):
    """The supervisor's own lines are also appended to the run's log (`<output_dir>/logs/supervisor.log` under
    `ntl-pretrain train`): with the console gone, the log alone said what the console missed (issue 72)."""
    marker, errors, log = tmp_path / "marker", tmp_path / "stderr.txt", tmp_path / "logs" / "supervisor.log"
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head` has exited: every write to the pipe fails with EPIPE
    try:
        with errors.open("wb") as stderr:
            process = supervised(NOISY_RUN, marker, write_end, stderr, log)
            assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        os.close(write_end)
    assert marker.read_text() == "done"
    said = errors.read_text()
    assert "BrokenPipeError" not in said and "Traceback" not in said, said[-2000:]
    counted = f"ntl-pretrain: the console did not take {8 * 1024 * 1024:,} bytes of the run's output"  # all of stdout
    assert counted in said, said[-2000:]
    logged = log.read_text().splitlines()
    assert len(logged) == 1 and logged[0].split(" ", 1)[1].startswith(counted), logged


def test_under_nohup_sighup_stops_neither_the_supervisor_nor_a_rank(tmp_path):
    """A run started with SIGHUP ignored (`nohup`) stopped on SIGHUP all the same, exit 75: the supervisor and the
    ranks installed their handlers over the inherited SIG_IGN (issue 72). Here SIGHUP reaches both; the run goes on."""
    marker = tmp_path / "marker"
    with (tmp_path / "console.txt").open("wb") as console:
        process = supervised(RANK_FOR_A_WHILE, marker, console, console, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # fmt: skip
        deadline, ready = time.monotonic() + TIMEOUT_S, Path(f"{marker}.ready")
        while not (ready.exists() and ready.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGHUP)  # the supervisor: a closed terminal's SIGHUP
        os.kill(int(ready.read_text()), signal.SIGHUP)  # and the rank itself
        assert process.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "console.txt").read_text()
    assert marker.read_text() == "ran to its end"


def test_sighup_reaches_the_run_as_a_stop_signal_and_the_terminal_is_announced(tmp_path):
    import pty

    marker = tmp_path / "marker"
    terminal, terminal_peer = pty.openpty()  # the supervisor's stderr is a terminal, its stdout a file
    try:
        with (tmp_path / "stdout.txt").open("wb") as stdout:
            process = supervised(STOPPABLE_RUN, marker, stdout, terminal_peer, start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # fmt: skip
            deadline = time.monotonic() + TIMEOUT_S
            while not Path(f"{marker}.ready").exists():
                assert process.poll() is None and time.monotonic() < deadline, "the run did not start"
                time.sleep(0.1)
            process.send_signal(signal.SIGHUP)  # the terminal closed
            assert process.wait(timeout=TIMEOUT_S) == EXIT_STOPPED
    finally:
        os.close(terminal)
        os.close(terminal_peer)
    assert marker.read_text() == "SIGHUP"
    assert Path(f"{marker}.ready").read_text() == "1", f"{CONSOLE_TTY_ENV} tells the ranks their console is a terminal"


def test_a_rank_takes_sighup_as_a_request_to_save_and_stop():
    assert signal.SIGHUP in STOP_SIGNALS
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        # its grace timer would end this process (os._exit) once it ran out: make it outlast any test session
        stop = StopRequest(grace_seconds=10**9)
        stop.install()
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested and stop.signal_name == "SIGHUP"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_the_launchers_error_line_for_a_graceful_stop_is_not_copied_and_other_codes_are():
    """DeepSpeed's launcher logs `[ERROR] ... exits with return code = 75` on every graceful stop (issue 42); the
    supervisor's stdout relay leaves that line out, and copies the same line for any other code."""
    from ntl_pretrain.runtime.console_relay import ConsoleRelay
    from ntl_pretrain.runtime.supervisor import LAUNCHER_NOISE

    launcher = "[2026-11-27 10:00:00,000] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u'] exits with " \
        "return code = "  # fmt: skip
    read_end, write_end = os.pipe()  # the console
    relay = ConsoleRelay(write_end, LAUNCHER_NOISE)
    with os.fdopen(os.dup(relay.write_fd), "wb") as child:  # the launcher's stdout (start closes the relay's copy)
        relay.start()
        child.write(f"step 5\n{launcher}75\nsaved\n{launcher}1\n{launcher}750\n".encode())
    relay.wait_for_child_output(10)
    relay.close()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as console:
        copied = console.read().decode()
    assert copied == f"step 5\nsaved\n{launcher}1\n{launcher}750\n"


def test_once_the_ranks_reported_and_exited_the_launchers_teardown_is_cut_short():
    """DeepSpeed's runner and launch.py poll their children every second and then tear torch down: 11-43 s after the
    run's last line on a busy machine (issue 59). The "launcher" here reports the ranks' outcome, as the last rank
    does, then takes a minute to exit; the supervisor ends it and exits 0 at once. The other silences are filled
    (tests/test_console_cadence.py)."""
    run = "import time; from ntl_pretrain.runtime import lifeline; lifeline.report_outcome(True); " \
        "print('ntl-pretrain: done', flush=True); time.sleep(600)"  # fmt: skip
    launcher = [sys.executable, "-c", run]
    supervisor = "import sys; from ntl_pretrain.runtime.supervisor import supervise; " \
        f"sys.exit(supervise({launcher!r}, grace_seconds=30))"  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", supervisor], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)  # a teardown waited for would take 10 min  # fmt: skip
    assert done.returncode == 0 and done.stdout == "ntl-pretrain: done\n", done.stderr


@pytest.mark.slow
def test_a_console_gone_before_launch_costs_lines_not_the_run(tmp_path):
    """`train ... 2>&1 | head -n 3` exited 141 during the checks before launch, `>/dev/full` exited 1 (issue 60):
    here stderr is a pipe whose reader has gone and stdout the full device from the start; the run trains and saves
    all the same. (A closed stderr, `2>&-`: tests/test_console_cadence.py.)"""
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "1",
               f"train.output_dir={output_dir}", "train.max_steps=2", "data.seq_len=32", "train.micro_batch_size=2",
               "train.global_batch_size=2", "train.eval_every_steps=null"]  # fmt: skip
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        with open("/dev/full", "wb") as full:  # noqa: PTH123 - the device
            done = subprocess.run(command, cwd=REPO, env=environment(), stdout=full, stderr=write_end,
                                  timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 0
    assert sorted(records(output_dir)) == [1, 2]
    assert (output_dir / "checkpoints" / "step_2" / "manifest.json").is_file()
