"""No silent minute (issue 59): rank 0's console says something at least every `logging.console_every_seconds`
whatever a step takes, the supervisor fills any silence of the run's output, library lines and bars stay off a
run's console, and a console that fails (closed, full, gone) costs lines, never the command (issue 60).

Time is a fake clock here, advanced by hand, and `tick` is called as the console's thread would call it: nothing in
these tests depends on how fast the machine is."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from ntl_pretrain.errors import LossyStream
from ntl_pretrain.reporting.console import RunConsole, library_lines_to, ongoing
from ntl_pretrain.runtime.supervisor import SilenceLine

REPO = Path(__file__).resolve().parents[1]
STEP = {"loss": 2.0, "ce": 1.5, "ntl": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0, "peak_mem_mib": 10.0, "tokens": 64}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plain_console(clock: Clock, log: io.StringIO, every_steps: int = 10, every_seconds: float = 4.0) -> RunConsole:
    return RunConsole(enabled=True, total_steps=100, first_step=0, first_tokens=0, progress_bar=False,
                      every_steps=every_steps, every_seconds=every_seconds, stream=log, clock=clock,
                      ticking=False)  # fmt: skip


def said(log: io.StringIO) -> list[str]:
    """The lines so far, each cut before its figures, and forgotten (the next call returns the new ones)."""
    lines = [line.removeprefix("ntl-pretrain: ").split(" loss ")[0] for line in log.getvalue().splitlines()]
    log.seek(0)
    log.truncate()
    return lines


def test_a_slow_step_is_named_every_period_and_its_line_comes_when_it_ends():
    clock, log = Clock(), io.StringIO()
    console = plain_console(clock, log)
    console.step({**STEP, "step": 1})  # the first step: always said
    assert said(log) == ["step 1/100"]
    clock.now += 3.9
    console.tick()
    assert said(log) == []
    clock.now += 0.1
    console.tick()
    assert said(log) == ["step 2/100 under way (4 s)"]
    clock.now += 4.0
    console.tick()
    assert said(log) == ["step 2/100 under way (8 s)"]
    clock.now += 1.0
    console.step({**STEP, "step": 2})  # 1 s after the last line: not due by time, not by steps
    assert said(log) == []
    clock.now += 3.0
    console.tick()  # 4 s of silence: the step that ended, not the one under way
    assert said(log) == ["step 2/100"]


def test_fast_steps_get_a_line_every_period_as_well_as_every_n_steps():
    clock, log = Clock(), io.StringIO()
    console = plain_console(clock, log, every_steps=25)
    printed = []
    for step in range(1, 51):  # 0.5 s a step: 25 s in all
        clock.now += 0.5
        console.step({**STEP, "step": step})
        console.tick()
        printed += said(log)
    # the first step; then one every 4 s (8 steps); step 25 and 50 by steps
    assert printed == ["step 1/100", "step 9/100", "step 17/100", "step 25/100", "step 33/100", "step 41/100",
                       "step 49/100", "step 50/100"]  # fmt: skip


def test_work_between_steps_is_named_while_it_lasts_then_the_next_step():
    clock, log = Clock(), io.StringIO()
    console = plain_console(clock, log)
    console.step({**STEP, "step": 1})
    clock.now += 1.0
    console.step({**STEP, "step": 2})  # not said: 1 s after step 1's line
    with console.doing("saving checkpoint step 2"):
        clock.now += 4.0
        console.tick()  # the save is under way, not step 2 (whose line would come after the save's)
        clock.now += 4.0
        console.tick()
    clock.now += 4.0
    console.tick()
    assert said(log) == ["step 1/100", "saving checkpoint step 2", "saving checkpoint step 2 (4 s)",
                         "saving checkpoint step 2 (8 s)", "step 3/100 under way (4 s)"]  # fmt: skip


def test_after_the_last_step_the_run_is_ending_and_zero_seconds_means_steps_alone():
    clock, log = Clock(), io.StringIO()
    console = RunConsole(enabled=True, total_steps=2, first_step=1, first_tokens=0, progress_bar=False, every_steps=0,
                         every_seconds=4.0, stream=log, clock=clock, ticking=False)  # fmt: skip
    console.step({**STEP, "step": 2})
    clock.now += 5.0
    console.tick()
    assert said(log) == ["step 2/2", "ending the run (5 s)"]
    console = plain_console(clock, log, every_seconds=0)
    console.step({**STEP, "step": 1})
    clock.now += 100.0
    console.tick()
    assert said(log) == ["step 1/100"]


def test_the_console_thread_ticks_on_its_own_until_closed():
    log = io.StringIO()
    console = RunConsole(enabled=True, total_steps=3, first_step=0, first_tokens=0, progress_bar=False, every_steps=1,
                         every_seconds=0.05, stream=log)  # fmt: skip
    time.sleep(0.5)  # a slow first step
    console.close()
    lines = log.getvalue().splitlines()
    assert len(lines) >= 2 and all(line.startswith("ntl-pretrain: step 1/3 under way (") for line in lines), lines
    time.sleep(0.2)
    assert log.getvalue().splitlines() == lines  # closed: no more lines


class Failing(io.TextIOBase):
    """A console that takes nothing: a pipe `| head` closed, a full disk."""

    def __init__(self, error: OSError):
        self.error = error

    def write(self, text: str) -> int:
        raise self.error

    def flush(self) -> None:
        raise self.error


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), OSError(28, "No space left on device")])
def test_a_console_that_fails_costs_lines_not_the_run(error):
    clock = Clock()
    console = RunConsole(enabled=True, total_steps=3, first_step=0, first_tokens=0, progress_bar=False, every_steps=1,
                         every_seconds=4.0, stream=Failing(error), clock=clock, ticking=False)  # fmt: skip
    console.step({**STEP, "step": 1})
    with console.doing("saving checkpoint step 1"):
        clock.now += 5.0
        console.tick()
    console.summary(Path("checkpoint"), Path("run"))
    with ongoing("checking r.yaml", stream=Failing(error), at_once=True, tick_s=0.01) as stage:
        stage("the libraries", say=True)
        time.sleep(0.05)


def test_a_closed_stderr_is_no_terminal_and_ongoing_says_nothing_there(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # how Python starts a process whose stderr is closed (`2>&-`)
    with ongoing("checking r.yaml", at_once=True, tick_s=0.01) as stage:
        stage("the libraries")
        time.sleep(0.05)


def test_a_full_console_is_pointed_at_dev_null_after_its_first_failure():
    with open("/dev/full", "w") as full:  # noqa: PTH123 - the device, as `>/dev/full` gives it
        stream = LossyStream(full)
        stream.write("ntl-pretrain: checking r.yaml\n" * 1000)  # more than the buffer: the write itself fails
        stream.flush()
        assert os.readlink(f"/proc/self/fd/{full.fileno()}") == os.devnull
        stream.write("later lines go nowhere\n")
        stream.flush()


def test_a_command_started_with_its_standard_streams_closed_gets_dev_null_there():
    """Else the next pipe takes fd 2, and what the command prints lands in that pipe (the relay's own)."""
    child = "import os, sys; from ntl_pretrain.errors import keep_standard_streams_open\n" \
        "assert sys.stderr is None\nkeep_standard_streams_open()\nprint('said', file=sys.stderr)\n" \
        "print(*os.pipe(), os.readlink('/proc/self/fd/2'))"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", child], capture_output=False, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=lambda: os.close(2),
                          timeout=60, check=True)  # fmt: skip
    read_end, write_end, stderr = done.stdout.split()
    assert min(int(read_end), int(write_end)) > 2 and stderr == os.devnull


