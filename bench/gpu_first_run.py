"""The first GPU run, every stage time-boxed: bench/gpu_first_run.sh runs this file (docs/doctor.md, "The first
GPU"). Standard library only until the install stage has run: the GPU machine has no DeepSpeed before it.

Stages, in order of what a short-lived GPU should give first:
  install     the carried wheels (launch/gpu-wheels.txt's pins) into a folder put first on PYTHONPATH
  doctor      `ntl-pretrain doctor` on the one GPU (1 rank), its JSON report
  heads       bench/gpu_heads.py: the loss and the output layer in bf16, ours (torch and Triton backends) vs torch
              CE and Liger-Kernel, with host ops per call, the Triton backend's agreement with the torch one, issue
              57's targets, and our Triton kernels' registers and spills (compiled offline for sm_80 and sm_90)
  head_step   bench/head_step.py: the 135M model's plain step with our head (torch and Triton backends) over the
              same step with transformers' head + CE (issue 48: ours no slower)
  train_125m  30 bf16 steps of a SmolLM2-135M-shaped Llama (30x576, vocabulary 49,152) at sequence 2,048:
              tokens/s, MFU, peak memory, the step apart from the wait for data, and steps 20-22 profiled
              (CPU op time, kernel time, ops and kernel launches per step; the table in logs.tgz)
  plain_step  bench/plain_step.py: the same model and batch in plain torch (no DeepSpeed), and our step over it
  plain_compiled  the plain step under torch.compile: the fastest plain step (first GPU run: 84 ms, 89 s compiling)
  train_125m_zero2  30 steps of train_125m at ZeRO stage 2, the recommended stage for a model that fits one device
              (no gathering in forward and backward): ours over the plain step and over the compiled one
  train_125m_compiled  40 steps of train_125m_zero2 with `train.compile` (each decoder layer compiled): ours over
              the compiled plain step, issue 47's target 1.2x
  train_125m_persistent  30 steps of train_125m with ZeRO-3 gathering nothing (every matrix persistent, plain
              linear layers): how much of the step is ZeRO-3's per-module gather and release
  study_probe study v6's main command (docs/study-v6-protocol.md) with --device cuda --jobs 8 for 3 minutes, then
              the runs' progress (`study --status`) gives r, runs per minute: how many of the study's runs a call
              of the device tool finishes
  study_v7_gpu  study v7's GPU arm: its four 1–3-digit arms with a 10x larger model (recipes/study/v7-gpu), seed by
              seed from 300, 8 runs at a time, until the stage's time is up; every finished run archived with its code
              and device (logs.tgz: study-v7-gpu-runs/), then its throughput (runs and whole seeds a call finishes)
  plain_1b, plain_1b_compiled  the plain step (eager, compiled) of a Llama-3.2-1B-shaped model (16x2048, 32/8
              heads, MLP 8,192, vocabulary 128,256 tied) at sequence 2,048, micro-batch `BATCH_1B`, with this GPU's
              measured bf16 matmul rate: MFU against it
  train_1b_zero2, train_1b, train_1b_compiled  ours on that model at ZeRO-2, ZeRO-3 and ZeRO-2 + `train.compile`:
              MFU against the measured matmul rate, peak memory, over the plain steps (issue 56's targets: ZeRO-2
              at most 1.05x the plain step; compiled at least 35% of the matmul rate)
  deepcompile_build  bench/deepcompile_build.py: DeepSpeed's DeepCompile op built on this machine (seconds), or the
              compiler's error (on CPU, the dry run: `cuda.h` not found; docs/compatibility.md, "DeepCompile")
  train_125m_deepcompile, train_1b_deepcompile  train_125m and train_1b with `train.compile` at ZeRO-3, which is
              DeepSpeed's DeepCompile: over the plain steps (issue 73's targets: ZeRO-3 + DeepCompile at most 1.1x the
              compiled plain step, at least 35% MFU at 1B), and each step's loss against the eager ZeRO-3 run's
  deepcompile_resume  12 steps of train_125m_deepcompile saved at step 6, then resumed from it: the resumed losses
              against the uninterrupted run's (the dry run: the refusal on CPU, one line)

`--group issue56` runs issue 56's stages in the order of what they answer first, within one 570 s call of the
device tool (docs/doctor.md, "The first GPU"); `--group issue70` the loss stages of issue 70 (heads, heads_50257:
the heads stage at GPT-2's vocabulary, kernel_sweep: bench/gpu_heads.py --sweep, the Triton kernels' row block and
warps against Liger's CE), about 250 s; `--group issue73` issue 73's (ZeRO-3 eager and with DeepCompile).

A stage that fails or runs out of time is recorded and the next one runs; `summary.json` and `summary.md` in the
output folder are rewritten before the first stage and after each, so a kill at the device's limit still leaves
every figure measured so far. Each command runs in a session of its own and is killed with everything it started
(also the runs' launchers, which live in sessions of their own: found by a marker in their environment).
`--dry-run` runs every stage on CPU at toy sizes (tests/test_gpu_first_run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "NTL_FIRST_RUN"  # in every stage process's environment, so that the sweep finds what left its session
KILL_GRACE_S = 5.0
MIN_STAGE_S = 20.0  # a stage with less time than this left is skipped, not started to be killed at once
PROBE_S = {"gpu": 180.0, "dry": 15.0}  # the protocol's 3 minutes
STUDY_RECIPES = REPO / "recipes" / "study" / "v6"
STUDY_VARIANTS = [f"{folder}/{arm}" for folder in ("regression", "regression-1digit", "regression-exact",
                  "regression-exact-1digit") for arm in ("ce", "ntl-was-answer")]  # fmt: skip
STUDY_SEEDS = range(64, 76)  # docs/study-v6-protocol.md
# Study v7's GPU arm (docs/study-v7-protocol.md): its 1–3-digit arms with a 10x larger model, seeds from 300 up, as many
# as the calls finish; 8 runs at a time on the one GPU, so two seeds' four arms run together and a cut loses at most
# the seeds in flight.
V7_GPU_RECIPES = REPO / "recipes" / "study" / "v7-gpu"
V7_GPU_VARIANTS = [
    f"{folder}/{arm}" for folder in ("regression", "regression-exact") for arm in ("ce", "ntl-was-answer")
]
V7_GPU_SEEDS = range(300, 364)
V7_GPU_JOBS = 8
MODEL_125M = ["model.config.hidden_size=576", "model.config.intermediate_size=1536",
              "model.config.num_hidden_layers=30", "model.config.num_attention_heads=9",
              "model.config.num_key_value_heads=3", "model.config.vocab_size=49152",
              "model.config.tie_word_embeddings=true", "model.config.max_position_embeddings=2048"]  # fmt: skip
# Llama-3.2-1B's shape (its rope scaling aside, which costs nothing). Micro-batch 8: the plain eager step, the
# largest of the stages in memory, is estimated at 20 GB of fp32 weights, gradients and Adam states plus ~7 GB per
# sequence of 2,048 (activations ~2 GB, the logits and their fp32 copies in transformers' loss ~5 GB; scaled from
# the 135M plain step's 25.5 GB at micro-batch 8): ~75 GB at 8, ~130 GB at 16, too close to an H200's 150 GB.
MODEL_1B = ["model.config.hidden_size=2048", "model.config.intermediate_size=8192",
            "model.config.num_hidden_layers=16", "model.config.num_attention_heads=32",
            "model.config.num_key_value_heads=8", "model.config.vocab_size=128256",
            "model.config.tie_word_embeddings=true", "model.config.max_position_embeddings=2048"]  # fmt: skip
BATCH_1B = 8
DRY_RAGGED_VOCAB = 2_257  # the dry run's stand-in for a width 16 does not divide (GPT-2's 50,257)
MODEL_TOY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.seq_len=64",
             "train.micro_batch_size=2", "train.global_batch_size=2", "train.max_steps=3", "train.device=cpu",
             "train.precision=fp32", "logging.profile_steps=[2,1]"]  # fmt: skip


class StageFailed(Exception):
    """A stage's command exited non-zero or ran out of its time; `figures` holds what it measured anyway."""

    def __init__(self, message: str, status: str = "failed", figures: dict | None = None):
        super().__init__(message)
        self.status, self.figures = status, figures or {}


