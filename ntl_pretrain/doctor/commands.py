"""`ntl-pretrain doctor` and `python -m ntl_pretrain.doctor` (every rank of a launch): run the checks, merge them
over ranks, print the table on rank 0 and write the JSON report."""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.arguments import SKIPPABLE, TRAIN_ROWS
from ntl_pretrain.doctor.collectives import collectives_check, request_nccl_log
from ntl_pretrain.doctor.environment import environment_check
from ntl_pretrain.doctor.gpu_paths import GPU_PATH_CHECKS
from ntl_pretrain.doctor.loss_checks import loss_check
from ntl_pretrain.doctor.report import Check, guarded, merge_ranks, table, write_json
from ntl_pretrain.doctor.speed import speed_check
from ntl_pretrain.doctor.training import local_ranks, throughput_check, train_checks
from ntl_pretrain.doctor.zero_stage import zero_stage_check
from ntl_pretrain.errors import InputError, check_can_write
from ntl_pretrain.runtime.process_group import bind_local_device, default_backend

# Ranks other than each node's first wait in a collective while it trains (minutes on a slow machine).
WAIT_FOR_TRAINING = datetime.timedelta(minutes=30)


def init_process_group() -> None:
    """Join the launch this process belongs to, or make a 1-process group when it was started on its own."""
    if "RANK" not in os.environ:
        from ntl_pretrain.runtime.process_group import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip
    bind_local_device()
    request_nccl_log()
    dist.init_process_group(default_backend(), timeout=WAIT_FOR_TRAINING)


def this_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def node_checks(device: torch.device, args: argparse.Namespace, work_dir: Path) -> list[Check]:
    """The training checks, run by each node's first rank; the node's other ranks report them as run there."""
    if "train" in args.skip:
        return skipped("train")
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return [Check(name, None, "run by the node's local rank 0") for name in (*TRAIN_ROWS, "throughput")]
    checks = announced("train", lambda: train_checks(device, work_dir, args.recipe))
    checks += [Check(name, False, "not run: training failed") for name in TRAIN_ROWS[len(checks) :]]
    if args.quick:
        return [*checks, Check("throughput", None, "--quick")]
    return [*checks, *announced("throughput", lambda: [throughput_check(device, work_dir, args.recipe)])]


def announced(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """`guarded`, after a line on stderr saying which checks start (rank 0): together they take minutes, and the
    table comes only at the end."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"ntl-pretrain doctor: running the {name} checks", file=sys.stderr, flush=True)
    return guarded(name, run)


def skipped(group: str) -> list[Check]:
    return [Check(name, None, f"--skip {group}") for name in SKIPPABLE[group]]


def run_checks(device: torch.device, args: argparse.Namespace, work_dir: Path) -> list[Check]:
    checks = announced("environment", lambda: environment_check(device))
    nodes = max(1, dist.get_world_size() // local_ranks())
    checks += announced("collectives", lambda: collectives_check(device, args.quick, nodes, args.expected_busbw))
    checks += announced("loss", lambda: loss_check(device))
    for name, check in GPU_PATH_CHECKS.items():
        checks += announced(name, lambda check=check: [check(device)])
    checks += skipped("speed") if "speed" in args.skip else announced("speed", lambda: speed_check(device))
    ranks = (dist.get_world_size(), local_ranks())
    checks += announced("ZeRO stage", lambda: [zero_stage_check(device, args.recipe, *ranks)])
    if device.type == "cuda":  # hand the cached blocks back: the training checks' processes share this GPU
        torch.cuda.empty_cache()
    return checks + node_checks(device, args, work_dir)


def check_arguments(args: argparse.Namespace) -> None:
    """The arguments and the files the checks read and write, before minutes of checks."""
    busbw = args.expected_busbw
    if busbw is not None and not 0 < busbw < float("inf"):
        raise InputError(f"--expected-busbw: a bandwidth in GB/s > 0, got {busbw}")
    if not args.recipe.is_file():
        raise InputError(f"--recipe: {args.recipe} is not a recipe file")
    if args.out is not None:
        check_can_write("--out", args.out)
    if args.work_dir is not None:
        check_can_write("--work-dir", args.work_dir, folder=True)


def run_doctor(args: argparse.Namespace) -> int:
    check_arguments(args)
    init_process_group()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="ntl-doctor-"))
    try:
        checks = run_checks(this_device(), args, work_dir / "checks")
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, checks)
        merged = merge_ranks(per_rank)
        failed = any(check.ok is False for check in merged)
        if dist.get_rank() == 0:  # the file first: a console that fails costs the table, never the report
            if args.out is not None:
                write_json(merged, args.out, dist.get_world_size())
            print(table(merged), flush=True)
        if failed and int(os.environ.get("LOCAL_RANK", 0)) == 0:  # the rank that ran the training checks
            print(f"ntl-pretrain doctor: rank {dist.get_rank()}: the training checks' files are in {work_dir}",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0