def test_library_lines_go_to_the_runs_log_and_their_bars_are_off(tmp_path, capfd):
    from deepspeed.utils import logger as deepspeed_logger
    from transformers.utils import logging as transformers_logging

    loggers = (deepspeed_logger, transformers_logging.get_logger(), logging.getLogger("py.warnings"))

    def settings() -> tuple:
        handlers = [(logger.handlers[:], logger.propagate) for logger in loggers]
        return handlers, transformers_logging.is_progress_bar_enabled()

    before, log = settings(), tmp_path / "logs" / "libraries-rank0.log"
    capfd.readouterr()  # DeepSpeed's import says which accelerator it found
    with library_lines_to(log):
        deepspeed_logger.warning("a DeepSpeed warning")
        transformers_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
        warnings.warn("a Python warning", UserWarning, stacklevel=1)
        assert not transformers_logging.is_progress_bar_enabled()
    assert settings() == before  # put back as they were
    console = capfd.readouterr()
    assert console.out == console.err == ""
    logged = log.read_text()
    assert all(what in logged for what in ("a DeepSpeed warning", "a transformers warning", "a Python warning"))


def test_the_supervisor_fills_every_silence_and_says_starting_until_the_ranks_first_line():
    class Heard:  # what the supervisor knows of a relay: when the run last wrote, and whether a line of ours
        received_at: float | None = None
        said_own_line = False

    clock, relay = Clock(), Heard()
    silence = SilenceLine((relay,), 4.0, clock)
    starting = "ntl-pretrain: still starting ({} s): the ranks import torch and DeepSpeed, then build the model"
    clock.now += 3.9
    assert silence.line() is None
    clock.now += 0.1
    assert silence.line() == starting.format(4)
    relay.received_at = clock.now + 2.0  # a library's line (DeepSpeed's accelerator): not the run's own yet
    clock.now += 5.9
    assert silence.line() is None
    clock.now += 0.1
    assert silence.line() == starting.format(10)
    relay.received_at, relay.said_own_line = clock.now, True  # rank 0's first line
    clock.now += 4.0
    assert silence.line() == "ntl-pretrain: still running (4 s without a line from the ranks)"
    clock.now += 1.0
    assert silence.line() is None