@dataclass
class Run:
    out: Path
    work: Path
    dry_run: bool
    wheels: Path
    pins: Path
    deadline: float
    env: dict[str, str]
    planned: list[str] = field(default_factory=lambda: list(STAGES))
    stages: list[dict] = field(default_factory=list)

    @property
    def site(self) -> Path:
        return self.work / "site-packages"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def command(self, name: str, args: list[str], timeout: float, expect_timeout: bool = False) -> None:
        """Run `args` (log: logs/<name>.log) within `timeout` s; raise StageFailed when it fails or overruns
        (unless `expect_timeout`: the study probe is ended by its time box)."""
        log = self.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as output:
            output.write(f"$ {' '.join(args)}\n")
            output.flush()
            code = run_killing_on_timeout(args, self.env, output, timeout)
        if code is None and not expect_timeout:
            raise StageFailed(f"{name}: no result within {timeout:.0f} s (log {log})", "timeout")
        if code not in (None, 0):
            raise StageFailed(f"{name}: exit code {code}; {tail(log)}")


def run_killing_on_timeout(args: list[str], env: dict[str, str], output, timeout: float) -> int | None:
    """The exit code, or None when the time ran out and the command was killed with all it started."""
    process = subprocess.Popen(args, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        return process.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        kill_session(process)
        return None
    finally:
        sweep(env[MARKER])  # a launcher's ranks live in sessions of their own


def kill_session(process: subprocess.Popen) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def marked_processes(token: str) -> list[int]:
    """Processes whose environment holds this run's marker (a process that cannot be read is not ours)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def sweep(token: str, wait_s: float = 10.0) -> None:
    """Kill whatever a stage left running, and wait until it is gone: the next stage needs the GPU's memory."""
    deadline = time.monotonic() + wait_s
    while (left := marked_processes(token)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def tail(log: Path, lines: int = 5) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return "last lines: " + " | ".join(line.strip() for line in text[-lines:])


# ---- stages -------------------------------------------------------------------------------------------------


def read_pins(path: Path) -> dict[str, tuple[str, bool]]:
    """{normalised name: (version, optional)} from `name==version` lines (launch/gpu-wheels.txt)."""
    pins = {}
    for line in path.read_text().splitlines():
        pin, _, comment = line.partition("#")
        if pin.strip():
            name, _, version = pin.strip().partition("==")
            pins[normalise(name)] = (version, "optional" in comment)
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pinned_wheels(wheels: Path, pins: dict[str, tuple[str, bool]]) -> tuple[list[Path], list[str]]:
    """The folder's wheel for each pin, and the optional pins that have none; raises StageFailed for a required
    pin without its wheel (a wheel of another version does not count)."""
    found = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        found[(normalise(name), version)] = wheel
    chosen, missing, absent_optional = [], [], []
    for name, (version, optional) in pins.items():
        wheel = found.get((name, version))
        if wheel is not None:
            chosen.append(wheel)
        else:
            (absent_optional if optional else missing).append(f"{name}=={version}")
    if missing:
        raise StageFailed(f"install: {wheels} lacks the pinned wheels {', '.join(missing)}")
    return chosen, absent_optional


def install(run: Run) -> dict:
    figures: dict = {}
    if run.wheels.is_dir() or not run.dry_run:
        if not run.wheels.is_dir():
            raise StageFailed(f"install: no wheels folder {run.wheels} (carry it: docs/doctor.md, 'The first GPU')")
        wheels, absent = pinned_wheels(run.wheels, read_pins(run.pins))
        # --upgrade: a warm machine keeps ignored folders between calls, and --target keeps what is already there
        args = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target",
                str(run.site), *map(str, wheels)]  # fmt: skip
        run.command("install", args, min(120.0, run.remaining()))
        figures = {"wheels": [wheel.name for wheel in wheels], "megabytes": sum(w.stat().st_size for w in wheels) / 1e6,
                   "optional_absent": absent}  # fmt: skip
    probe = "import deepspeed, pydantic, psutil, xxhash, zstandard; print(deepspeed.__version__)"
    run.command("install", [sys.executable, "-c", probe], min(120.0, run.remaining()))
    return {**figures, "deepspeed": last_line(run.logs / "install.log")}


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


def doctor(run: Run) -> dict:
    report = run.out / "doctor-report.json"
    args = [sys.executable, "-m", "ntl_pretrain.cli", "doctor", "--out", str(report)]
    args += ["--quick", "--skip", "speed", "train"] if run.dry_run else []
    failure = None
    try:
        run.command("doctor", args, min(240.0, run.remaining()))
    except StageFailed as error:  # a failed check exits 1: its rows are the figures, the failure the status
        failure = error
    figures = doctor_rows(report)
    if failure is not None:
        raise StageFailed(str(failure), failure.status, figures)
    return figures


def doctor_rows(report: Path) -> dict:
    if not report.is_file():
        return {}
    checks = json.loads(report.read_text())["checks"]
    return {check["name"]: f"{check['status']}: {check['figure']}" for check in checks}


def heads(run: Run, name: str = "heads", vocab: int | None = None) -> dict:
    """bench/gpu_heads.py's report: heads.json in $OUT, another width's into logs.tgz ($OUT holds at most 8 files)."""
    out = (run.out if vocab is None else run.logs) / f"{name.replace('_', '-')}.json"
    # the dry run's Triton rows run in Triton's interpreter (`environment`): a few rows of the smallest vocabulary,
    # and only CE's kernels compiled offline for one architecture (each kernel costs seconds on CPU)
    sizes = ["--positions", "16", "--vocab", "2200", "--hidden", "16", "--device", "cpu", "--kernel-kinds", "None",
             "--kernel-archs", "sm_90"] if run.dry_run else []  # fmt: skip
    if vocab is not None:  # a width 16 does not divide: the dry run's is one too
        sizes += ["--vocab", str(DRY_RAGGED_VOCAB if run.dry_run else vocab)]
    run.command(name, [sys.executable, "bench/gpu_heads.py", "--out", str(out), *sizes], min(150.0, run.remaining()))
    report = json.loads(out.read_text())
    ratios = {f"{part}: {name}": ratio_text(m) for part in ("loss", "head") for name, m in report[part].items()}
    agreement = {f"triton vs torch, {kind}": f"{difference:.1e}" for kind, difference in report["agreement"].items()}
    targets = {f"target {name}": f"{target['ratio']:.2f}x (at most {target['at_most']}x)"
               for name, target in report["targets"].items()}  # fmt: skip
    return {"shape": report["shape"], "liger": report["liger"], "triton": report["triton"], **agreement, **ratios,
            **targets, "kernels": kernels_text(report["kernels"])}  # fmt: skip


def heads_50257(run: Run) -> dict:
    """The heads stage at GPT-2's vocabulary (50,257: rows off 16-byte boundaries, issue 70)."""
    return heads(run, "heads_50257", vocab=50_257)


def kernel_sweep(run: Run) -> dict:
    """bench/gpu_heads.py --sweep: the training loss's CE-only and WAS rows at each row block and warp count, in ms,
    and Liger's CE on the same logits (the report into logs.tgz: $OUT holds at most 8 files)."""
    out = run.logs / "kernel-sweep.json"
    # the dry run interprets 24 configurations' kernels: 8 positions (the fewest the labels' draw takes) halve it
    sizes = ["--positions", "8", "--vocab", str(DRY_RAGGED_VOCAB), "--hidden", "16", "--device", "cpu"] \
        if run.dry_run else []  # fmt: skip
    run.command("kernel_sweep", [sys.executable, "bench/gpu_heads.py", "--sweep", "--out", str(out), *sizes],
                min(180.0, run.remaining()))  # fmt: skip
    report = json.loads(out.read_text())
    rows = {config: ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in times.items())
            for config, times in report["sweep"].items()}  # fmt: skip
    liger = report["liger_seconds"]
    return {"shape": report["shape"], "liger CE": report["liger"] if liger is None else f"{liger * 1e3:.3f} ms", **rows}


