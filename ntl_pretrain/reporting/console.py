"""What rank 0 of a training run prints: a start-up line, progress, evaluation records as they are computed, and an
end-of-run summary. Everything goes to stderr, each line starting `ntl-pretrain: `; stdout stays free for data.

Progress: on a terminal with `logging.progress_bar: true`, a tqdm bar. Anywhere else (Slurm logs, `nohup`, a pipe),
or with the bar off, a plain line every `logging.console_every_steps` steps, plus the first and last step: a bar
redrawn into a file becomes one line of tens of thousands of characters. Whatever the step's speed, a line at least
every `logging.console_every_seconds`: the last step's line when it was not said, else what is under way and for
how long (`step 41/300 under way (8 s)`, `saving checkpoint step 40 (6 s)`); on a terminal the bar's clock moves.
A console that fails (a closed pipe, a full disk) costs lines, never the run.

A run that ends early ends with one line of its own, after the launcher's lines: `ntl-pretrain train` repeats the
stop line (`stop_line`) or the failing rank's line (`failure_line`, whose traceback goes to a log file). Commands
whose stdout is data keep everything else off it (`stdout_to_stderr`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from ntl_pretrain.runtime.console_relay import CONSOLE_TTY_ENV

PREFIX = "ntl-pretrain: "
TICK_S = 3.0  # a slow command says something at least this often (`ongoing`): under 5 s with a stall
VALIDATION_FIELDS = ("val_loss", "val_ce", "val_ntl", "val_number_ce", "val_answer_ce", "val_answer_ntl")


def whole_lines(streams: tuple[TextIO, ...] = ()) -> None:
    """Each line this process prints reaches its stream in one write. The launcher starts ranks with `python -u`,
    whose `print` writes the text and its newline in two calls to the shared pipe, so a peer's line can land between
    them (CI: rank 1's data error glued to the end of rank 0's start line). Line buffering hands the stream whole
    lines, each one write (atomic in a pipe up to 4 KiB); progress bars flush themselves. Default: stdout, stderr."""
    for stream in streams or (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def on_terminal(stream: TextIO | None) -> bool:
    """Whether `stream` reaches a terminal: itself, or (a rank's stdout under `ntl-pretrain train`) through the
    supervisor's console relay, which says so in the environment. None (a closed stderr: `2>&-`) is no terminal."""
    return is_a_terminal(stream) or os.environ.get(CONSOLE_TTY_ENV) == "1"


def is_a_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # closed
        return False


def write_or_drop(stream: TextIO | None, text: str) -> bool:
    """Write and flush `text`; False, having written nothing more, when the console cannot take it (None: a closed
    stderr; EPIPE: `| head` closed it; ENOSPC: /dev/full; EIO: the terminal is gone). A line is never worth a run."""
    if stream is None:
        return False
    try:
        stream.write(text)
        stream.flush()
        return True
    except (OSError, ValueError):  # ValueError: the stream was closed
        return False


def startup_line(parameters: int, world_size: int, micro_batch: int, global_batch: int, grad_accum: int,
                 seq_len: int, precision: str) -> str:  # fmt: skip
    """The run's shape: what a reader of the log needs to judge its speed and memory figures."""
    return (f"{parameters:,} parameters; world size {world_size}; micro-batch {micro_batch}, global batch "
            f"{global_batch} sequences (gradient accumulation {grad_accum}); {global_batch * seq_len:,} tokens per "
            f"step ({seq_len} per sequence); precision {precision}")  # fmt: skip


def step_fields(record: dict) -> str:
    """The fields of a training step, shared by the bar and the plain lines (`aux_loss`: a MoE's balancing loss,
    named as metrics.jsonl and the docs name it)."""
    return (f"loss {record['loss']:.4f} ce {record['ce']:.4f} ntl {record['ntl']:.4f}{_aux_field(record, ' ')} "
            f"lr {record['lr']:.3g} {record['tokens_per_s']:,.0f} tok/s mem {record['peak_mem_mib']:,.0f} "
            "MiB")  # fmt: skip


def _aux_field(record: dict, separator: str) -> str:
    return f"{separator}aux_loss {record['aux_loss']:.4f}" if "aux_loss" in record else ""


def evaluation_line(record: dict) -> str:
    """A validation record (loss, CE, NTL, number CE) or a generation-eval record (every metric of every set)."""
    if record["split"] == "validation":
        fields = [f"{key.removeprefix('val_')} {record[key]:.4f}" for key in VALIDATION_FIELDS if key in record]
        fields.append(f"over {record['val_tokens']:,} tokens")
    else:
        fields = [f"{key.removeprefix('eval/')} {value:.4g}" for key, value in record.items()
                  if key.startswith("eval/") and isinstance(value, (int, float))]  # fmt: skip
    return f"step {record['step']} {record['split']}: " + ", ".join(fields)


def stop_line(output_dir: Path, total_steps: int) -> str | None:
    """What the supervising process prints last after the ranks stopped on a signal (after the launcher's own lines):
    the step they saved, from the `stop` record rank 0 wrote last; None when they stopped without saving."""
    metrics = output_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    if last.get("split") != "stop":
        return None
    return f"stopped at step {last['step']} of {total_steps} with a checkpoint; run the same command to continue"


def failure_line(where: str, error: BaseException, output_dir: Path, rank: int, saved: Path | None) -> str:
    """One line naming what failed inside a run and where its traceback is; the line heads the log file, so that
    `ntl-pretrain train` can repeat it after the launcher's own lines (`last_failure_line`). `saved`: the newest
    checkpoint the run wrote whole or resumed from (never one whose save failed)."""
    log = output_dir / "logs" / f"failure-rank{rank}.log"
    newest = "none saved yet" if saved is None else saved.name
    line = f"{where}: {type(error).__name__}: {first_line(error)}; traceback in {log}; checkpoints ({newest}) and " \
        "metrics.jsonl are intact"  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(line + "\n\n" + "".join(traceback.format_exception(error)))
    return line


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def last_failure_line(output_dir: Path, since: float) -> str | None:
    """The line of the rank that failed first, among the failure logs written since `since` (a time.time())."""
    logs = [log for log in (output_dir / "logs").glob("failure-rank*.log") if log.stat().st_mtime >= since]
    if not logs:
        return None
    return min(logs, key=lambda log: log.stat().st_mtime).read_text().splitlines()[0]


ERASE_LINE = "\r\033[K"


@contextlib.contextmanager
def ongoing(what: str, prefix: str = PREFIX, stream: TextIO | None = None, at_once: bool = False,
            tick_s: float = TICK_S) -> Iterator[Callable[..., None]]:  # fmt: skip
    """Say what a slow command does while it does it: the block calls the function it is given with each stage
    (`stage(name, say=True)`: a stage worth a line of its own off a terminal too, said at once).

    On a terminal: one line at once, rewritten at each stage and every `tick_s` with the time so far, erased at the
    end (success or refusal), so that a refusal after it reads as one line. Off a terminal (a log, a pipe): a line
    every `tick_s` naming the stage under way (and the first stage at once with `at_once`), none for a block that
    ends sooner,
    so that a quick answer (a refusal) stays the only line, the log shows where the time went, and it is never
    silent for long."""
    stream = stream if stream is not None else sys.stderr
    line = _OngoingLine(what, prefix, stream, at_once, tick_s)
    ticking = threading.Thread(target=line.tick, daemon=True, name="ntl-ongoing")
    ticking.start()
    try:
        yield line.stage
    finally:
        line.end()
        ticking.join()


class _OngoingLine:
    def __init__(self, what: str, prefix: str, stream: TextIO | None, at_once: bool, tick_s: float):
        self.what, self.prefix, self.stream, self.tick_s = what, prefix, stream, tick_s
        self.terminal = is_a_terminal(stream)
        self.started = self.said = time.monotonic()
        self.current, self.drawn, self.at_once = "", False, at_once
        self.done = threading.Event()
        self.lock = threading.Lock()
        if self.terminal:
            self._say()

    def stage(self, name: str, say: bool = False) -> None:
        with self.lock:
            self.current = name
            if self.terminal or say or (self.at_once and not self.drawn):
                self._say()

    def tick(self) -> None:
        while not self.done.wait(min(0.5, self.tick_s)):
            with self.lock:
                if time.monotonic() - self.said >= self.tick_s and not self.done.is_set():
                    self._say()

    def end(self) -> None:
        with self.lock:
            self.done.set()
            if self.terminal and self.drawn:
                write_or_drop(self.stream, ERASE_LINE)

    def _say(self) -> None:
        elapsed = time.monotonic() - self.started
        text = self.prefix + self.what + (f": {self.current}" if self.current else "")
        text += f" ({elapsed:.0f} s)" if elapsed >= 1 else ""
        redraw = ERASE_LINE if self.drawn else ""
        write_or_drop(self.stream, redraw + text if self.terminal else text + "\n")
        self.said, self.drawn = time.monotonic(), True


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """For commands whose stdout is data (`eval`'s JSON, `export`'s folder): whatever is written to stdout inside goes
    to stderr. At the file-descriptor level, because DeepSpeed's logger keeps the stdout stream it found at import
    and its checkpoint reader prints; and Python's `sys.stdout` is `sys.stderr` inside, so that a failing stderr is
    not taken for a stdout that did not take the command's output (`errors.run_reporting`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def prints_kept_off_the_console() -> Iterator[None]:
    """Inside, Python-level prints and default progress bars (tqdm writes to sys.stderr) go nowhere: for library code
    that narrates on its own (DeepSpeed's checkpoint reader prints every stage and draws two bars), while `ongoing`,
    which holds the real stream, says what is under way."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


@contextlib.contextmanager
def no_library_progress_bars() -> Iterator[None]:
    """transformers' bars (loading weights, writing shards) off: a redrawn bar is one long line in a log, and on a
    terminal it would fight `ongoing`'s line."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def library_lines_to(log: Path, enabled: bool = True) -> Iterator[None]:
    """Rank 0 of a run off a terminal: DeepSpeed's and transformers' log lines and Python warnings go to `log` (the
    run's logs/ folder), and transformers' progress bars are off, so that the console holds the run's own lines."""
    if not enabled:
        yield
        return
    import logging
    import warnings

    from deepspeed.utils import logger as deepspeed_logger
    from transformers.utils import logging as transformers_logging

    log.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [deepspeed_logger, transformers_logging.get_logger(), logging.getLogger("py.warnings")]
    saved = [(logger, logger.handlers[:], logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers[:] = [handler]
        logger.propagate = False
    with no_library_progress_bars(), warnings.catch_warnings():
        logging.captureWarnings(True)
        try:
            yield
        finally:
            logging.captureWarnings(False)
            for logger, handlers, propagate in saved:
                logger.handlers[:], logger.propagate = handlers, propagate
            handler.close()


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


class RunConsole:
    """Rank 0 prints; on other ranks every method does nothing, so call sites need no rank checks.

    `every_seconds` (0: off): the longest the console stays silent, kept by a thread that wakes `TICKS_PER_PERIOD`
    times a period (`tick`). `clock` is the time source (tests pass a fake one and call `tick` themselves)."""

    TICKS_PER_PERIOD = 8

    def __init__(self, *, enabled: bool, total_steps: int, first_step: int, first_tokens: int, progress_bar: bool,
                 every_steps: int, every_seconds: float = 0.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, ticking: bool = True):  # fmt: skip
        self.enabled, self.total_steps, self.every_steps = enabled, total_steps, every_steps
        self.every_seconds, self.clock = every_seconds, clock
        self.stream = stream if stream is not None else sys.stderr
        # The summary's throughput counts this session only (a resumed run started at `first_step`).
        self.first_step, self.first_tokens, self.started = first_step, first_tokens, clock()
        self.last_train: dict | None = None
        self.unsaid_step: dict | None = None  # the last step's record when its line was not printed
        self.last_validation: dict | None = None
        self.peak_mem_mib = 0.0
        self.said_at = self.started
        self.activity, self.activity_since = self._next_step(first_step), self.started
        self.lock = threading.RLock()  # the ticking thread and the training loop print through it
        self.bar = None
        if enabled and progress_bar and on_terminal(self.stream):
            self.bar = tqdm(total=total_steps, initial=first_step, dynamic_ncols=True, file=self.stream)
        self.closed = threading.Event()
        if enabled and every_seconds > 0 and ticking:
            threading.Thread(target=self._tick_until_closed, daemon=True, name="ntl-console").start()

    def say(self, message: str) -> None:
        """One line of its own, above the bar when there is one."""
        if not self.enabled:
            return
        with self.lock:
            if self.bar is not None:
                try:
                    self.bar.write(PREFIX + message, file=self.stream)
                except (OSError, ValueError):
                    pass
            else:
                write_or_drop(self.stream, PREFIX + message + "\n")
            self.said_at = self.clock()

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.last_train = record
            self.peak_mem_mib = max(self.peak_mem_mib, record["peak_mem_mib"])
            step = record["step"]
            self.activity, self.activity_since = self._next_step(step), self.clock()
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix_str(step_fields(record), refresh=False)
                return
            due = self.every_steps and step % self.every_steps == 0
            if due or step in (self.first_step + 1, self.total_steps) or self._silent_too_long():
                self._say_step(record)
            else:
                self.unsaid_step = record

    def _say_step(self, record: dict) -> None:
        step = record["step"]
        self.say(f"step {step}/{self.total_steps} {step_fields(record)}; {self._timing(step)}")
        self.unsaid_step = None

    @contextlib.contextmanager
    def doing(self, activity: str) -> Iterator[None]:
        """Say `activity` (seconds to minutes between steps: a save, an evaluation) before it starts; while it lasts,
        the ticking line names it (not the step before it, whose line would then come after this one)."""
        if not self.enabled:
            yield
            return
        with self.lock:
            self.say(activity)
            self.activity, self.activity_since, self.unsaid_step = activity, self.clock(), None
        try:
            yield
        finally:
            with self.lock:
                self.activity = self._next_step((self.last_train or {"step": self.first_step})["step"])
                self.activity_since = self.clock()

    def _next_step(self, step: int) -> str:
        """What comes after `step`: the next step, or after the last one the run's end (saving, summary)."""
        return f"step {step + 1}/{self.total_steps} under way" if step < self.total_steps else "ending the run"

    def tick(self) -> None:
        """After `every_seconds` without a line: the last step's line when it was not said, else what is under way
        and for how long; with a bar, a redraw (its clock moves)."""
        if not self.enabled or self.every_seconds <= 0:
            return
        with self.lock:
            if not self._silent_too_long():
                return
            if self.bar is not None:
                try:
                    self.bar.refresh()
                except (OSError, ValueError):
                    pass
                self.said_at = self.clock()
            elif self.unsaid_step is not None:
                self._say_step(self.unsaid_step)
            else:
                self.say(f"{self.activity} ({self.clock() - self.activity_since:.0f} s)")

    def _silent_too_long(self) -> bool:
        return self.every_seconds > 0 and self.clock() - self.said_at >= self.every_seconds

    def _tick_until_closed(self) -> None:
        while not self.closed.wait(self.every_seconds / self.TICKS_PER_PERIOD):
            self.tick()

    def _timing(self, step: int) -> str:
        """Elapsed time of this session and the time left at its pace so far (the bar shows its own)."""
        elapsed = self.clock() - self.started
        left = elapsed / max(step - self.first_step, 1) * (self.total_steps - step)
        return f"{duration(elapsed)} elapsed, ETA {duration(left)}"

    def evaluated(self, record: dict) -> None:
        if record["split"] == "validation":
            self.last_validation = record
        self.say(evaluation_line(record))

    def summary(self, checkpoint: Path, output_dir: Path) -> None:
        """After the last step: final losses, throughput, memory, where the results are, and how to export."""
        if not self.enabled or self.last_train is None:
            return
        self.close_bar()
        train, seconds = self.last_train, self.clock() - self.started
        tokens = train["tokens"] - self.first_tokens
        parts = f"ce {train['ce']:.4f}, ntl {train['ntl']:.4f}{_aux_field(train, ', ')}"
        losses = f"train loss {train['loss']:.4f} ({parts})"
        if self.last_validation is not None:
            validation = self.last_validation
            losses += f", validation loss {validation['val_loss']:.4f} (ce {validation['val_ce']:.4f}, ntl " \
                f"{validation['val_ntl']:.4f})"  # fmt: skip
        export = shlex.join(["ntl-pretrain", "export", str(checkpoint), str(output_dir / "export")])
        self.say(f"done: step {train['step']} of {self.total_steps}; {losses}")
        self.say(f"{tokens:,} tokens in {duration(seconds)} ({tokens / max(seconds, 1e-9):,.0f} tokens/s); peak "
                 f"memory {self.peak_mem_mib:,.0f} MiB")  # fmt: skip
        self.say(f"checkpoint {checkpoint}; metrics {output_dir / 'metrics.jsonl'}")
        self.say(f"export to a Hugging Face folder: {export}")

    def close_bar(self) -> None:
        """End the bar's line, so that what follows starts on a line of its own."""
        with self.lock:
            if self.bar is not None:
                try:
                    self.bar.close()
                except (OSError, ValueError):
                    pass
                self.bar = None

    def close(self) -> None:
        """The end of the run's lines: no bar, no ticking."""
        self.closed.set()
        self.close_bar()
