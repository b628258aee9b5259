"""`ntl-pretrain doctor --quick` passes on CPU with 1 and 2 gloo ranks, and fails when a fault is planted: a loss
that is wrong on the device, a collective that returns the wrong sum (on one rank: the report names it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from distributed import free_port, run_distributed
from launches import REPO, RUNNER, environment

from ntl_pretrain.doctor import loss_checks
from ntl_pretrain.doctor.collectives import collectives_check
from ntl_pretrain.doctor.report import Check, merge_ranks, table

pytestmark = pytest.mark.slow
ROWS = ["environment", "all-reduce cpu", "all-reduce bandwidth", "loss fused float32", "loss fused bfloat16",
        "loss chunked float32", "loss chunked bfloat16", "loss vocab-parallel fp32", "speed loss",
        "speed output layer", "train", "train resume", "export", "throughput"]  # fmt: skip


def report_of(command: list[str], out, log) -> dict:
    with log.open("w") as output:
        done = subprocess.run(command, cwd=REPO, env=environment(), stdout=output, stderr=subprocess.STDOUT,
                              timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, log.read_text()[-4000:]
    report = json.loads(out.read_text())
    assert [check["name"] for check in report["checks"]] == ROWS
    return {check["name"]: check for check in report["checks"]}


def test_one_process_passes_on_cpu(tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "doctor", "--quick", "--out", str(out)]
    checks = report_of(command, out, tmp_path / "log.txt")
    skipped = {name for name, check in checks.items() if check["status"] == "skip"}
    assert skipped == {"all-reduce bandwidth", "loss vocab-parallel fp32", "throughput"}
    assert "1 rank(s), fp32, attention sdpa, AdamW default" in checks["train"]["figure"]
    assert checks["train resume"]["detail"]["worst_relative_difference"] == 0.0  # fp32 on CPU: bit-exact
    assert max(checks["export"]["detail"].values()) < 1e-5
    progress = [line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("ntl-pretrain")]
    assert progress[:5] == [f"ntl-pretrain doctor: running the {name} checks"
                            for name in ("environment", "collectives", "loss", "speed", "train")]  # fmt: skip


def test_two_ranks_pass_on_cpu_and_check_the_vocabulary_parallel_loss(tmp_path):
    out = tmp_path / "report.json"
    command = [*RUNNER, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "ntl_pretrain.doctor",
               "--quick", "--out", str(out)]  # fmt: skip
    checks = report_of(command, out, tmp_path / "log.txt")
    assert {name for name, check in checks.items() if check["status"] == "skip"} == {"throughput"}
    assert checks["loss vocab-parallel fp32"]["figure"].startswith("2 ranks, 20 cases")
    assert "2 rank(s), fp32" in checks["train"]["figure"]
    assert checks["all-reduce bandwidth"]["detail"]["rank1"]["busbw_GBps"] > 0


def planted_faults() -> None:
    """Rank 1's all-reduce adds one; every rank's device loss is 0.1% too large (float64, the reference, is not)."""
    all_reduce, ce_ntl_loss = dist.all_reduce, loss_checks.ce_ntl_loss

    def wrong_sum(tensor, *args, **kwargs):
        result = all_reduce(tensor, *args, **kwargs)
        if dist.get_rank() == 1:
            tensor += 1
        return result

    def wrong_loss(logits, *args, **kwargs):
        out = ce_ntl_loss(logits, *args, **kwargs)
        if logits.dtype != torch.float64:
            out.loss = out.loss * 1.001
        return out

    dist.all_reduce = wrong_sum
    collectives = collectives_check(torch.device("cpu"), quick=True)
    dist.all_reduce = all_reduce
    loss_checks.ce_ntl_loss = wrong_loss
    try:
        losses = loss_checks.loss_check(torch.device("cpu"))
    finally:
        loss_checks.ce_ntl_loss = ce_ntl_loss
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, collectives + losses)
    merged = {check.name: check for check in merge_ranks(per_rank)}
    assert merged["all-reduce cpu"].ok is False and merged["all-reduce cpu"].figure.startswith("rank 1: ")
    assert "elements wrong" in merged["all-reduce cpu"].figure
    for name in ("loss fused float32", "loss fused bfloat16", "loss vocab-parallel fp32"):
        assert merged[name].ok is False, merged[name].figure
        assert "worst loss 1.0e-03" in merged[name].figure
    assert merged["loss chunked float32"].ok  # linear_ce_ntl_loss was not touched


def test_a_planted_fault_fails_its_check_and_names_the_rank():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_distributed(planted_faults, 2)


def test_the_summary_counts_skipped_checks_apart_and_says_why():
    checks = [Check("a", True, "1 s"), Check("b", None, "no GPU"), Check("c", True, "2 s"), Check("d", None, "quick")]
    assert table(checks).splitlines()[-1] == "2 passed, 2 skipped (b: no GPU; d: quick) of 4 checks"
    checks.append(Check("e", False, "wrong sum"))
    assert table(checks).splitlines()[-1] == "1 failed, 2 passed, 2 skipped (b: no GPU; d: quick) of 5 checks"
    assert table(checks[:1]).splitlines()[-1] == "1 passed of 1 checks"