def kernels_text(kernels: dict) -> str:
    """Our Triton kernels' registers and spills in a line (the full table is in heads.json)."""
    if "left_out" in kernels:
        return f"left out: {kernels['left_out']}"
    entries = kernels["kernels"]
    archs = sorted({entry["arch"] for entry in entries})
    most = max(entry["registers"] for entry in entries)
    return f"{len(entries)} compiled ({', '.join(archs)}), {kernels['spilling']} spilling, at most {most} registers"


def head_step(run: Run) -> dict:
    """The plain step of the 135M model with each head (bench/head_step.py; its report into logs.tgz)."""
    out = run.logs / "head-step.json"
    toy = [key.removeprefix("model.config.") for key in MODEL_TOY if key.startswith("model.config.")]
    sizes = ["--device", "cpu", "--steps", "2", "--warmup", "1", *toy, "vocab_size=4096", "seq_len=32",
             "micro_batch_size=2"] if run.dry_run else []  # fmt: skip
    run.command("head_step", [sys.executable, "bench/head_step.py", "--out", str(out), *sizes],
                min(120.0, run.remaining()))  # fmt: skip
    report = json.loads(out.read_text())
    heads = {name: f"{m['step_seconds'] * 1e3:.1f} ms, {m['over_transformers']:.2f}x" for name, m in
             report["heads"].items()}  # fmt: skip
    return {"triton": report["triton"], **heads}


