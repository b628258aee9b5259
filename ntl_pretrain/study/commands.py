"""`ntl-pretrain study`: train CE, CE+NTL-WAS and CE+NTL-MSE from scratch over several seeds, evaluate, report.

A variant is a recipe path relative to `--recipes` without `.yaml`; one in a subfolder (`3digit/ntl-was`) is an
axis of the study (another tokenizer, say) and is compared with the `ce` recipe of its own folder (`3digit/ce`).
Every (variant, seed) run is `ntl-pretrain train <recipes>/<variant>.yaml --nproc 1 seed=S` followed by
`ntl-pretrain eval <run> --log-metrics`, each in its own process; `--jobs` runs that many at once, on CPU splitting
the CPU threads between them, on a GPU (`--device cuda`) all on the one device. A run whose `study.json` exists
(or whose copy in `--archive` is complete: study/archive.py) is finished and is not repeated, so an interrupted
study continues where it stopped, also in a fresh clone. Every recipe is loaded with the overrides before any run
folder is touched. The report (study/report.py: mean ± std over seeds, paired statistics of each NTL variant
against its CE baseline, the protocol's verdicts with `--decide`, per-run figures, a plot, `runs.csv`) is written
from whatever the runs measured; with `--protocol` only once every planned run is finished.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.errors import InputError, check_can_write
from ntl_pretrain.outputs import SIGNATURE, check_output, starts_with
from ntl_pretrain.runtime.run_lock import check_free
from ntl_pretrain.study.archive import archive_run
from ntl_pretrain.study.arguments import EXIT_UNFINISHED
from ntl_pretrain.study.decision import RULES
from ntl_pretrain.study.provenance import code_version, unclean_warning
from ntl_pretrain.study.report import write_report
from ntl_pretrain.study.runs import StudyRun, plan


def run_commands(run: StudyRun, overrides: list[str], eval_args: list[str]) -> tuple[list[str], list[str]]:
    """The run's training command (one process: `--nproc 1`), then its evaluation of the final checkpoint."""
    train = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(run.recipe), "--nproc", "1",
             *run_overrides(run, overrides)]  # fmt: skip
    evaluate = [sys.executable, "-m", "ntl_pretrain.evaluation", str(run.run_dir), "--log-metrics",
                "--out", str(run.run_dir / "eval.json"), "--answers", str(run.run_dir / "answers.jsonl"),
                *eval_args]  # fmt: skip
    return train, evaluate


def run_overrides(run: StudyRun, overrides: list[str]) -> list[str]:
    return [f"seed={run.seed}", f"train.output_dir={run.run_dir}", *overrides]


def resolve_device(requested: str, recipe_devices: set[str], cuda_available: bool) -> str:
    """`auto`: cuda where a GPU is visible and no recipe is forced to cpu (`train.device: cpu`), else cpu."""
    if requested == "cuda" and not cuda_available:
        raise RecipeError("--device cuda: no CUDA GPU is visible on this machine")
    if requested == "cuda" and "cpu" in recipe_devices:
        raise RecipeError("--device cuda: a variant's recipe has train.device: cpu")
    if requested == "auto":
        return "cuda" if cuda_available and "cpu" not in recipe_devices else "cpu"
    return requested


