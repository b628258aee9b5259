"""bench/gpu_first_run.sh: its CPU dry run passes every stage at toy sizes (the first GPU call must not fail on a
typo), and its runner records a stage that fails or overruns, kills all it started, and goes on."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from helpers.launches import REPO, environment

SCRIPT = REPO / "bench" / "gpu_first_run.sh"
ROW = r"[\d.]+ ms, time [\d.]+x, \d+ host ops, \d+ Triton launches"  # a heads row on CPU (no peak memory)


def runner():
    spec = importlib.util.spec_from_file_location("gpu_first_run", REPO / "bench" / "gpu_first_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def toy_wheel(folder: Path) -> Path:
    """A one-module wheel, for the install stage to install as it installs DeepSpeed's."""
    folder.mkdir()
    info = "ntl_toy_wheel-1.0.dist-info"
    files = {
        "ntl_toy_wheel.py": "VALUE = 1\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: ntl-toy-wheel\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / "ntl_toy_wheel-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return folder


@pytest.mark.slow
def test_the_dry_run_passes_every_stage_on_cpu(tmp_path):
    out, work, pins = tmp_path / "out", tmp_path / "work", tmp_path / "pins.txt"
    pins.write_text("ntl-toy-wheel==1.0\nliger-kernel==0.8.5  # optional\n")
    command = ["bash", str(SCRIPT), "--dry-run", "--out", str(out), "--work", str(work), "--wheels",
               str(toy_wheel(tmp_path / "wheels")), "--pins", str(pins), "--budget", "1600"]  # fmt: skip
    # 23 stages take 7-14 minutes on 2 shared cores: the GPU's 480 s budget would cut the last ones
    reports = {path: path.read_bytes() for path in (REPO / "docs" / "study.md", REPO / "docs" / "study.png")}
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=1700, check=False)
    summary = json.loads((out / "summary.json").read_text())
    stages = {stage["name"]: stage for stage in summary["stages"]}
    assert done.returncode == 0 and {stage["status"] for stage in stages.values()} == {"ok"}, done.stdout
    assert stages["install"]["figures"]["wheels"] == ["ntl_toy_wheel-1.0-py3-none-any.whl"]
    assert stages["install"]["figures"]["optional_absent"] == ["liger_kernel==0.8.5"]
    assert (work / "site-packages" / "ntl_toy_wheel.py").is_file()
    assert stages["doctor"]["figures"]["bf16 gradient accumulation"].startswith("ok: ")
    heads = stages["heads"]["figures"]
    assert re.fullmatch(ROW, heads["head: chunked head CE+NTL-WAS"]) and heads["triton"] == "measured"
    assert re.fullmatch(ROW, heads["head: chunked head CE+NTL-WAS [triton]"])  # interpreted: the rows run before a GPU
    assert float(heads["triton vs torch, digits"]) < 2**-6  # bf16 gradients: within a rounding or two
    assert "target loss, digits over WAS (Triton)" in heads
    assert heads["kernels"].startswith("6 compiled (sm_90), 0 spilling"), heads["kernels"]  # CE's kernels, offline
    assert heads["loss: ce_ntl_loss CE+NTL-WAS [triton]"].endswith(" host ops, 2 Triton launches")  # forward, backward
    # the training loss: the class members' pass and the fused kernel in forward, the scaling in backward
    assert heads["loss: training loss CE+NTL-WAS [triton]"].endswith(" host ops, 3 Triton launches")
    assert "target training loss CE+NTL-number, Triton over Liger's CE" not in heads  # no Liger on CPU: no ratio
    assert stages["heads_50257"]["figures"]["shape"].startswith("N=16 V=2257 ")  # a width 16 does not divide
    sweep = stages["kernel_sweep"]["figures"]
    row = r"training loss CE only \[triton\] [\d.]+ ms, training loss CE\+NTL-WAS \[triton\] [\d.]+ ms"
    assert sweep["liger CE"].startswith("liger-kernel") and re.fullmatch(row, sweep["32768/32"]), sweep
    step = stages["head_step"]["figures"]
    assert step["triton"] == "measured" and step["chunked head CE+NTL-WAS [triton]"].endswith("x")
    assert step["apply_ntl CE+NTL-WAS"].endswith("x")  # the drop-in's patched forward, timed beside the heads
    assert stages["train_125m"]["figures"]["steps"] == 3 and stages["train_125m"]["figures"]["tokens_per_s"] > 0
    assert stages["train_125m"]["figures"]["profile"]["steps"] == [2, 2]
    persistent = stages["train_125m_persistent"]["figures"]
    assert persistent["steps"] == 3 and persistent["train_125m_step_over_this"] > 0
    assert persistent["profile"]["steps"] == [2, 2]
    plain = stages["plain_step"]["figures"]
    assert plain["step_seconds"] > 0 and plain["ours_over_plain"] > 0
    assert stages["plain_compiled"]["figures"]["step_seconds"] > 0
    for name in ("train_125m_zero2", "train_125m_compiled"):  # ZeRO-2 and compiled layers over both plain steps
        figures = stages[name]["figures"]
        assert figures["steps"] == 3 and figures["ours_over_plain_step"] > 0 and figures["ours_over_plain_compiled"] > 0
    assert stages["study_probe"]["figures"]["runs_planned"] == 8  # study v6: one seed of its eight arms
    v7 = stages["study_v7_gpu"]["figures"]  # study v7's GPU arm: one seed of one pair, finished and archived
    assert v7["runs_done"] == v7["runs_planned"] == 2 and v7["seeds_complete"] == [300]
    assert all(path.read_bytes() == before for path, before in reports.items())  # its report went to its logs
    plain_1b = stages["plain_1b"]["figures"]  # the 1B stages' commands, at toy sizes
    assert plain_1b["step_seconds"] > 0 and plain_1b["matmul_flops"] > 0 and plain_1b["mfu_of_matmul"] > 0
    for name in ("train_1b_zero2", "train_1b", "train_1b_compiled"):
        figures = stages[name]["figures"]
        assert figures["steps"] == 3 and figures["ours_over_plain_1b"] > 0 and figures["mfu"] > 0
        assert figures["mfu_of"].startswith("measured matmul rate") and figures["peak_mem_mib"] > 0
        assert stages["plain_1b_compiled"]["figures"][f"{name}_over_this"] > 0
    build = stages["deepcompile_build"]["figures"]  # DeepSpeed's DeepCompile op does not build on CPU (no CUDA)
    assert build["built"] is False and "cuda.h" in build["error"], build
    for name in ("train_125m_deepcompile", "train_1b_deepcompile", "deepcompile_resume"):  # refused before launch
        assert "recipe error" in stages[name]["figures"]["refused_on_cpu"] and "DeepCompile" in stages[name]["figures"][
            "refused_on_cpu"]  # fmt: skip
    for name in ("doctor-report.json", "heads.json", "train-125m-metrics.jsonl", "plain-step.json", "summary.md"):
        assert (out / name).is_file(), name
    # The device tool returns at most 8 files from $OUT: the logs travel as one archive.
    assert len([path for path in out.rglob("*") if path.is_file()]) <= 8
    with tarfile.open(out / "logs.tgz") as logs:
        names = logs.getnames()
    assert {f"logs/{stage}.log" for stage in stages} <= set(names)
    assert "logs/train-125m-profile-steps-2-2.txt" in names
    assert "logs/plain-compiled.json" in names
    assert {"logs/study-v7-gpu.md", "logs/study-v7-gpu-runs/regression-ce-seed300/study.json"} <= set(names)
    assert {"logs/heads-50257.json", "logs/kernel-sweep.json"} <= set(names)
    assert runner().marked_processes(summary["marker"].partition("=")[2]) == []  # the probe's runs were killed


