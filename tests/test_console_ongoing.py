"""`console.ongoing`: a slow command is never silent for long, and a quick refusal stays its only line.

Off a terminal a block that ends within a tick says nothing; a longer one says its stage every tick (and at once
with `at_once`); on a terminal one line is drawn at once, redrawn at each stage and erased at the end. Ticks are
shortened to 50 ms here; commands use `TICK_S` (3 s)."""

from __future__ import annotations

import io
import time

import pytest

from ntl_pretrain.reporting.console import ERASE_LINE, ongoing

TICK_S = 0.05


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_block_quicker_than_a_tick_says_nothing_off_a_terminal():
    log = io.StringIO()
    with pytest.raises(ValueError), ongoing("checking r.yaml", stream=log, tick_s=10.0) as stage:
        stage("the tokenizer")
        raise ValueError("refused")  # the refusal the caller prints next is then the only line
    assert log.getvalue() == ""


def test_a_slow_stage_is_named_every_tick_off_a_terminal():
    log = io.StringIO()
    with ongoing("checking r.yaml", stream=log, tick_s=TICK_S) as stage:
        stage("the libraries")
        time.sleep(6 * TICK_S)
        stage("the tokenizer")
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("ntl-pretrain: checking r.yaml: the libraries") for line in lines)


def test_at_once_says_the_first_stage_before_any_tick():
    log = io.StringIO()
    with ongoing("a.gguf -> out", prefix="ntl-pretrain convert-gguf: ", stream=log, at_once=True, tick_s=10.0) as stage:
        stage("loading the libraries")
        stage("dequantising the weights")
    assert log.getvalue() == "ntl-pretrain convert-gguf: a.gguf -> out: loading the libraries\n"


def test_on_a_terminal_one_line_is_redrawn_at_each_stage_and_erased():
    terminal = Terminal()
    with ongoing("checking r.yaml", stream=terminal, tick_s=10.0) as stage:
        stage("the libraries")
        stage("the tokenizer")
    shown = terminal.getvalue()
    assert "\n" not in shown and shown.endswith(ERASE_LINE)
    assert shown.split(ERASE_LINE)[:-1] == ["ntl-pretrain: checking r.yaml", "ntl-pretrain: checking r.yaml: the "
                                            "libraries", "ntl-pretrain: checking r.yaml: the tokenizer"]  # fmt: skip
