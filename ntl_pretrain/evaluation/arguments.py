"""`ntl-pretrain eval`'s arguments, apart from the command itself (`commands.py`, which imports torch and
transformers): `ntl-pretrain eval --help` and a mistyped flag answer at once."""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

from ntl_pretrain.evaluation.config import EvalConfig


def register(subparsers: argparse._SubParsersAction, summary: str | None = None) -> None:
    parser = subparsers.add_parser("eval", help=summary)
    parser.add_argument("target", help="run directory (latest checkpoint), checkpoint step folder or HF folder")
    defaults = EvalConfig()
    parser.add_argument("--qa", action="append", default=None, metavar="JSONL",
                        help="Q/A jsonl (repeatable); default: the run recipe's eval.qa_sets, else arithmetic "
                             "interpolation and extrapolation")  # fmt: skip
    parser.add_argument("--max-examples", type=int, default=defaults.max_examples, help="per set; 0 = all")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"default: the run's eval.max_new_tokens, else {defaults.max_new_tokens}")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="prompts per generate call")
    parser.add_argument("--prompt-template", default=None,
                        help=f"default: the run's eval.prompt_template, else {defaults.prompt_template!r}")  # fmt: skip
    parser.add_argument("--chat-template", choices=["auto", "none"], default=None,
                        help="auto: prompts as user messages in the tokenizer's chat template; none: as text; "
                        "default: the run's eval.chat_template, else auto for an Instruct model (its "
                        "end-of-sequence token ends a turn of its chat template), else none")  # fmt: skip
    parser.add_argument("--validation", action="append", default=None, metavar="PATH",
                        help="held-out source (repeatable); default: the run's data.validation")  # fmt: skip
    parser.add_argument(
        "--template", default=None, help="template of the --validation records, e.g. '{question} {answer}'"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="default: the run's data.seq_len, else 512")
    parser.add_argument("--per-document-attention", action=argparse.BooleanOptionalAction, default=None,
                        help="restart positions at each packed document (and keep attention inside it); "
                             "default: the run's data.per_document_attention, else off")  # fmt: skip
    parser.add_argument("--max-validation-batches", type=int, default=None, metavar="N",
                        help="what train.eval_max_batches: N evaluated in the run: N micro-batches of its "
                             "train.micro_batch_size on each of its ranks, the split's first sequences (an HF "
                             "folder: N x 8); default: the whole split")  # fmt: skip
    parser.add_argument("--ntl-kind", choices=["was", "mse", "mae", "huber", "digits", "number"], default="was")
    parser.add_argument("--out", type=Path, default=None, help="also write the record to this JSON file")
    parser.add_argument("--log-metrics", action="store_true", help="append the record to the run's metrics.jsonl")
    parser.add_argument("--answers", type=Path, default=None, metavar="JSONL",
                        help="also write every question, reference and generated answer to this file")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out / --answers file (never one of the inputs)")  # fmt: skip
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`


def run(args: argparse.Namespace) -> int:
    """`ntl-pretrain eval`: torch and transformers load, and every input is checked, for seconds to a minute before
    the evaluation's own first line; a line every few seconds says so (rank 0), while a quick refusal stays the only
    line (`console.ongoing`)."""
    from ntl_pretrain.reporting.console import ongoing

    console = sys.stderr if os.environ.get("RANK", "0") == "0" else io.StringIO()
    with ongoing(args.target, "ntl-pretrain eval: ", console) as stage:
        stage("loading the libraries")
        from ntl_pretrain.evaluation.commands import checked_arguments, run_eval

        stage("checking the arguments and the model folder")
        checked = checked_arguments(args)
    return run_eval(args, checked)