def placement(device: str, jobs: int, environ: dict[str, str], cpu_count: int) -> tuple[list[str], dict[str, str]]:
    """(recipe overrides, environment) of every run's processes. CPU: cpu_count/jobs threads each, on DeepSpeed's
    CPU accelerator with any GPU hidden (training and evaluation alike; what the trainer chooses by itself on a
    machine without a GPU). CUDA: all `jobs` runs on the one visible device, so the GPU is never hidden and DeepSpeed
    is never told to use its CPU accelerator; `train.device=cuda` makes a run without a GPU fail instead of training
    on CPU. Each run still gets its share of the CPU threads (data loading, the host side of each step)."""
    env = {**environ, "OMP_NUM_THREADS": str(max(1, cpu_count // jobs))}
    if device == "cpu":
        return [], env | {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    if env.get("DS_ACCELERATOR") == "cpu":
        del env["DS_ACCELERATOR"]
    return ["train.device=cuda"], env


def execute(run: StudyRun, overrides: list[str], eval_args: list[str], env: dict[str, str], logs: Path,
            device: str) -> None:  # fmt: skip
    """Train from scratch (an unfinished earlier attempt is discarded), evaluate the final checkpoint, and copy the
    results into the run's archive folder when there is one; `study.json` records the code and the `device` that ran
    it. A folder that a live run holds (another study on the same --runs-dir) is refused, never deleted."""
    check_free(run.run_dir)
    shutil.rmtree(run.run_dir, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    train, evaluate = run_commands(run, overrides, eval_args)
    code = code_version()  # before training: the code this run imports, whatever the checkout does meanwhile
    with (logs / f"{run.name}.log").open("w") as log:
        started, clock = time.time(), time.perf_counter()
        subprocess.run(train, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        trained = time.perf_counter()
        subprocess.run(evaluate, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    timing = {"train_s": trained - clock, "eval_s": time.perf_counter() - trained, "started": started,
              "finished": time.time()}  # fmt: skip
    record = {"variant": run.variant, "seed": run.seed, **timing, "code": code, "device": device}
    run.done_file.write_text(json.dumps(record) + "\n")
    if run.archive is not None:
        archive_run(run.run_dir, run.archive)


def run_all(runs: list[StudyRun], overrides: list[str], eval_args: list[str], jobs: int, env: dict[str, str],
            logs: Path, device: str, stop_after_s: float | None = None) -> None:  # fmt: skip
    """Every unfinished run, `jobs` at a time; none starts after `stop_after_s` (runs in progress finish). A run
    finished before `--archive` was given is archived first."""
    for run in runs:
        if run.archive is not None and run.done_file.is_file() and not run.archived:
            archive_run(run.run_dir, run.archive)
    deadline = math.inf if stop_after_s is None else time.monotonic() + stop_after_s

    def execute_in_time(run: StudyRun) -> bool:
        if time.monotonic() > deadline:
            return False
        execute(run, overrides, eval_args, env, logs, device)
        return True

    # Seed by seed (each seed's variants in turn): a study stopped early leaves whole sets of paired runs.
    seed_rank = {seed: rank for rank, seed in enumerate(dict.fromkeys(run.seed for run in runs))}
    pending = sorted((run for run in runs if not run.done), key=lambda run: seed_rank[run.seed])
    for run in pending:  # before any run starts: another study's live run is refused, not deleted
        check_free(run.run_dir)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for run, ran in zip(pending, pool.map(execute_in_time, pending), strict=True):
            if ran:
                print(f"study: {run.name} done", flush=True)


def reclaim_overrides(args: argparse.Namespace) -> None:
    """Give back to the overrides the `key=value` words that `--variants`/`--seeds` swallowed, then read the seeds."""
    for option in ("variants", "seeds"):
        words = [str(word) for word in getattr(args, option)]
        args.overrides = [*args.overrides, *(word for word in words if "=" in word)]
        setattr(args, option, [word for word in words if "=" not in word])
    if not args.variants:
        raise RecipeError("--variants: name at least one variant (a <variant>.yaml under --recipes)")
    bad = [seed for seed in args.seeds if not re.fullmatch(r"\d+", seed)]
    if bad or not args.seeds:
        raise RecipeError(f"--seeds: expected whole numbers >= 0, got {', '.join(map(repr, bad)) or 'none'}")
    args.seeds = [int(seed) for seed in args.seeds]


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument a study reads or writes, before any run starts: the report is written hours later, and a
    study that cannot write it has spent them for nothing."""
    check_can_write("--runs-dir", args.runs_dir, folder=True)
    if args.status:
        return
    if args.jobs < 1:
        raise InputError(f"--jobs: must be >= 1 runs at once, got {args.jobs}")
    if args.stop_after is not None and not 0 <= args.stop_after < math.inf:
        raise InputError(f"--stop-after: minutes >= 0, got {args.stop_after}")
    if args.max_examples < 0:
        raise InputError(f"--max-examples: questions per set >= 0 (0 = all), got {args.max_examples}")
    if args.protocol is not None and not args.protocol.is_file():
        raise InputError(f"--protocol: no such file {args.protocol}")
    args.csv = args.csv or args.doc.with_name(f"{args.doc.stem}-runs.csv")  # checked here, written hours later
    inputs = [args.recipes, *([args.protocol] if args.protocol else [])]
    reports = [("--doc", args.doc, REPORT_IS_OURS), ("--plot", args.plot, _plot_of_report(args.doc)),
               ("--csv", args.csv, starts_with(b"run,variant,seed,"))]  # fmt: skip
    for label, path, ours in reports:  # the study's own earlier report is regenerated; anything else is refused
        if path is not None:
            check_output(label, path, inputs, args.overwrite, ours=ours)
    named = [(label, path) for label, path, _ in reports if path is not None]
    for (label, path), (other_label, other) in itertools.combinations(named, 2):
        if path.expanduser().resolve() == other.expanduser().resolve():
            raise InputError(f"{other_label}: {other} is also {label}; name a file for each")
    if args.archive is not None:
        check_output("--archive", args.archive, inputs, folder=True, overwrite=True)  # it adds runs to its folder


REPORT_IS_OURS = starts_with(b"Generated by `ntl-pretrain study")


def _plot_of_report(doc: Path) -> Callable[[Path], bool]:
    """An image is the study's own when it carries the project's signature, or when the study's own report (`doc`)
    shows it (reports written before images were signed)."""
    signed = starts_with(SIGNATURE.encode())

    def ours(plot: Path) -> bool:
        if signed(plot):
            return True
        shown = f"]({os.path.relpath(plot.resolve(), doc.resolve().parent)})"
        return doc.is_file() and REPORT_IS_OURS(doc) and shown in doc.read_text(encoding="utf-8", errors="replace")

    return ours


def run_study(args: argparse.Namespace) -> int:
    try:
        reclaim_overrides(args)
        check_arguments(args)
        runs = plan(args.recipes, args.variants, args.seeds, args.runs_dir, args.archive)
        if args.status:
            print("\n".join(status_lines(runs)))
            return 0
        rule = RULES[args.decide] if args.decide else None
        if rule is not None and rule.variants() - set(args.variants):
            raise RecipeError(f"--decide compares {sorted(rule.variants())}: add the missing ones to --variants")
        device = resolve_device(args.device, recipe_devices(runs, args.overrides), _cuda_available())
    except InputError as error:  # a RecipeError too
        print(f"ntl-pretrain study: {error.one_line()}", file=sys.stderr)
        return 2
    device_overrides, env = placement(device, args.jobs, dict(os.environ), os.cpu_count() or 1)
    if (unclean := unclean_warning(code_version())) is not None:
        print(f"ntl-pretrain study: {unclean}", file=sys.stderr, flush=True)
    eval_args = ["--max-examples", str(args.max_examples)]
    stop_after_s = None if args.stop_after is None else args.stop_after * 60
    run_all(runs, [*args.overrides, *device_overrides], eval_args, args.jobs, env, args.runs_dir / "logs",
            device_name(device), stop_after_s)  # fmt: skip
    finished = [run for run in runs if run.done]
    # A protocol's report, or a verdict, from some of the runs is what the protocol forbids: a peek.
    if len(finished) < len(runs) and (args.protocol is not None or rule is not None or not finished):
        print(f"ntl-pretrain study: {len(finished)} of {len(runs)} planned runs finished; no report until all are")
        return EXIT_UNFINISHED
    command = shlex.join(["ntl-pretrain", "study", *(sys.argv[2:] if sys.argv[1:2] == ["study"] else sys.argv[1:])])
    write_report(finished, args.doc, args.plot, command.strip(), args.overrides, args.title, args.protocol, rule,
                 args.csv)  # fmt: skip
    print(args.doc)
    return 0


def recipe_devices(runs: list[StudyRun], overrides: list[str]) -> set[str]:
    """Load every variant's recipe as its runs will (before any run folder is touched: a typo in an override must
    not cost a finished run); the `train.device` values they ask for."""
    from ntl_pretrain.config.deepspeed import load_run

    devices = set()
    for run in {run.variant: run for run in runs}.values():
        try:
            recipe, _ = load_run(run.recipe, run_overrides(run, overrides), world_size=1)
        except RecipeError as error:
            message = str(error)
            raise RecipeError(message if message.startswith(str(run.recipe)) else f"{run.recipe}: {message}") from error
        devices.add(recipe.train.device)
    return devices


def status_lines(runs: list[StudyRun]) -> list[str]:
    """How many planned runs are done and pending, per variant and in all, and how far the runs in progress are
    (a throughput rule counts them: docs/study-v3-protocol.md's GPU arm); no metric."""
    lines = []
    for variant in dict.fromkeys(run.variant for run in runs):
        done = sum(run.done for run in runs if run.variant == variant)
        lines.append(f"{variant}: {done} done, {sum(run.variant == variant for run in runs) - done} pending")
    done = sum(run.done for run in runs)
    in_progress = sum(run.progress() for run in runs if not run.done)
    return [*lines, f"all: {done} of {len(runs)} planned runs done, {len(runs) - done} pending; the unfinished runs "
            f"have trained {in_progress:.2f} runs' worth of steps"]  # fmt: skip


def device_name(device: str) -> str:
    """What a run's `study.json` records as its device: `cpu (N cores)` or `cuda (<the GPU's name>)`."""
    if device == "cpu":
        return f"cpu ({os.cpu_count() or 1} cores)"
    import torch

    return f"cuda ({torch.cuda.get_device_name()})"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