def ratio_text(measured: dict) -> str:
    memory = "" if measured["memory_ratio"] is None else f", memory {measured['memory_ratio']:.2f}x"
    ops = f", {measured['host_ops']} host ops, {measured['triton_launches']} Triton launches"
    return f"{measured['seconds'] * 1e3:.2f} ms, time {measured['time_ratio']:.2f}x{memory}{ops}"


def train_overrides(run: Run, output_dir: Path, model: list[str] = MODEL_125M, micro_batch: int = 8) -> list[str]:
    """The GPU run's overrides; the dry run's are the same with toy sizes, CPU and fp32 after them (the last one
    wins), so that a key the GPU run sets is validated here too."""
    gpu = [f"train.output_dir={output_dir}", "train.resume=null", "train.eval_every_steps=null",
           "eval.every_steps=null", "checkpoint.every_steps=null", "logging.progress_bar=false", "logging.wandb=false",
           "schedule.warmup_steps=10", *model, "data.seq_len=2048", "data.num_workers=2",
           f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}", "train.max_steps=30",
           "train.device=cuda", "train.precision=bf16", "logging.profile_steps=[20,3]"]  # fmt: skip
    return [*gpu, *MODEL_TOY] if run.dry_run else gpu


def train_125m(run: Run) -> dict:
    output_dir = run.work / "train-125m"
    args = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "1",
            *train_overrides(run, output_dir)]  # fmt: skip
    run.command("train_125m", args, min(180.0, run.remaining()))
    (run.out / "train-125m-metrics.jsonl").write_bytes((output_dir / "metrics.jsonl").read_bytes())
    figures = trained_figures(run, output_dir, "train-125m")
    return {**figures, **over_plain(run, figures, ("plain_step", "plain_compiled"))}  # where they ran first


def train_125m_persistent(run: Run) -> dict:
    """The same run, 30 steps, with ZeRO-3 keeping every matrix of the 135M model gathered (a persistence threshold
    above the largest, 28M elements) and plain linear layers (`memory_efficient_linear: false`): what is left of
    the step when ZeRO-3 gathers and releases nothing (its hooks still run). Against train_125m's step: how much of
    the 3.4% MFU of the first run is the per-module gather and release."""
    output_dir, config = run.work / "train-125m-persistent", run.work / "zero3-persistent.json"
    tuned = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    tuned["zero_optimization"].update(stage3_param_persistence_threshold=10**8, memory_efficient_linear=False)
    config.write_text(json.dumps(tuned, indent=1))
    overrides = [*train_overrides(run, output_dir), f"deepspeed.config={config}"]
    args = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "1", *overrides]
    run.command("train_125m_persistent", args, min(120.0, run.remaining()))
    figures = trained_figures(run, output_dir, "train-125m-persistent")
    first = stage_figure(run, "train_125m", "step_seconds")
    ratio = first / figures["step_seconds"] if first and figures["step_seconds"] else None
    return {**figures, "train_125m_step_over_this": ratio}


def stage_figure(run: Run, stage: str, key: str):
    """A figure an earlier stage of this run measured; None when it did not run or measure it."""
    return next((done["figures"].get(key) for done in run.stages if done["name"] == stage), None)


def trained_figures(run: Run, output_dir: Path, name: str) -> dict:
    """A stage's run: step medians, and its profile (the table and figures also into logs.tgz)."""
    metrics = output_dir / "metrics.jsonl"
    figures = step_figures([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()])
    profiled = sorted((output_dir / "profile").glob("steps-*"))  # torch.profiler's table and per-step figures
    for path in profiled:
        (run.logs / f"{name}-profile-{path.name}").write_bytes(path.read_bytes())
    summaries = [json.loads(path.read_text()) for path in profiled if path.suffix == ".json"]
    return {**figures, "profile": summaries[0] if summaries else None}