def test_issue_56s_group_names_its_stages_in_order_and_leaves_none_out():
    gpu_first_run = runner()
    group = gpu_first_run.GROUPS["issue56"]
    assert group[0] == "install" and set(group) <= set(gpu_first_run.STAGES) and len(set(group)) == len(group)
    one_b = {"plain_1b", "train_1b_zero2", "train_1b", "train_1b_compiled", "plain_1b_compiled"}
    assert one_b | {"plain_step", "train_125m", "train_125m_zero2", "train_125m_compiled"} <= set(group)
    assert group.index("plain_1b") < min(group.index(name) for name in one_b - {"plain_1b"})  # the matmul rate first


def test_issue_73s_group_builds_deepcompile_first_and_measures_both_zero3_engines_beside_plain():
    gpu_first_run = runner()
    group = gpu_first_run.GROUPS["issue73"]
    assert group[:2] == ["install", "deepcompile_build"] and set(group) <= set(gpu_first_run.STAGES)
    assert len(set(group)) == len(group)
    for eager, compiled, plain in (("train_125m", "train_125m_deepcompile", "plain_step"),
                                   ("train_1b", "train_1b_deepcompile", "plain_1b")):  # fmt: skip
        assert group.index(plain) < group.index(eager) < group.index(compiled)  # each compares with those before it


