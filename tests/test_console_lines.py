"""A printed line reaches a pipe the ranks share in one write: `python -u` (how the launcher starts ranks) writes
`print`'s text and newline in two calls, so a peer's line could land between them (CI saw rank 1's data error glued
to the end of rank 0's start line); `console.whole_lines`, called by every rank entry, makes it one."""

from __future__ import annotations

import io
from pathlib import Path

from ntl_pretrain.reporting.console import whole_lines


class RecordedWrites(io.RawIOBase):
    """An unbuffered file that keeps each write call, as a pipe sees them."""

    def __init__(self):
        super().__init__()
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if data:  # a flush with nothing pending writes b""
            self.calls.append(bytes(data))
        return len(data)


def test_a_printed_line_is_one_write_after_whole_lines():
    pipe = RecordedWrites()
    stream = io.TextIOWrapper(pipe, encoding="utf-8", write_through=True)  # sys.stderr under `python -u`
    print("ntl-pretrain: rank 0: starting from scratch", file=stream, flush=True)
    assert pipe.calls == [b"ntl-pretrain: rank 0: starting from scratch", b"\n"]  # room for a peer's line between
    whole_lines((stream,))
    print("ntl-pretrain: rank 1: data error", file=stream, flush=True)
    print("progress\r", end="", file=stream, flush=True)  # a bar's update without a newline still goes out
    assert pipe.calls[2:] == [b"ntl-pretrain: rank 1: data error\n", b"progress\r"]


def test_every_rank_entry_keeps_lines_whole():
    """The modules a launcher starts ranks with: training's own entry, and the doctor's and evaluation's, which
    are the CLI's commands through `cli.module_main`."""
    from importlib.util import find_spec

    from ntl_pretrain import cli
    from ntl_pretrain.train import main as train

    for main in (train.main, cli.module_main):
        assert "whole_lines" in main.__code__.co_names, main
    for package in ("ntl_pretrain.doctor", "ntl_pretrain.evaluation"):
        source = Path(find_spec(f"{package}.__main__").origin).read_text()
        assert "module_main(" in source, package
