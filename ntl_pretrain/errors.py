"""How every `ntl-pretrain` command ends when it cannot do its work: one line on stderr, `ntl-pretrain <command>:
<what is wrong>`, and exit code 2 for bad input (a missing or damaged file, an argument out of range, a recipe that
cannot run) or 1 for a failure while running. Bad input needs no traceback; an unexpected failure's traceback goes
to a log file the line names, or to the console with `--verbose`.

A console that fails (`| head` closed it, `>/dev/full`, a terminal gone) costs a command its lines, never its work:
what it writes to files is written whatever its console does, and a command that did its work but whose stdout
could not take its output (a JSON record, a folder's name) exits with `EXIT_CONSOLE_CLOSED`, not as failed."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import tempfile
import threading
import traceback
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
EXIT_CONSOLE_CLOSED = 141
"""128 + SIGPIPE, as a command killed by its closed output pipe returns: the command did its work (its files are
written) but its stdout did not take all of its output (closed, full or gone), whatever the error."""
MAX_MESSAGE_CHARS = 600  # a line a terminal shows whole; the log file keeps everything


class InputError(ValueError):
    """Bad input to a command; the message names the file, key, line or argument, then what is wrong."""

    kind = ""
    """Said before the message (`recipe error`), where the command alone does not say what was read."""

    def one_line(self) -> str:
        return " ".join(str(self).split())


class CommandFailed(RuntimeError):
    """An expected failure while running (a damaged checkpoint): one line, exit code 1, no traceback."""


# Files that are missing or of the wrong kind are bad input as much as a wrong argument is.
BAD_PATHS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a wrong argument is one line naming the command (not the usage block) and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (`{self.prog} --help` lists the arguments)\n")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """`--verbose` on `parser` and on every subcommand below it; SUPPRESS keeps a subcommand's default from
    overwriting a `--verbose` given before it."""
    parser.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="on a failure, print the traceback too")  # fmt: skip
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in dict.fromkeys(action.choices.values()):
                add_verbose(subparser)


def check_can_write(label: str, path: Path, folder: bool = False) -> None:
    """`path` can be written as a file (or, `folder`, as a folder) before any work starts: it is not of the other
    kind, and it or its nearest existing parent is a writable folder."""
    path = path.expanduser()
    wanted, other = ("folder", "file") if folder else ("file", "folder")
    if path.exists() and path.is_dir() != folder:
        raise InputError(f"{label}: {path} is a {other}; name the {wanted} to write")
    existing = next(parent for parent in (path.absolute(), *path.absolute().parents) if parent.exists())
    if existing == path.absolute() and not folder:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{label}: {path} cannot be written ({existing} is not a writable folder)")


def run_reporting(command: str, run: Callable[[], int | None], verbose: bool = False, stop_signals: bool = True) -> int:
    """`run()`'s exit code; what it raises becomes one line on stderr and exit code 2 (bad input) or 1. Its console
    is lossy (`lossy_console`): when `run()` succeeded but stdout did not take its output, `EXIT_CONSOLE_CLOSED`
    and a line that says so (where stderr still takes one). `stop_signals`: SIGTERM and SIGHUP end it as an
    exception does (`signals_end_the_command`); else they keep their default action."""
    with lossy_console() as (stdout, _), signals_end_the_command(stop_signals):
        code = _reported(command, run, verbose)
        stdout.flush()  # what is still buffered fails here, not unseen at exit
    if code == 0 and stdout.failure is not None:
        _say(command, f"done, but stdout did not take its output ({_reason(stdout.failure)}); what the command "
                      f"writes to files is written (exit code {EXIT_CONSOLE_CLOSED})")  # fmt: skip
        return EXIT_CONSOLE_CLOSED
    return code


def _reason(error: Exception) -> str:
    return (error.strerror if isinstance(error, OSError) else None) or str(error) or type(error).__name__


def _reported(command: str, run: Callable[[], int | None], verbose: bool) -> int:
    try:
        return run() or 0
    except BrokenPipeError:  # the console stopped reading (`| head`): nothing left to say, and nowhere to say it
        _detach_console()
        return EXIT_CONSOLE_CLOSED
    except Stopped as stop:
        _say(command, f"stopped by {stop.signal_name}; what it had half written is removed, its inputs untouched")
        return stop.exit_code
    except (InputError, *BAD_PATHS) as error:
        if verbose:
            traceback.print_exc()
        _say(command, describe(error))
        return EXIT_BAD_INPUT
    except CommandFailed as error:
        if verbose:
            traceback.print_exc()
        _say(command, " ".join(str(error).split()))
        return EXIT_FAILED
    except Exception as error:  # an unexpected failure: the line says what and where its traceback is
        where = "traceback above" if verbose else f"traceback in {_log_traceback(command)}; --verbose prints it"
        if verbose:
            traceback.print_exc()
        _say(command, f"failed: {type(error).__name__}: {' '.join(str(error).split())}", f" ({where})")
        return EXIT_FAILED


class Stopped(Exception):  # noqa: N818 - what happened to the command, as KeyboardInterrupt says
    """A signal asked the command to stop (`signals_end_the_command`)."""

    def __init__(self, signum: int):
        self.signal_name, self.exit_code = signal.Signals(signum).name, 128 + signum
        super().__init__(self.signal_name)


@contextlib.contextmanager
def signals_end_the_command(enabled: bool = True) -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP (a closed terminal) raise `Stopped` where the command is, as Ctrl-C raises
    KeyboardInterrupt, so that its `finally` blocks run: an output written beside its place (`outputs.write_folder`)
    is removed, not left half written. A signal ignored when the command started (SIGHUP under `nohup`) stays
    ignored; `ntl-pretrain train`'s supervisor installs its own handlers while the run lasts."""

    def stop(signum: int, _frame) -> None:
        raise Stopped(signum)

    if not enabled or threading.current_thread() is not threading.main_thread():  # the main thread sets handlers
        yield
        return
    caught = [signum for signum in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(signum) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, stop) for signum in caught}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class LossyStream(io.TextIOBase):
    """A console stream that drops what it cannot take: after the first failed write or flush (EPIPE, ENOSPC, EIO)
    its file descriptor is pointed at /dev/null, so that neither a later line, a child that inherits it, nor
    Python's flush at exit fails on it again. `failure`: that first error (None while the console takes all)."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self.stream = stream
        self.failure: Exception | None = None

    @property
    def encoding(self) -> str | None:
        return getattr(self.stream, "encoding", None)

    def write(self, text: str) -> int:
        try:
            self.stream.write(text)
        except (OSError, ValueError) as error:  # ValueError: the stream was closed
            self._give_up(error)
        return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError) as error:
            self._give_up(error)

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def _give_up(self, error: Exception) -> None:
        self.failure = self.failure or error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
            self.stream.flush()  # what it held goes to /dev/null now
        except (OSError, ValueError):
            pass


@contextlib.contextmanager
def lossy_console() -> Iterator[tuple[LossyStream, LossyStream]]:
    """Inside, this process's stdout and stderr cost lines, never the command, when the console fails; yields them
    (stdout, stderr), to ask afterwards whether they failed."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = LossyStream(sys.stdout), LossyStream(sys.stderr)
    try:
        yield sys.stdout, sys.stderr
    finally:
        sys.stdout, sys.stderr = saved


