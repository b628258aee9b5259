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
from helpers.distributed import free_port, run_distributed
from helpers.launches import REPO, RUNNER, environment

from ntl_pretrain.doctor import loss_checks
from ntl_pretrain.doctor.collectives import collectives_check
from ntl_pretrain.doctor.gpu_paths import GPU_PATH_CHECKS
from ntl_pretrain.doctor.report import Check, merge_ranks, table

pytestmark = pytest.mark.slow
ROWS = ["environment", "all-reduce cpu", "all-reduce bandwidth", "network", "loss fused float32",
        "loss fused bfloat16", "loss chunked float32", "loss chunked bfloat16", "loss vocab-parallel fp32",
        "bf16 gradient accumulation", "reduce-scatter fp32 / bf16", "chunked head fp32 accumulation",
        "flash-attention documents", "speed loss", "speed output layer", "ZeRO stage", "train", "train resume",
        "export", "throughput"]  # fmt: skip


def report_of(command: list[str], out, log) -> dict:
    with log.open("w") as output:
        done = subprocess.run(command, cwd=REPO, env=environment(), stdout=output, stderr=subprocess.STDOUT,
                              timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, log.read_text()[-4000:]
    report = json.loads(out.read_text())
    assert [check["name"] for check in report["checks"]] == ROWS
    return {check["name"]: check for check in report["checks"]}


def test_one_process_passes_on_cpu(tmp_path):
    """One process, as `ntl-pretrain doctor` runs on one GPU; the speed and training rows, which run the same code
    at any world size, are left to the 2-rank test (each costs minutes of launches on 2 CPU cores)."""
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "doctor", "--quick", "--skip", "speed", "train", "--out",
               str(out)]  # fmt: skip
    checks = report_of(command, out, tmp_path / "log.txt")
    skipped = {name for name, check in checks.items() if check["status"] == "skip"}
    assert skipped == {"all-reduce bandwidth", "network", "loss vocab-parallel fp32", "reduce-scatter fp32 / bf16",
                       "flash-attention documents", "speed loss", "speed output layer", "train", "train resume",
                       "export", "throughput"}  # fmt: skip
    assert "32.937500, exact 32.937500" in checks["bf16 gradient accumulation"]["figure"]
    assert "upcast path" in checks["chunked head fp32 accumulation"]["figure"]  # no CPU kernel for out_dtype
    progress = [line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("ntl-pretrain")]
    groups = ("environment", "collectives", "loss", *GPU_PATH_CHECKS, "ZeRO stage")
    advice = ("train at stage 2 (the weights fit whole: no gathering, the faster step: deepspeed.zero_stage: 2), eager "
              "(train.compile: false: on CPU ranks compiling takes minutes and DeepCompile does not run)")  # fmt: skip
    assert checks["ZeRO stage"]["figure"].endswith(f"{advice}; the recipe runs stage 3")
    assert progress[: len(groups)] == [f"ntl-pretrain doctor: running the {name} checks" for name in groups]


def test_two_ranks_pass_on_cpu_and_check_the_vocabulary_parallel_loss(tmp_path):
    """Every row a CPU can run, on 2 ranks of a deepspeed launch: the training checks launch a 2-rank run of their
    own from inside it (the doctor's launch variables removed), resume it bit-exactly and export it."""
    out = tmp_path / "report.json"
    command = [*RUNNER, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "ntl_pretrain.doctor",
               "--quick", "--out", str(out)]  # fmt: skip
    checks = report_of(command, out, tmp_path / "log.txt")
    skipped = {name for name, check in checks.items() if check["status"] == "skip"}
    assert skipped == {"network", "flash-attention documents", "throughput"}
    assert checks["reduce-scatter fp32 / bf16"]["detail"]["rank0"]["ratio"] > 0
    assert checks["loss vocab-parallel fp32"]["figure"].startswith("2 ranks, 24 cases")
    assert "2 rank(s), fp32, attention sdpa, AdamW default" in checks["train"]["figure"]
    trained_by = "rank0"  # the node's local rank 0 runs the training checks; rank 1's rows say so
    assert checks["train resume"]["detail"][trained_by]["worst_relative_difference"] == 0.0  # fp32 on CPU: bit-exact
    assert max(checks["export"]["detail"][trained_by].values()) < 1e-5
    assert checks["all-reduce bandwidth"]["detail"]["rank1"]["busbw_GBps"] > 0
    progress = [line for line in (tmp_path / "log.txt").read_text().splitlines() if line.startswith("ntl-pretrain")]
    assert "ntl-pretrain doctor: running the speed checks" in progress
    assert "ntl-pretrain doctor: running the train checks" in progress


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
    from ntl_pretrain.config import deepspeed as deepspeed_config
    from ntl_pretrain.doctor.gpu_paths import gradient_accumulation_check

    assert gradient_accumulation_check(torch.device("cpu")).ok
    deepspeed_config.set_bf16_gradient_dtypes = lambda config: None  # DeepSpeed's default: bf16 sums
    rounded = gradient_accumulation_check(torch.device("cpu"))
    assert rounded.ok is False and "bfloat16 accumulator" in rounded.figure, rounded.figure


