"""A command's result is never lost to its console (issue 72): what it writes to files is written before it prints,
and a console that fails (`| head -c 0`, `>/dev/full`) after the work is done exits 141, never "failed"; a signal
that stops a command (a closed terminal's SIGHUP) removes what it had half written."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys

import pytest
from helpers.launches import REPO, as_a_user_runs_it, unattended_run
from test_console_cadence import Failing

from ntl_pretrain import errors

CONSOLE_LINE = "done, but stdout did not take its output ({}); what the command writes to files is written " \
    "(exit code 141)"  # fmt: skip


@pytest.mark.parametrize("error", [BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                   OSError(errno.ENOSPC, "No space left on device")])  # fmt: skip
def test_a_console_that_fails_costs_exit_code_141_never_the_work(error, tmp_path, monkeypatch, capsys):
    """A command that prints, then writes its file (as `eval` did): the file is written, and the exit code says
    that the console, not the command, failed; a failing stderr alone costs lines, and the command's own code
    stands."""
    result = tmp_path / "result.json"

    def print_then_write() -> int:
        print('{"answer": 42}')
        result.write_text('{"answer": 42}\n')
        return 0

    monkeypatch.setattr(sys, "stdout", Failing(error))
    assert errors.run_reporting("eval", print_then_write) == errors.EXIT_CONSOLE_CLOSED
    assert result.read_text() == '{"answer": 42}\n'
    assert capsys.readouterr().err == f"ntl-pretrain eval: {CONSOLE_LINE.format(error.strerror)}\n"
    assert errors.run_reporting("verify", lambda: print("damaged") or 1) == 1  # its own failure comes first
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", Failing(error))
    assert errors.run_reporting("export", lambda: print("progress", file=sys.stderr) or 0) == 0


def test_a_signal_stops_a_command_without_leaving_its_output_half_written(tmp_path):
    """SIGHUP (a closed terminal) killed `export` where it stood, leaving the folder it was writing beside its place
    (`.<out>.partial-<pid>`); now it stops as Ctrl-C does: what it wrote is removed, exit 128 + 1, one line."""
    out = tmp_path / "hf"
    command = (
        "import os, signal, sys; from pathlib import Path; from ntl_pretrain import errors, outputs\n"
        "def write(partial):\n    (partial / 'config.json').write_text('{}')\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n    (partial / 'model.safetensors').write_text('')\n"
        f"sys.exit(errors.run_reporting('export', lambda: outputs.write_folder(Path({str(out)!r}), write) and 0))"
    )
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 128 + 1, done.stderr
    assert done.stderr == "ntl-pretrain export: stopped by SIGHUP; what it had half written is removed, its inputs " \
        "untouched\n"  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def run_command(argv: list[str], stdout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", *argv], cwd=REPO, env=as_a_user_runs_it(),
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
def test_eval_writes_its_record_and_metrics_line_before_a_closed_console_and_export_its_folder_before_a_full_one(
    tmp_path_factory, tmp_path
):
    """`eval RUN --out F --log-metrics | head -c 0` exited 141 with no F and no metrics line; `>/dev/full` exited
    1; `export ... >/dev/full` exited 1 "failed: ... No space left on device" with the folder complete."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(unattended_run(tmp_path_factory)[0], run_dir)  # --log-metrics appends to its metrics.jsonl
    out = tmp_path / "eval.json"
    flags = ["--max-examples", "2", "--max-new-tokens", "2", "--max-validation-batches", "1"]
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -c 0` has exited
    try:
        done = run_command(["eval", str(run_dir), "--out", str(out), "--log-metrics", *flags], write_end)
    finally:
        os.close(write_end)
    assert done.returncode == errors.EXIT_CONSOLE_CLOSED, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["step"] == 4 and record["split"] == "eval" and "val_ce" in record
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]) == record
    assert done.stderr.splitlines()[-1] == f"ntl-pretrain eval: {CONSOLE_LINE.format('Broken pipe')}"

    hf = tmp_path / "hf"
    with open("/dev/full", "w") as full:  # noqa: PTH123 - the device, as `>/dev/full` gives it
        done = run_command(["export", str(run_dir / "checkpoints" / "step_4"), str(hf)], full)
    assert done.returncode == errors.EXIT_CONSOLE_CLOSED, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == f"ntl-pretrain export: {CONSOLE_LINE.format('No space left on device')}"
    assert sorted(path.name for path in hf.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors", "tokenizer.json",
                                                          "tokenizer_config.json"]  # fmt: skip