def step_figures(records: list[dict]) -> dict:
    """Medians over the steps after the first tenth (compilation, allocator and loader warm-up)."""
    steps = [record for record in records if "loss" in record and record.get("split") is None]
    later = steps[len(steps) // 10 :]
    median = lambda key: statistics.median(r[key] for r in later) if all(r.get(key) is not None for r in later) \
        else None  # noqa: E731  # fmt: skip
    return {"steps": len(steps), "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
            "step_seconds": median("step_seconds"), "data_seconds": median("data_seconds"),
            "peak_mem_mib": max(r["peak_mem_mib"] for r in steps), "loss_first_last": [steps[0]["loss"],
            steps[-1]["loss"]]}  # fmt: skip


def plain_step(run: Run) -> dict:
    """The same model and batch as train_125m without DeepSpeed (bench/plain_step.py), and our step's time over its."""
    figures = plain_figures(run, "plain_step", run.out / "plain-step.json", min(90.0, run.remaining()))
    ours = stage_figure(run, "train_125m", "step_seconds")
    return {**figures, "ours_over_plain": None if not ours else ours / figures["step_seconds"]}


def plain_compiled(run: Run) -> dict:
    """The plain step under torch.compile (its report into logs.tgz: $OUT holds at most 8 files)."""
    return plain_figures(run, "plain_compiled", run.logs / "plain-compiled.json", min(240.0, run.remaining()),
                         ["--compile"])  # fmt: skip


def plain_figures(run: Run, name: str, out: Path, timeout: float, extra: tuple[str, ...] = (),
                  model: list[str] = MODEL_125M, micro_batch: int = 8) -> dict:  # fmt: skip
    toy = [key for key in MODEL_TOY if key.startswith("model.config.")]
    keys = [key.removeprefix("model.config.") for key in (toy if run.dry_run else model)]
    keys += ["seq_len=64", "micro_batch_size=2"] if run.dry_run else ["seq_len=2048", f"micro_batch_size={micro_batch}"]
    device = ["--device", "cpu", "--steps", "3", "--warmup", "1"] if run.dry_run else []
    run.command(name, [sys.executable, "bench/plain_step.py", "--out", str(out), *device, *extra, *keys], timeout)
    report = json.loads(out.read_text())
    measured = ("step_seconds", "tokens_per_s", "mfu", "peak_mem_mib", "first_step_seconds", "matmul_flops",
                "mfu_of_matmul")  # fmt: skip
    return {key: report[key] for key in measured if key in report}


def train_125m_zero2(run: Run) -> dict:
    """train_125m at ZeRO stage 2 (the doctor's and docs/recipes.md's choice for a model that fits one device)."""
    return train_125m_variant(run, "train_125m_zero2", ["deepspeed.zero_stage=2"], steps=30)


def train_125m_compiled(run: Run) -> dict:
    """train_125m_zero2 with each decoder layer compiled (`train.compile`; its first step compiles)."""
    return train_125m_variant(run, "train_125m_compiled", ["deepspeed.zero_stage=2", "train.compile=true"], steps=40)


def train_125m_variant(run: Run, name: str, overrides: list[str], steps: int) -> dict:
    """`steps` steps of train_125m with `overrides`, profiled at steps 20-22; its step over the plain step's and
    over the compiled plain step's (issue 47's targets: 1.3x and 1.2x)."""
    output_dir = run.work / name.replace("_", "-")
    settings = [*train_overrides(run, output_dir), *overrides]
    settings += [] if run.dry_run else [f"train.max_steps={steps}"]
    args = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "1", *settings]
    run.command(name, args, min(240.0, run.remaining()))
    figures = trained_figures(run, output_dir, name.replace("_", "-"))
    return {**figures, **over_plain(run, figures, ("plain_step", "plain_compiled"))}


def plain_1b(run: Run) -> dict:
    """The plain step of the 1B model, and this GPU's bf16 matmul rate, which the 1B stages' MFU is held against
    (its report into logs.tgz)."""
    return plain_figures(run, "plain_1b", run.logs / "plain-1b.json", min(120.0, run.remaining()), ["--matmul-rate"],
                         MODEL_1B, BATCH_1B)  # fmt: skip


def plain_1b_compiled(run: Run) -> dict:
    """The plain step of the 1B model under torch.compile, and the step of each of ours that ran before it over
    this one (issue56 runs it last: it compiles longest and answers no target)."""
    out = run.logs / "plain-1b-compiled.json"
    figures = plain_figures(run, "plain_1b_compiled", out, min(200.0, run.remaining()), ["--compile", "--matmul-rate"],
                            MODEL_1B, BATCH_1B)  # fmt: skip
    over = {}
    for ours in ("train_1b_zero2", "train_1b", "train_1b_compiled"):
        seconds = stage_figure(run, ours, "step_seconds")
        over[f"{ours}_over_this"] = seconds / figures["step_seconds"] if seconds else None
    return {**figures, **over}


def train_1b_zero2(run: Run) -> dict:
    return train_1b_variant(run, "train_1b_zero2", ["deepspeed.zero_stage=2"], steps=12)


def train_1b(run: Run) -> dict:
    """The 1B model at ZeRO-3, the recipes' default stage (gathering a layer at a time)."""
    return train_1b_variant(run, "train_1b", [], steps=12)


def train_1b_compiled(run: Run) -> dict:
    return train_1b_variant(run, "train_1b_compiled", ["deepspeed.zero_stage=2", "train.compile=true"], steps=16)


def train_1b_variant(run: Run, name: str, overrides: list[str], steps: int) -> dict:
    """`steps` steps of ours on the 1B model (unprofiled: its start-up is most of the stage already); MFU of the
    matmul rate plain_1b measured (the datasheet's where it did not run), and the step over the plain steps'."""
    output_dir = run.work / name.replace("_", "-")
    matmul = stage_figure(run, "plain_1b", "matmul_flops")
    settings = [*train_overrides(run, output_dir, MODEL_1B, BATCH_1B), *overrides, "logging.profile_steps=null"]
    # the dry run's toy gets a toy vocabulary too: 128,256 columns take minutes on 2 CPU cores
    settings += ["model.config.vocab_size=4096"] if run.dry_run else [f"train.max_steps={steps}"]
    settings += [] if matmul is None else [f"logging.peak_flops_per_device={matmul:.6e}"]
    args = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "1", *settings]
    run.command(name, args, min(200.0, run.remaining()))
    figures = trained_figures(run, output_dir, name.replace("_", "-"))
    figures["mfu_of"] = "datasheet peak" if matmul is None else f"measured matmul rate {matmul / 1e12:.4g} TFLOP/s"
    return {**figures, **over_plain(run, figures, ("plain_1b", "plain_1b_compiled"))}


def deepcompile_build(run: Run) -> dict:
    """DeepSpeed's DeepCompile op built here (its report into logs.tgz); on the GPU a failed build fails the stage and
    the DeepCompile stages after it are skipped; the dry run records the CPU's failure."""
    out = run.logs / "deepcompile-build.json"
    run.command("deepcompile_build", [sys.executable, "bench/deepcompile_build.py", "--out", str(out)],
                min(240.0, run.remaining()))  # fmt: skip
    figures = json.loads(out.read_text())
    if not figures["built"] and not run.dry_run:
        raise StageFailed(f"deepcompile_build: {figures['error']}", figures=figures)
    return figures


