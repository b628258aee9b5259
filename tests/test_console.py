"""The console of a run: by default the progress bar, rank 0's lines and errors; `logging.verbose: true` brings back
DeepSpeed's launcher INFO lines and the deprecation warnings its collectives raise in torch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from launches import records
from transformers.utils import logging as transformers_logging

from ntl_pretrain.train import quiet_console

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
DEPRECATION = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`"
)


def train_two_steps(output_dir: Path, *extra: str) -> str:
    """One CPU rank, two tiny steps through `ntl-pretrain train`; stdout and stderr together, as a terminal shows."""
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "1",
               f"train.output_dir={output_dir}", "train.max_steps=2", "data.seq_len=32", "train.micro_batch_size=2",
               "train.global_batch_size=2", "train.eval_every_steps=null", *extra]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert sorted(records(output_dir)) == [1, 2]
    return done.stdout


@pytest.mark.slow
def test_default_console_is_quiet_and_verbose_shows_everything(tmp_path):
    quiet = train_two_steps(tmp_path / "quiet")
    assert f"ntl-pretrain: {tmp_path / 'quiet'}: starting from scratch" in quiet
    assert "2/2" in quiet  # the progress bar
    assert "[INFO]" not in quiet and "FutureWarning" not in quiet and "[WARNING]" not in quiet, quiet

    verbose = train_two_steps(tmp_path / "verbose", "logging.verbose=true")
    assert "[INFO] [launch.py" in verbose and "[WARNING] [runner.py" in verbose
    assert f"FutureWarning: {DEPRECATION}" in verbose


@pytest.fixture
def restored_console():
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_level, transformers_level = deepspeed_logger.level, transformers_logging.get_verbosity()
    with warnings.catch_warnings():
        yield deepspeed_logger
    for logger_or_handler in (deepspeed_logger, *deepspeed_logger.handlers):  # DeepSpeed sets both alike
        logger_or_handler.setLevel(deepspeed_level)
    transformers_logging.set_verbosity(transformers_level)


def test_rank_0_hides_only_the_deprecated_collectives(restored_console):
    quiet_console(rank=0)
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn(DEPRECATION + " instead.", FutureWarning, stacklevel=1)
        warnings.warn("a warning of its own", UserWarning, stacklevel=1)
        warnings.warn("`torch.load` default changes", FutureWarning, stacklevel=1)
    assert [str(warning.message) for warning in shown] == ["a warning of its own", "`torch.load` default changes"]
    assert restored_console.getEffectiveLevel() == logging.WARNING


def test_other_ranks_show_errors_only(restored_console):
    quiet_console(rank=1)
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn("rank 0 shows this one", UserWarning, stacklevel=1)
    assert shown == []
    assert restored_console.getEffectiveLevel() == logging.ERROR
    assert transformers_logging.get_verbosity() == logging.ERROR
