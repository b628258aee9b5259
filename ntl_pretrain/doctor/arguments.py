"""`ntl-pretrain doctor`'s arguments, apart from the checks (`commands.py` imports torch): `ntl-pretrain doctor
--help` and a mistyped flag answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path

TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
TRAIN_ROWS = ("train", "train resume", "export")
SKIPPABLE = {"speed": ("speed loss", "speed output layer"), "train": (*TRAIN_ROWS, "throughput")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="skip the throughput run and use a smaller bandwidth test")
    parser.add_argument("--skip", nargs="+", choices=sorted(SKIPPABLE), default=[], metavar="GROUP",
                        help="leave out check groups: speed (its rows take a minute on a small CPU), train (train, "
                        "resume, export, throughput); bench/gpu_first_run.sh --dry-run skips both")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, metavar="REPORT.json", help="also write the report here")
    work_dir_help = "where the training checks run (default: a temporary folder, removed if they pass)"
    parser.add_argument("--work-dir", type=Path, default=None, help=work_dir_help)
    parser.add_argument("--recipe", type=Path, default=TINY_RECIPE, help="the tiny recipe (default: %(default)s)")
    parser.add_argument("--expected-busbw", type=float, default=None, metavar="GB/s",
                        help="all-reduce bus bandwidth the links should deliver (default: NVLink GPUs on one node "
                        "from a table; across nodes none)")  # fmt: skip
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`


def register(subparsers: argparse._SubParsersAction, summary: str | None = None) -> None:
    parser = subparsers.add_parser("doctor", help=summary)
    add_arguments(parser)
