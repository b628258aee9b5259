"""AdamW's implementation follows where it runs: DeepSpeed's CPU Adam when ZeRO offloads the optimizer, fused on
CUDA, torch's default on CPU ranks; and the offloaded run trains the same model as the plain one."""

from __future__ import annotations

import json

import pytest
from helpers.launches import REPO, partition_all_config, single_launcher_run, step_records

from ntl_pretrain.optim.optimizer import optimizer_kind

CONFIGS = REPO / "ntl_pretrain" / "config"


@pytest.mark.parametrize(("config", "device", "kind"), [
    ("zero3.json", "cpu", "default"), ("zero3.json", "cuda", "fused"),
    ("zero3_offload.json", "cpu", "deepspeed-cpu-adam"), ("zero3_offload.json", "cuda", "deepspeed-cpu-adam"),
])  # fmt: skip
def test_the_optimizer_follows_where_it_runs(config, device, kind):
    assert optimizer_kind(json.loads((CONFIGS / config).read_text()), device) == kind


@pytest.mark.slow
def test_an_offloaded_run_steps_with_deepspeed_cpu_adam_and_trains_the_same_model(tmp_path):
    """DeepSpeed's CPU Adam (compiled on first use) against torch's AdamW: the same update rule, so the loss
    curves agree to float32 rounding (the two kernels order their arithmetic differently)."""
    offload = json.loads((CONFIGS / "zero3_offload.json").read_text())
    offload["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "offload.json").write_text(json.dumps(offload))
    offloaded = single_launcher_run(tmp_path / "offloaded", tmp_path / "offload.json", ranks=1)
    plain = single_launcher_run(tmp_path / "plain", partition_all_config(tmp_path), ranks=1)
    assert "AdamW deepspeed-cpu-adam" in (tmp_path / "offloaded.log").read_text()
    assert "AdamW default" in (tmp_path / "plain.log").read_text()
    a, b = step_records(offloaded), step_records(plain)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert a[1]["loss"] == b[1]["loss"]  # the first step's loss comes before any update
    for step in range(2, 7):
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-5), step