def deepcompile_variant(run: Run, name: str, settings: list[str], timeout: float) -> dict:
    """`ntl-pretrain train` with `settings` (which hold `train.compile=true` at ZeRO-3): skipped where DeepCompile's op
    did not build; in the dry run the one-line refusal on CPU is the figure (exit code 2)."""
    if stage_figure(run, "deepcompile_build", "built") is False and not run.dry_run:
        raise StageFailed(f"{name}: DeepCompile's op did not build here (deepcompile_build)", "skipped")
    args = [sys.executable, "-m", "ntl_pretrain.cli", "train", "recipes/tiny-cpu.yaml", "--nproc", "1", *settings]
    try:
        run.command(name, args, min(timeout, run.remaining()))
    except StageFailed as error:
        refusal = last_line(run.logs / f"{name}.log")
        if not (run.dry_run and "exit code 2" in str(error) and "recipe error" in refusal and "DeepCompile" in refusal):
            raise
        return {"refused_on_cpu": refusal}
    if run.dry_run:
        raise StageFailed(f"{name}: trained on CPU, where DeepCompile should have been refused before launch")
    return {}


def logged(output_dir: Path, key: str, split: str | None = None) -> dict[int, float]:
    """{step: the run's `key`} from its metrics.jsonl: training steps' (`split` None) or an evaluation's."""
    metrics = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() \
        else []  # fmt: skip
    return {r["step"]: r[key] for r in records if key in r and r.get("split") == split}


def largest_difference(these: dict[int, float], those: dict[int, float]) -> float | None:
    common = sorted(set(these) & set(those))
    return max(abs(these[step] - those[step]) for step in common) if common else None


def train_125m_deepcompile(run: Run) -> dict:
    """train_125m with DeepCompile (steps 20-22 profiled): over the plain steps, and its losses against train_125m's
    (the same seed and batches, eager ZeRO-3)."""
    settings = [*train_overrides(run, run.work / "train-125m-deepcompile"), "train.compile=true"]
    return against_eager(run, "train_125m_deepcompile", settings, "train_125m", ("plain_step", "plain_compiled"))


def train_1b_deepcompile(run: Run) -> dict:
    """train_1b with DeepCompile, 16 steps: MFU against the measured matmul rate, over the plain steps, losses against
    train_1b's."""
    matmul = stage_figure(run, "plain_1b", "matmul_flops")
    settings = [*train_overrides(run, run.work / "train-1b-deepcompile", MODEL_1B, BATCH_1B), "train.compile=true",
                "logging.profile_steps=null", *([] if run.dry_run else ["train.max_steps=16"])]  # fmt: skip
    settings += [] if matmul is None else [f"logging.peak_flops_per_device={matmul:.6e}"]
    return against_eager(run, "train_1b_deepcompile", settings, "train_1b", ("plain_1b", "plain_1b_compiled"))


def against_eager(run: Run, name: str, settings: list[str], eager: str, plains: tuple[str, ...]) -> dict:
    """`name`'s run (`deepcompile_variant`), its figures over the plain stages' steps and the largest difference of
    a step's loss from the eager ZeRO-3 stage's."""
    refused = deepcompile_variant(run, name, settings, 240.0)
    if refused:
        return refused
    output_dir = run.work / name.replace("_", "-")
    figures = trained_figures(run, output_dir, name.replace("_", "-"))
    loss = largest_difference(logged(output_dir, "loss"), logged(run.work / eager.replace("_", "-"), "loss"))
    return {**figures, **over_plain(run, figures, plains), "loss_vs_eager_zero3": loss}


def deepcompile_resume(run: Run) -> dict:
    """12 steps with DeepCompile saved and validated every 6 (validation runs the compiled engine without gradients),
    then the same command resumed from step 6 into a copy of the folder: the largest difference of the resumed steps'
    losses from the uninterrupted run's, and the validation losses of both."""
    whole, resumed = run.work / "deepcompile-whole", run.work / "deepcompile-resumed"
    settings = lambda folder: [*train_overrides(run, folder), "train.compile=true", "train.max_steps=12",  # noqa: E731
                               "checkpoint.every_steps=6", "train.eval_every_steps=6", "train.eval_max_batches=2",
                               "logging.profile_steps=null"]  # fmt: skip
    refused = deepcompile_variant(run, "deepcompile_resume", settings(whole), 200.0)
    if refused:
        return refused
    shutil.copytree(whole / "checkpoints" / "step_6", resumed / "checkpoints" / "step_6")
    deepcompile_variant(run, "deepcompile_resume", [*settings(resumed), "train.resume=auto"], 200.0)
    after = logged(resumed, "loss")
    validated = {name: logged(folder, "val_loss", "validation") for name, folder in (("uninterrupted", whole),
                                                                                     ("resumed", resumed))}  # fmt: skip
    return {"resumed_steps": sorted(after), "loss_vs_uninterrupted": largest_difference(after, logged(whole, "loss")),
            "val_loss": validated}  # fmt: skip


def over_plain(run: Run, figures: dict, plains: tuple[str, ...]) -> dict:
    """`ours_over_<plain>`: this stage's step over each plain stage's (None where either is missing)."""
    over = {}
    for plain in plains:
        seconds = stage_figure(run, plain, "step_seconds")
        measured = seconds and figures["step_seconds"]
        over[f"ours_over_{plain}"] = figures["step_seconds"] / seconds if measured else None
    return over


