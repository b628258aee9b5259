"""A failure inside a run (here the tracker, at the step-2 validation record) on 2 CPU ranks (issue 31): the step's
checkpoint was saved before its evaluation, metrics.jsonl holds every step done, and the console ends with one line
naming what failed and the log file that holds its traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.distributed import free_port
from helpers.launches import REPO, TINY, environment, records

pytestmark = pytest.mark.slow

FAILING_TRACKER = """
class Run:
    def log(self, record, step):
        if "val_loss" in record:
            raise RuntimeError("tracker down")

    def finish(self):
        pass


def init(**settings):
    return Run()
"""


def test_a_failing_tracker_leaves_checkpoint_and_metrics_and_ends_with_one_line(tmp_path):
    (tmp_path / "tracker").mkdir()
    (tmp_path / "tracker" / "wandb.py").write_text(FAILING_TRACKER)
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2", "--master-port",
               str(free_port()), f"train.output_dir={output_dir}", "train.max_steps=4", "data.seq_len=32",
               "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every_steps=2",
               "train.eval_max_batches=1", "checkpoint.every_steps=2", "logging.wandb=true"]  # fmt: skip
    # offline: W&B's pre-flight then needs no key or server (the stand-in tracker fails later, inside the run)
    env = {**environment(), "PYTHONPATH": f"{REPO}:{tmp_path / 'tracker'}", "WANDB_MODE": "offline"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 1, done.stderr[-4000:]

    assert (output_dir / "checkpoints" / "latest").read_text() == "step_2"  # saved before the evaluation failed
    assert sorted(records(output_dir)) == [1, 2]
    assert json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[-1])["split"] == "validation"
    log = output_dir / "logs" / "failure-rank0.log"
    line = f"ntl-pretrain: rank 0: after step 2: RuntimeError: tracker down; traceback in {log}; checkpoints " \
        "(step_2) and metrics.jsonl are intact"  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == f"{line} (exit code 1)", done.stderr[-4000:]  # last, after the launcher's own lines
    assert line in lines and "Traceback" not in done.stderr
    assert 'raise RuntimeError("tracker down")' in log.read_text()
    assert not (output_dir / "logs" / "failure-rank1.log").exists()  # rank 1 only lost its peer