def test_a_failed_or_overrunning_stage_is_recorded_and_the_next_one_runs(tmp_path):
    gpu_first_run = runner()
    token = "test-" + str(time.monotonic_ns())
    env = {**environment(), gpu_first_run.MARKER: token}
    run = gpu_first_run.Run(tmp_path, tmp_path / "work", True, tmp_path / "wheels", tmp_path / "pins",
                            time.monotonic() + 60, env, ["fails", "overruns", "measures"])  # fmt: skip
    # The overrunning command leaves a process in a session of its own, as a launcher's ranks are.
    escape = "import os, time; os.setsid(); time.sleep(60)"
    overrun = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {escape!r}]); time.sleep(60)"
    stages = {
        "fails": lambda run: run.command("fails", [sys.executable, "-c", "print('bad'); raise SystemExit(3)"], 30),
        "overruns": lambda run: run.command("overruns", [sys.executable, "-c", overrun], 2),
        "measures": lambda run: {"figure": 1},
    }
    started = time.monotonic()
    for name, stage in stages.items():
        run.stages.append(gpu_first_run.run_stage(run, name, stage))
        gpu_first_run.write_summary(run, started)
    assert [stage["status"] for stage in run.stages] == ["failed", "timeout", "ok"]
    assert "exit code 3; last lines: " in run.stages[0]["why"] and "bad" in run.stages[0]["why"]
    assert time.monotonic() - started < 30
    assert gpu_first_run.marked_processes(token) == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [stage["name"] for stage in summary["stages"]] == ["fails", "overruns", "measures"]
    assert "| measures | ok |" in (tmp_path / "summary.md").read_text()


def test_a_missing_pinned_wheel_fails_the_install_and_names_it(tmp_path):
    gpu_first_run = runner()
    wheels = toy_wheel(tmp_path / "wheels")
    pins = {"ntl_toy_wheel": ("1.0", False), "deepspeed": ("0.19.8", False), "liger_kernel": ("0.8.5", True)}
    with pytest.raises(gpu_first_run.StageFailed, match="lacks the pinned wheels deepspeed==0.19.8"):
        gpu_first_run.pinned_wheels(wheels, pins)
    pins["ntl_toy_wheel"] = ("2.0", False)  # another version does not count
    with pytest.raises(gpu_first_run.StageFailed, match="ntl_toy_wheel==2.0"):
        gpu_first_run.pinned_wheels(wheels, {"ntl_toy_wheel": pins["ntl_toy_wheel"]})
    assert gpu_first_run.read_pins(REPO / "launch" / "gpu-wheels.txt")["deepspeed"] == ("0.19.8", False)
    assert gpu_first_run.read_pins(REPO / "launch" / "gpu-wheels.txt")["liger_kernel"] == ("0.8.5", True)


def test_the_gpu_pins_satisfy_each_other_as_their_packages_require():
    """Every pinned package installed here at its pinned version: what it requires of another pinned package is
    met by that pin (the first GPU run failed on pydantic 2.14.4 with pydantic-core pinned at 2.46.4, not 2.50.5)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    pins = {name: version for name, (version, _) in runner().read_pins(REPO / "launch" / "gpu-wheels.txt").items()}
    checked, unmet = [], []
    for name, version in pins.items():
        try:
            installed = distribution(name)
        except PackageNotFoundError:
            continue
        if installed.version != version:
            continue
        checked.append(name)
        for requirement in map(Requirement, installed.requires or []):
            pinned = pins.get(runner().normalise(requirement.name))
            if pinned is not None and not requirement.marker and pinned not in requirement.specifier:
                unmet.append(f"{name}=={version} needs {requirement}, pinned {pinned}")
    assert {"deepspeed", "pydantic"} <= set(checked), checked
    assert not unmet