def study_plan(run: Run) -> list[str]:
    """The protocol's command without its report arguments (the probe never reaches the report)."""
    runs_dir, archive = run.work / "study-v6-gpu", run.logs / "study-v6-gpu-runs"
    seeds = [str(STUDY_SEEDS[0])] if run.dry_run else [str(seed) for seed in STUDY_SEEDS]
    toy = ["train.max_steps=3", "train.eval_every_steps=null", "eval.every_steps=null"] if run.dry_run else []
    return ["--recipes", str(STUDY_RECIPES), "--variants", *STUDY_VARIANTS, "--seeds", *seeds, "--runs-dir",
            str(runs_dir), "--archive", str(archive), *report_in(run.logs / "study-v6-gpu"), *toy]  # fmt: skip


def report_in(stem: Path) -> list[str]:
    """Where a study stage's report goes when its runs all finish: its logs, never the checkout's docs/study.md."""
    return ["--doc", f"{stem}.md", "--plot", f"{stem}.png"]


def study_probe(run: Run) -> dict:
    probe_s = min(PROBE_S["dry" if run.dry_run else "gpu"], run.remaining() - 15.0)
    study = [sys.executable, "-m", "ntl_pretrain.cli", "study"]
    placement = ["--jobs", "2", "--device", "cpu"] if run.dry_run else ["--jobs", "8", "--device", "cuda"]
    started = time.monotonic()
    run.command("study_probe", [*study, *study_plan(run), *placement], probe_s, expect_timeout=True)
    minutes = (time.monotonic() - started) / 60
    run.command("study_probe", [*study, *study_plan(run), "--status"], min(60.0, run.remaining()))
    return throughput(last_line(run.logs / "study_probe.log"), minutes)


def study_v7_gpu(run: Run) -> dict:
    runs_dir, archive = run.work / "study-v7-gpu", run.logs / "study-v7-gpu-runs"
    # The dry run: one seed of one pair, 3 steps, 10 questions (tests/test_regression_recipes.py loads every recipe)
    variants, seeds = (V7_GPU_VARIANTS[:2], V7_GPU_SEEDS[:1]) if run.dry_run else (V7_GPU_VARIANTS, V7_GPU_SEEDS)
    toy = ["--max-examples", "10", "train.max_steps=3", "train.eval_every_steps=null", "eval.every_steps=null"]
    plan = ["--recipes", str(V7_GPU_RECIPES), "--variants", *variants, "--seeds", *map(str, seeds), "--runs-dir",
            str(runs_dir), "--archive", str(archive), *report_in(run.logs / "study-v7-gpu"),
            *(toy if run.dry_run else [])]  # fmt: skip
    placement = ["--jobs", "2", "--device", "cpu"] if run.dry_run else ["--jobs", str(V7_GPU_JOBS), "--device", "cuda"]
    study = [sys.executable, "-m", "ntl_pretrain.cli", "study", *plan]
    started = time.monotonic()
    run.command("study_v7_gpu", [*study, *placement], run.remaining() - 30.0, expect_timeout=True)
    minutes = (time.monotonic() - started) / 60
    run.command("study_v7_gpu", [*study, "--status"], min(25.0, run.remaining()))
    figures = throughput(last_line(run.logs / "study_v7_gpu.log"), minutes, arms=len(variants))
    return figures | {"seeds_complete": complete_seeds(archive, len(variants))}


def complete_seeds(archive: Path, arms: int) -> list[int]:
    """The seeds of which every arm's run is archived (`<variant>-seed<S>/study.json`): the paired ones."""
    found: dict[int, int] = {}
    for done in archive.glob("*-seed*/study.json"):
        seed = int(done.parent.name.rpartition("-seed")[2])
        found[seed] = found.get(seed, 0) + 1
    return sorted(seed for seed, count in found.items() if count == arms)


STATUS = re.compile(r"all: (\d+) of (\d+) planned runs done.*have trained ([\d.]+) runs' worth of steps")


def throughput(status_line: str, minutes: float, arms: int = 8) -> dict:
    """r = (finished runs + the fraction of max_steps every unfinished run reached) / minutes, and the protocol's
    minutes for all planned runs and per seed of its `arms` arms (arms / r)."""
    found = STATUS.search(status_line)
    if found is None:
        raise StageFailed(f"study_probe: no progress line in `study --status`: {status_line!r}")
    done, planned, partial = int(found[1]), int(found[2]), float(found[3])
    r = (done + partial) / minutes
    per_run = (1 / r) if r > 0 else None
    return {"minutes": minutes, "runs_done": done, "runs_planned": planned, "unfinished_progress": partial,
            "r_runs_per_minute": r, "minutes_for_all": None if per_run is None else planned * per_run,
            "minutes_per_seed": None if per_run is None else arms * per_run}  # fmt: skip


STAGES: dict[str, Callable[[Run], dict]] = {"install": install, "doctor": doctor, "heads": heads,
                                            "heads_50257": heads_50257, "kernel_sweep": kernel_sweep,
                                            "head_step": head_step, "train_125m": train_125m, "plain_step": plain_step,
                                            "plain_compiled": plain_compiled, "train_125m_zero2": train_125m_zero2,
                                            "train_125m_compiled": train_125m_compiled,
                                            "train_125m_persistent": train_125m_persistent,
                                            "study_probe": study_probe, "study_v7_gpu": study_v7_gpu,
                                            "plain_1b": plain_1b,
                                            "train_1b_zero2": train_1b_zero2, "train_1b": train_1b,
                                            "train_1b_compiled": train_1b_compiled,
                                            "plain_1b_compiled": plain_1b_compiled,
                                            "deepcompile_build": deepcompile_build,
                                            "train_125m_deepcompile": train_125m_deepcompile,
                                            "train_1b_deepcompile": train_1b_deepcompile,
                                            "deepcompile_resume": deepcompile_resume}  # fmt: skip
