"""Copy a run's output to this process's console so that the console can neither freeze nor kill the run.

The launcher and its ranks write into pipes that a reader thread always drains, whatever happens downstream; a
writer thread copies what was read to the console. When the console stops taking output (a pipe nobody reads is
full, `| head` closed it, the terminal went away), only the writer waits or fails: the reader keeps draining, keeps
at most MAX_BUFFERED_BYTES waiting for the console and drops (and counts) what comes beyond, and after the console
failed (EPIPE, EIO) it drops everything. So no rank ever blocks in a write and no BrokenPipeError reaches one;
metrics.jsonl keeps every record. `close` waits at most FLUSH_TIMEOUT_S for the console, then says what was dropped.

Output passes through as bytes, in the chunks the ranks wrote (a progress bar's carriage returns included); the
ranks are told whether the console is a terminal (CONSOLE_TTY_ENV), since their own stream is now a pipe.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time

MAX_BUFFERED_BYTES = 4 << 20
FLUSH_TIMEOUT_S = 2.0
READ_BYTES = 1 << 16
OWN_LINE = b"ntl-pretrain: "
CONSOLE_TTY_ENV = "NTL_PRETRAIN_CONSOLE_TTY"
"""Set to 1 in the ranks' environment when the console they write to (through the relay) is a terminal."""


class ConsoleRelay:
    """One pipe's worth: `write_fd` goes to the child as its stdout or stderr; `destination_fd` is ours."""

    def __init__(self, destination_fd: int, noise: re.Pattern[bytes] | None = None):
        """`noise`: whole lines (with their newline) not to copy, matched within each chunk read; a line split
        between two reads is copied as it is (the filter never holds output back)."""
        self.destination_fd = destination_fd
        self.noise = noise
        self._read_fd, self.write_fd = os.pipe()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self.dropped_bytes = 0
        self.received_at: float | None = None  # when the child last wrote (time.monotonic())
        self.said_own_line = False  # the child wrote a line of this project's (`ntl-pretrain: `)
        self._console_failed = False
        self._closed = False  # no more output will come: the writer ends once the queue is empty
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="console-relay-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name="console-relay-write", daemon=True)

    def start(self) -> None:
        """Start copying; call after the child has its copy of `write_fd`, which this process then closes so that
        the pipe ends when the child's side does."""
        os.close(self.write_fd)
        self._reader.start()
        self._writer.start()

    def _read(self) -> None:
        while chunk := os.read(self._read_fd, READ_BYTES):
            self.received_at = time.monotonic()
            self.said_own_line = self.said_own_line or OWN_LINE in chunk
            if self.noise is not None:
                chunk = self.noise.sub(b"", chunk)
            if chunk:
                self._enqueue(chunk)
        os.close(self._read_fd)

    def _enqueue(self, data: bytes) -> None:
        """Queue `data` for the console, or drop and count it when the console failed or the queue is full."""
        with self._changed:
            if self._console_failed or self._buffered + len(data) > MAX_BUFFERED_BYTES:
                self.dropped_bytes += len(data)
                return
            self._chunks.append(data)
            self._buffered += len(data)
            self._changed.notify_all()

    def _write(self) -> None:
        while True:
            with self._changed:
                while not self._chunks and not self._closed:
                    self._changed.wait()
                if not self._chunks:
                    return
                chunk = self._chunks.popleft()
            if not self._write_all(chunk):
                return
            with self._changed:
                self._buffered -= len(chunk)
                self._changed.notify_all()

    def _write_all(self, chunk: bytes) -> bool:
        """Write `chunk` to the console; on failure drop it and everything after it, and say False."""
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.destination_fd, view) :]
            return True
        except OSError:  # EPIPE: nobody reads any more; EIO: the terminal is gone
            with self._changed:
                self._console_failed = True
                self.dropped_bytes += self._buffered
                self._chunks.clear()
                self._buffered = 0
                self._changed.notify_all()
            return False

    def say(self, line: str) -> None:
        """Queue one line of this process's own after the child's output (bounded like it)."""
        self._enqueue(line.encode() + b"\n")

    def wait_for_child_output(self, timeout: float) -> None:
        """Let the reader reach the end of the pipe (every process holding it exited), at most `timeout`."""
        self._reader.join(timeout)

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> int:
        """Give the console at most `timeout` to take what is queued; the bytes that never reached it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            while self._chunks and not self._console_failed and time.monotonic() < deadline:
                self._changed.wait(max(0.0, deadline - time.monotonic()))
            return self.dropped_bytes + self._buffered


def console_is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
