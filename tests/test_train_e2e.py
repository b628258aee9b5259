"""The tiny recipe end to end on 2 CPU ranks through `ntl-pretrain train` (real deepspeed launcher, ZeRO-3, gloo).

One uninterrupted 50-step run (module fixture) is read by several tests; a second run of the same recipe is
SIGKILLed and resumed, and a CE-only run starts from the same initial weights.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.launches import (
    as_a_user_runs_it,
    assert_model_reproduces_logged_validation,
    partition_all_config,
    records,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.evaluation import generation_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
STEPS, EVERY, SEQ_LEN, GLOBAL_BATCH = 50, 20, 64, 16
STEP_KEYS = {"step", "loss", "ce", "ntl", "lr", "grad_norm", "tokens", "tokens_per_s", "number_token_fraction", "mfu",
             "peak_mem_mib"}  # fmt: skip


def overrides(output_dir: Path, ds_config: Path, *extra: str) -> list[str]:
    return [
        f"train.output_dir={output_dir}", f"deepspeed.config={ds_config}", f"train.max_steps={STEPS}",
        f"data.seq_len={SEQ_LEN}", "train.micro_batch_size=4", f"train.global_batch_size={GLOBAL_BATCH}",  # 2 micro
        f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2", "train.eval_every_steps=25",
        "train.eval_max_batches=3", "eval.every_steps=25", "eval.max_examples=4", "eval.max_new_tokens=6",
        "logging.progress_bar=false", "train.resume=auto", *extra,
    ]  # fmt: skip


def launch(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def run_to_end(args: list[str], log: Path) -> None:
    process = launch(args, log)
    assert process.wait(timeout=400) == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    return partition_all_config(tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, ds_config) -> Path:
    output_dir = tmp_path_factory.mktemp("tiny") / "run"
    run_to_end(overrides(output_dir, ds_config), output_dir.parent / "log.txt")
    return output_dir


def test_loss_decreases_with_ntl_logged(tiny_run):
    steps, evals = records(tiny_run), records(tiny_run, "validation")
    assert sorted(steps) == list(range(1, STEPS + 1)) and sorted(evals) == [25, 50]
    assert all(STEP_KEYS <= set(r) for r in steps.values())
    peaks = [steps[s]["peak_mem_mib"] for s in range(1, STEPS + 1)]
    assert peaks[0] > 100 and peaks == sorted(peaks)  # on CPU the process's max RSS: a high-water mark, in MiB
    losses = [steps[s]["loss"] for s in range(1, STEPS + 1)]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5
    assert all((r["ntl"] > 0) == (r["number_token_fraction"] > 0) for r in steps.values())
    assert sum(r["number_token_fraction"] for r in steps.values()) / STEPS > 0.1
    assert all(r["loss"] == pytest.approx(r["ce"] + 0.3 * r["ntl"]) for r in steps.values())
    assert [steps[s]["tokens"] for s in (1, STEPS)] == [GLOBAL_BATCH * SEQ_LEN, STEPS * GLOBAL_BATCH * SEQ_LEN]
    assert steps[1]["lr"] == pytest.approx(3e-3 / 10)  # first warmup step of tiny-cpu's schedule
    assert evals[50]["val_ntl"] > 0 and evals[50]["val_ce"] < evals[25]["val_ce"]


def test_run_directory_holds_resolved_recipe_and_last_checkpoints(tiny_run, ds_config):
    resolved, _ = load_run(TINY, overrides(tiny_run, ds_config), 2)  # with the ZeRO stage the run trained at
    assert load_recipe(tiny_run / "recipe.yaml") == resolved and resolved.deepspeed.zero_stage == 3
    root = tiny_run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_40", "step_50"]  # keep_last=2
    assert (root / "latest").read_text() == "step_50"
    assert {"hf_config", "tokenizer", "recipe.yaml"} <= {p.name for p in (root / "step_50").iterdir()}


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory) -> Path:
    """The last checkpoint exported to an HF folder by `ntl-pretrain export`."""
    out = tmp_path_factory.mktemp("export") / "hf"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "export", str(tiny_run / "checkpoints" / "step_50"), str(out)]
    done = subprocess.run(command, check=True, cwd=REPO, env=as_a_user_runs_it(), capture_output=True, text=True)
    (out.parent / "export.log").write_text(done.stderr + done.stdout)  # its console's lines, then the folder
    return out


def test_export_on_a_machine_without_a_gpu_prints_no_accelerator_warning(exported):
    """DeepSpeed guesses the CPU and warns about it unless told (issue 42: no such line off the happy path)."""
    output = (exported.parent / "export.log").read_text()
    assert str(exported) in output and "Setting accelerator to CPU" not in output
    assert output.startswith("ntl-pretrain export: ") and f"-> {exported}: loading the libraries" in output


def test_export_reproduces_the_engines_validation_loss(tiny_run, exported):
    """The exported HF model, run by plain transformers on exactly the batches each rank evaluated, gives the
    CE and NTL the ZeRO-3 engine logged for the same weights."""
    out = exported
    assert (out / "model.safetensors").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert_model_reproduces_logged_validation(model, tokenizer, tiny_run, STEPS, micro_batch_size=4)


def test_generation_metrics_during_training_equal_the_exported_models(tiny_run, exported):
    """`eval.every_steps` logs greedy-answer metrics computed by the 2 ZeRO-3 ranks together; the exported model
    answering the same questions alone in one process scores the same."""
    logged = records(tiny_run, "eval")
    assert sorted(logged) == [25, 50]
    recipe = load_recipe(tiny_run / "recipe.yaml")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(exported), AutoTokenizer.from_pretrained(exported)
    expected = generation_metrics(model, tokenizer, recipe.eval)
    got = {key: value for key, value in logged[STEPS].items() if key.startswith("eval/")}
    assert got.keys() == expected.keys() and len(got) >= 12
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert got["eval/arithmetic_interpolation/examples"] == 4


def test_sigkill_and_resume_logs_identical_losses(tiny_run, ds_config, tmp_path):
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    process = launch(overrides(output_dir, ds_config), log)
    root, killed_mid_save = output_dir / "checkpoints", False
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        killed_mid_save = (root / "step_40.tmp").exists()
        if killed_mid_save or (root / "step_40").exists():
            break
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    print("killed", "while step_40 was being saved" if killed_mid_save else "after step_40 was published")
    assert process.wait() == -signal.SIGKILL, log.read_text()[-4000:]
    assert (root / (root / "latest").read_text()).is_dir()  # the pointer names a complete checkpoint

    run_to_end(overrides(output_dir, ds_config), tmp_path / "resumed.txt")
    expected, expected_evals = records(tiny_run), records(tiny_run, "validation")
    got, got_evals = records(output_dir), records(output_dir, "validation")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6, rel=0), (step, killed_mid_save)
        assert got[step]["tokens"] == expected[step]["tokens"]
    assert got_evals[50]["val_loss"] == pytest.approx(expected_evals[50]["val_loss"], abs=1e-6, rel=0)


def test_ce_only_runs_the_same_path(tiny_run, ds_config, tmp_path):
    output_dir = tmp_path / "run"
    extra = ("loss.ntl.kind=null", "train.max_steps=10", "train.eval_every_steps=null")
    run_to_end(overrides(output_dir, ds_config, *extra), tmp_path / "log.txt")
    steps, with_ntl = records(output_dir), records(tiny_run)
    assert sorted(steps) == list(range(1, 11))
    assert all(r["ntl"] == 0 and r["loss"] == r["ce"] and r["number_token_fraction"] == 0 for r in steps.values())
    assert steps[1]["ce"] == pytest.approx(with_ntl[1]["ce"], abs=1e-6)  # same init, same data, same forward
    assert steps[2]["ce"] != pytest.approx(with_ntl[2]["ce"], abs=1e-6)  # the first update differed (no NTL)
    assert steps[10]["loss"] < steps[1]["loss"]


def test_nonfinite_steps_are_skipped_then_stop_the_run(ds_config, tmp_path):
    """An absurd learning rate breaks the weights at step 1; later steps are skipped until the guard stops."""
    output_dir, log = tmp_path / "run", tmp_path / "log.txt"
    extra = ("optimizer.lr=1e30", "schedule.warmup_steps=0", "train.max_nonfinite_steps=3")
    process = launch(overrides(output_dir, ds_config, *extra), log)
    assert process.wait(timeout=400) != 0
    assert "3 steps in a row had a non-finite loss or gradient" in log.read_text()
    steps = records(output_dir)
    assert sorted(steps) == [1, 2, 3, 4] and [steps[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert math.isfinite(steps[1]["loss"]) and steps[2]["loss"] in ("nan", "inf")


def test_number_level_ntl_trains_through_the_chunked_head(ds_config, tmp_path):
    """kind: number through the default chunked head on 2 ranks: the loss falls and NTL is normalised by the global
    count of numbers (so it stays within [0, 1]). Resuming does not depend on the kind: the SIGKILL test above."""
    extra = ("loss.ntl.kind=number", "train.max_steps=20", "train.eval_every_steps=null", "eval.every_steps=null")
    run_to_end(overrides(tmp_path / "run", ds_config, *extra), tmp_path / "log.txt")
    steps = records(tmp_path / "run")
    assert sorted(steps) == list(range(1, 21))
    assert all(0 < r["ntl"] <= 1 and r["loss"] == pytest.approx(r["ce"] + 0.3 * r["ntl"]) for r in steps.values())
    assert sum(steps[s]["loss"] for s in range(16, 21)) < sum(steps[s]["loss"] for s in range(1, 6)) - 0.5