# Issue 56's stages in the order of what they answer first (docs/doctor.md, "The first GPU": about 550 s in all).
# The 135M compiled plain step is left out (82 s; our code does not change it): its 77 ms of 2026-11-28 (H200) stands.
# Issue 70's, after issue 56's call (about 250 s): the loss against Liger's CE at Llama-3's and GPT-2's widths (its
# targets in heads' report), then the kernels' row block / warps sweep.
# Issue 73's: whether DeepCompile builds here first (a failed build skips its stages), then ZeRO-3 eager and with
# DeepCompile at 135M beside the plain step, the same at 1B, its resume, and the compiled plain steps last (82 s and
# ~150 s of compiling: the 135M one's 77 ms of 2026-11-28 stands where it is cut).
GROUPS = {"issue56": ["install", "plain_step", "train_125m_zero2", "plain_1b", "train_1b_zero2", "train_125m_compiled",
                      "train_1b_compiled", "train_1b", "train_125m", "plain_1b_compiled"],
          "issue70": ["install", "heads", "heads_50257", "kernel_sweep"],
          "issue73": ["install", "deepcompile_build", "plain_step", "train_125m", "train_125m_deepcompile", "plain_1b",
                      "train_1b", "train_1b_deepcompile", "deepcompile_resume", "plain_compiled",
                      "plain_1b_compiled"]}  # fmt: skip


# ---- the run ------------------------------------------------------------------------------------------------


def run_stage(run: Run, name: str, stage: Callable[[Run], dict]) -> dict:
    started = time.monotonic()
    if run.remaining() < MIN_STAGE_S:
        return {"name": name, "status": "skipped", "seconds": 0.0, "why": f"{run.remaining():.0f} s of the budget left"}
    try:
        figures, status, why = stage(run), "ok", None
    except StageFailed as error:
        figures, status, why = error.figures, error.status, str(error)
    except Exception as error:  # noqa: BLE001 - a stage's bug is its row; the next stage still runs
        figures, status, why = {}, "failed", f"{type(error).__name__}: {error}"
    result = {"name": name, "status": status, "seconds": round(time.monotonic() - started, 1), "figures": figures}
    return result if why is None else {**result, "why": why}


def write_summary(run: Run, started: float) -> None:
    done = {stage["name"] for stage in run.stages}
    pending = [{"name": name, "status": "pending"} for name in run.planned if name not in done]
    summary = {"dry_run": run.dry_run, "elapsed_s": round(time.monotonic() - started, 1),
               "marker": f"{MARKER}={run.env[MARKER]}", "stages": [*run.stages, *pending]}  # fmt: skip
    (run.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (run.out / "summary.md").write_text(markdown(summary))
    pack_logs(run)


def pack_logs(run: Run) -> None:
    """The stage logs and the study probe's archived runs as one file, `logs.tgz`: the device tool returns at most
    8 files from $OUT, none deeper than two folders."""
    if run.logs.is_dir():
        partial = run.out / "logs.tgz.partial"
        with tarfile.open(partial, "w:gz") as archive:
            archive.add(run.logs, arcname="logs")
        partial.replace(run.out / "logs.tgz")


def markdown(summary: dict) -> str:
    lines = [f"# First GPU run{' (dry run, CPU)' if summary['dry_run'] else ''}: {summary['elapsed_s']} s", "",
             "| stage | status | seconds | figures |", "|---|---|---|---|"]  # fmt: skip
    for stage in summary["stages"]:
        figures = "; ".join(f"{key}: {value}" for key, value in stage.get("figures", {}).items())
        why = f" ({stage['why']})" if "why" in stage else ""
        lines.append(f"| {stage['name']} | {stage['status']}{why} | {stage.get('seconds', '')} | {figures} |")
    return "\n".join(lines) + "\n"


def environment(run_site: Path, dry_run: bool, token: str) -> dict[str, str]:
    """The stages' environment: the installed wheels first, then this checkout; offline (no network there)."""
    env = dict(os.environ)
    if dry_run:  # the compiled stages' commands run, uncompiled: inductor takes minutes on CPU (test_train_compile.py)
        env["TORCH_COMPILE_DISABLE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(run_site), str(REPO), env.get("PYTHONPATH")) if p)
    env["PATH"] = f"{run_site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update({MARKER: token, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"})
    if dry_run:  # Triton's interpreter runs the loss's Triton kernels on CPU: the heads stage times them too
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
                   TRITON_INTERPRET="1")  # fmt: skip
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on CPU at toy sizes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out/gpu-first-run"))
    work_help = "the runs, logs and installed wheels (default: a new temporary folder: a warm machine starts clean)"
    parser.add_argument("--work", type=Path, help=work_help)
    parser.add_argument("--wheels", type=Path, default=REPO / "wheels-gpu")
    parser.add_argument("--pins", type=Path, default=REPO / "launch" / "gpu-wheels.txt")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all stages (default 8 minutes)")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    chosen.add_argument("--group", choices=list(GROUPS), help="a named list of stages (issue56, -70, -73: theirs)")
    args = parser.parse_args(argv)
    if args.group:
        args.stages = GROUPS[args.group]
    out = args.out.resolve()
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu-first-run-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    token = uuid.uuid4().hex
    run = Run(out, work, args.dry_run, args.wheels, args.pins, started + args.budget,
              environment(work / "site-packages", args.dry_run, token), args.stages)  # fmt: skip
    write_summary(run, started)
    for name in args.stages:
        print(f"gpu_first_run: {name} ({run.remaining():.0f} s of the budget left)", flush=True)
        run.stages.append(run_stage(run, name, STAGES[name]))
        write_summary(run, started)
        print(f"gpu_first_run: {name}: {run.stages[-1]['status']} in {run.stages[-1]['seconds']} s", flush=True)
    print((out / "summary.md").read_text(), flush=True)
    return 0 if all(stage["status"] == "ok" for stage in run.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