def keep_standard_streams_open() -> None:
    """A command started with stdin, stdout or stderr closed (`2>&-`, as some daemonised jobs run) gets /dev/null in
    its place. Left closed, the number is taken by the next file or pipe the command opens, and what it prints lands
    there (the supervisor's relay would copy the run's output into its own pipe); Python's sys.stderr is None then,
    which crashed the first `isatty()`."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
    if sys.stdout is None:
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stream, never closed
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _detach_console() -> None:
    """Point stdout and stderr at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass


def describe(error: Exception) -> str:
    """The one-line message of bad input: an OS error as `<file>: <what>`, an InputError with its kind first."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    if isinstance(error, InputError):
        return f"{error.kind}: {error.one_line()}" if error.kind else error.one_line()
    return " ".join(str(error).split())


def _say(command: str, message: str, suffix: str = "") -> None:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    try:
        print(f"ntl-pretrain {command}: {message}{suffix}", file=sys.stderr, flush=True)
    except OSError:  # a closed or full console: the exit code still says it
        _detach_console()


def _log_traceback(command: str) -> str:
    with tempfile.NamedTemporaryFile("w", prefix=f"ntl-pretrain-{command.replace(' ', '-')}-", suffix=".log",
                                     delete=False) as log:  # fmt: skip
        log.write(traceback.format_exc())
    return log.name
