"""The README's two commands in the order a newcomer runs them, in a copy of the checkout: the main job leaves
`runs/tiny-cpu` behind, then the tests run beside it. A test that read the working directory failed here ("already
at step 300 of train.max_steps=7; nothing to train"); so would one that ran a shipped recipe without a
`train.output_dir` of its own, which now writes into the checkout's `runs/`. The main job is the README's command,
shortened by overrides (its run still ends past the step the dry-run test asks for); the test run is the one that
failed, not the suite."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launches import LAUNCH_TIMEOUT_S, REPO

pytestmark = pytest.mark.slow

# What the two commands read: the package, the DeepSpeed configs, the recipes, the tests and their settings.
CHECKOUT = ("ntl_pretrain", "recipes", "configs", "tests", "pyproject.toml", "README.md")
MAIN_JOB_STEPS = 8  # past the 7 steps the dry-run test asks for, as the README's 300 are
CHEAP = [f"train.max_steps={MAIN_JOB_STEPS}", "data.seq_len=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.eval_every_steps=null", "logging.progress_bar=false"]  # fmt: skip
ONCE_FAILED = "tests/test_config.py::test_cli_dry_run_prints_the_resolved_recipe_and_launcher"


def copy_of_the_checkout(into: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
    for name in CHECKOUT:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(source, into / name)
    return into


def test_the_tests_pass_after_the_main_job_in_the_same_checkout(tmp_path):
    checkout = copy_of_the_checkout(tmp_path / "checkout")
    env = {**os.environ, "PYTHONPATH": str(checkout), "DS_ACCELERATOR": "cpu"}  # the copy's package, not REPO's
    main_job = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "2", *CHEAP]
    done = subprocess.run(main_job, cwd=checkout, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (checkout / "runs" / "tiny-cpu" / "checkpoints" / f"step_{MAIN_JOB_STEPS}").is_dir()  # where README says
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ONCE_FAILED]
    done = subprocess.run(tests, cwd=checkout, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:]
