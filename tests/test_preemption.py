"""One command starts and continues a run, and a stop signal saves and stops it (issues 17 and 21), on 2 CPU ranks
through `ntl-pretrain train` and `launch/local_cpu.sh`.

Continued pretraining from an HF folder with the default `train.resume: auto`: a run SIGKILLed after its step-10
checkpoint and started again with the identical command, and a run sent SIGTERM at step 13 and started again, both
log the uninterrupted run's losses; the stopped run exits with code 75 and leaves no process of the run alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.launches import logged_steps, partition_all_config, records, wait_for

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.runtime.stopping import EXIT_STOPPED

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
STEPS, EVERY, STOP_AT = 20, 10, 13
TIMEOUT_S = 400


@pytest.fixture(scope="module")
def init_folder(tmp_path_factory) -> Path:
    """An HF folder (config, weights, tokenizer) of the tiny recipe's architecture, as `export` writes one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.tokenizer import load_tokenizer

    recipe = load_recipe(TINY)
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), **recipe.model.config)
    folder = tmp_path_factory.mktemp("init") / "hf"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    return partition_all_config(tmp_path_factory.mktemp("ds"))


def command(output_dir: Path, init_folder: Path, ds_config: Path) -> list[str]:
    """The one command of a continued-pretraining run: the same for its first start and every restart."""
    return [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2",
            f"init_from={init_folder}", "model.model_type=null", f"train.output_dir={output_dir}",
            f"deepspeed.config={ds_config}", f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}",
            "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.eval_every_steps=null", "logging.progress_bar=false"]  # fmt: skip


def environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # `ntl-pretrain` for launch/local_cpu.sh
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=environment(), stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def run_to_end(argv: list[str], log: Path) -> None:
    assert start(argv, log).wait(timeout=TIMEOUT_S) == 0, log.read_text()[-4000:]


def the_run(process: subprocess.Popen) -> list[psutil.Process]:
    """The launcher process and everything it started (launcher, DeepSpeed's launchers, the ranks)."""
    root = psutil.Process(process.pid)
    return [root, *root.children(recursive=True)]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_same_losses(output_dir: Path, reference: Path, steps: range) -> None:
    got, expected = records(output_dir), records(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in steps:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6, rel=0), step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, init_folder, ds_config) -> Path:
    output_dir = tmp_path_factory.mktemp("whole") / "run"
    run_to_end(command(output_dir, init_folder, ds_config), output_dir.parent / "log.txt")
    return output_dir


def test_the_same_command_continues_a_killed_continued_pretraining_run(uninterrupted, init_folder, ds_config,
                                                                       tmp_path):  # fmt: skip
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    argv = command(output_dir, init_folder, ds_config)
    process = start(argv, log)
    wait_for(lambda: (output_dir / "checkpoints" / f"step_{EVERY}").is_dir(), process, log, TIMEOUT_S)
    run = the_run(process)
    for member in run:  # a crash: nothing gets to clean up
        member.kill()
    psutil.wait_procs(run, timeout=30)
    assert f"starting from the weights of init_from {init_folder}" in log.read_text()

    run_to_end(argv, log)
    assert f"resuming from {output_dir / 'checkpoints' / f'step_{EVERY}'} (step {EVERY}); init_from" in log.read_text()
    assert_same_losses(output_dir, uninterrupted, range(EVERY + 1, STEPS + 1))


def test_sigterm_saves_stops_with_code_75_and_the_same_command_continues(uninterrupted, init_folder, ds_config,
                                                                          tmp_path):  # fmt: skip
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    argv = command(output_dir, init_folder, ds_config)
    process = start(argv, log)
    wait_for(lambda: STOP_AT in logged_steps(output_dir), process, log, TIMEOUT_S)
    run = the_run(process)
    assert sum("ntl_pretrain.train" in " ".join(p.cmdline()) for p in alive(run)) >= 2
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert process.wait(timeout=60) == EXIT_STOPPED, log.read_text()[-4000:]
    psutil.wait_procs(run, timeout=max(1.0, 60 - (time.monotonic() - signalled)))
    assert not alive(run), [p.cmdline() for p in alive(run)]
    stopped_at = max(logged_steps(output_dir))
    assert STOP_AT <= stopped_at < STEPS
    root = output_dir / "checkpoints"
    assert (root / "latest").read_text() == f"step_{stopped_at}" and (root / f"step_{stopped_at}").is_dir()
    assert records(output_dir, "stop")[stopped_at]["signal"] == "SIGTERM"
    last_line = f"ntl-pretrain: stopped at step {stopped_at} of {STEPS} with a checkpoint; run the same command to " \
        f"continue (exit code {EXIT_STOPPED})"  # fmt: skip
    assert log.read_text().splitlines()[-1] == last_line  # after the launcher's own lines
    assert "[ERROR]" not in log.read_text()  # the launcher's line for a rank's code 75 is left out (issue 42)

    run_to_end(argv, log)
    assert_same_losses(output_dir, uninterrupted, range(stopped_at + 1, STEPS + 1))


def test_sigterm_to_local_cpu_sh_leaves_no_process_of_the_run(init_folder, ds_config, tmp_path):
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    overrides = command(output_dir, init_folder, ds_config)[7:] + ["train.max_steps=500"]
    process = start(["bash", str(REPO / "launch" / "local_cpu.sh"), str(TINY), *overrides], log)
    wait_for(lambda: 2 in logged_steps(output_dir), process, log, TIMEOUT_S)
    run = the_run(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == EXIT_STOPPED, log.read_text()[-4000:]
    psutil.wait_procs(run, timeout=30)
    assert not alive(run), [p.cmdline() for p in alive(run)]
    assert (output_dir / "checkpoints" / f"step_{max(logged_steps(output_dir))}").is_dir()