def test_a_planted_fault_fails_its_check_and_names_the_rank(monkeypatch):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_distributed(planted_faults, 2)


def accumulation_on_every_rank() -> None:
    """Every rank holds real elements of the checked weight and passes; with DeepSpeed's bf16 sums every rank fails."""
    from ntl_pretrain.config import deepspeed as deepspeed_config
    from ntl_pretrain.doctor.gpu_paths import ELEMENTS_PER_RANK, gradient_accumulation_check

    exact = gradient_accumulation_check(torch.device("cpu"))
    assert exact.ok and f"over {ELEMENTS_PER_RANK} elements" in exact.figure, f"rank {dist.get_rank()}: {exact.figure}"
    deepspeed_config.set_bf16_gradient_dtypes = lambda config: None  # DeepSpeed's default: bf16 sums
    rounded = gradient_accumulation_check(torch.device("cpu"))
    assert rounded.ok is False and "bfloat16 accumulator" in rounded.figure, f"rank {dist.get_rank()}: {rounded.figure}"


def test_gradient_accumulation_passes_on_every_rank_of_5(monkeypatch):
    """At 5+ ranks a 4-element weight left ranks 4+ with padding only: they failed with an exact setup (5 ranks
    hold one such rank; 8 would hold four, at 8 processes' start-up on 2 cores)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_distributed(accumulation_on_every_rank, 5)


def test_the_throughput_row_fails_for_each_reason_it_names():
    from ntl_pretrain.doctor.training import throughput_verdict

    def steps(step_seconds: float, data_seconds: float, model_share: float) -> list[dict]:
        """10 steps whose model step runs at `model_share` of the matmul rate (their mfu counts the wait too)."""
        total = step_seconds + data_seconds
        return [{"tokens_per_s": 8192 / total, "step_seconds": step_seconds, "data_seconds": data_seconds,
                 "mfu": model_share * step_seconds / total}] * 10  # fmt: skip

    sdpa, matmul, h100 = "attention sdpa, AdamW fused", 790e12, 989e12
    healthy = throughput_verdict(steps(0.030, 0.0005, 0.25), sdpa, matmul, h100)
    assert healthy.ok, healthy.figure
    assert "model step at 25.0% of this GPU's bf16 matmul rate 790 TFLOP/s" in healthy.figure
    assert "MFU 20.0% of the datasheet peak" in healthy.figure
    h200 = throughput_verdict(steps(0.0965, 0.0004, 0.085), sdpa, 803e12, None)  # measured 2026-11-28
    assert h200.ok, h200.figure
    cases = {  # a starved loader halves the end-to-end rate but not the model step's
        "waiting for data above 10% of the step": (steps(0.030, 0.030, 0.25), sdpa),
        "model step below 6% of the matmul rate": (steps(0.030, 0.0005, 0.041), sdpa),  # the H200 on 2026-11-27
        "eager attention": (steps(0.030, 0.0005, 0.25), "attention eager, AdamW fused"),
    }
    for reason, (records, attention) in cases.items():
        verdict = throughput_verdict(records, attention, matmul, None)
        assert verdict.ok is False and verdict.figure.endswith(f": {reason}"), verdict.figure
    starved = throughput_verdict(cases["waiting for data above 10% of the step"][0], sdpa, matmul, None)
    assert starved.detail["model_step_of_matmul"] == pytest.approx(0.25)


def test_the_summary_counts_skipped_checks_apart_and_says_why():
    checks = [Check("a", True, "1 s"), Check("b", None, "no GPU"), Check("c", True, "2 s"), Check("d", None, "quick")]
    assert table(checks).splitlines()[-1] == "2 passed, 2 skipped (b: no GPU; d: quick) of 4 checks"
    checks.append(Check("e", False, "wrong sum"))
    assert table(checks).splitlines()[-1] == "1 failed, 2 passed, 2 skipped (b: no GPU; d: quick) of 5 checks"
    assert table(checks[:1]).splitlines()[-1] == "1 passed of 1 checks"


def test_bandwidth_and_network_rows_can_fail(tmp_path, monkeypatch):
    from ntl_pretrain.doctor import collectives

    measured = {"megabytes": 256, "seconds": 0.01, "algbw_GBps": 100.0, "busbw_GBps": 175.0}
    assert collectives.bandwidth_verdict(measured, None).ok  # nothing to compare with: measured only
    assert collectives.bandwidth_verdict(measured, 360.0).ok is False  # below half of an H100 node's NVLink
    assert collectives.bandwidth_verdict({**measured, "busbw_GBps": 181.0}, 360.0).ok
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / collectives.NCCL_LOG))
    log = tmp_path / f"nccl.gpu07.{os.getpid()}.log"
    cuda = torch.device("cuda")
    for network, ok in (("Socket", False), ("IB", True)):
        log.write_text(
            f"gpu07:123:123 [0] NCCL INFO NET/Plugin: ...\ngpu07:123:123 [0] NCCL INFO Using network {network}\n"
        )
        assert collectives.network_check(cuda, nodes=2).ok is ok
    assert collectives.network_check(cuda, nodes=1).ok is None  # one node: no network between GPUs
