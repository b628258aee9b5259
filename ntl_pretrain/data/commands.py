"""`ntl-pretrain data ...`: corpus generation, tokenizer training and a preview of packed samples."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from ntl_pretrain.errors import InputError
from ntl_pretrain.outputs import check_output, check_outputs_in

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
ARITHMETIC_SIZES = {"train": 15000, "validation": 1000, "interpolation": 1000, "extrapolation": 1000}
WORD_PROBLEM_SIZES = {"train": 5000, "validation": 500, "interpolation": 500, "extrapolation": 500}
# 8,500 of the 10,000 questions `a+b=` with a, b < 100: interpolation and validation questions are held out.
ADDITION_SIZES = {"train": 7000, "validation": 500, "interpolation": 1000, "extrapolation": 1000}
# All 900 questions `a*b=` with a two-digit a and a one-digit b, split three ways; 500 with a three-digit a.
MULTIPLICATION_SIZES = {"train": 600, "validation": 100, "interpolation": 200, "extrapolation": 500}
# The noisy regression task `f(a,b)=` (a, b < 500): as many training records as the addition corpus; the answers of
# train and validation carry noise, those of interpolation do not (ntl_pretrain/data/regression.py).
REGRESSION_SIZES = {"train": 7000, "validation": 500, "interpolation": 1000}
# The tiny tokenizer's training text. Fixed, so a set added later (addition) leaves the tokenizer as it is.
TOKENIZER_SETS = ("arithmetic", "prose", "word_problems")
MAX_SCALE = 1000  # 15M arithmetic records: beyond this a typo, not a corpus


def register(subparsers: argparse._SubParsersAction, summary: str | None = None) -> None:
    data = subparsers.add_parser("data", help=summary)
    commands = data.add_subparsers(dest="data_command", required=True)
    _add_make_arithmetic(commands)
    _add_make_regression(commands)
    _add_import_prose(commands)
    _add_train_tokenizer(commands)
    _add_preview(commands)


def _add_make_arithmetic(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "make-arithmetic",
        help="write arithmetic and word-problem Q/A jsonl: train, validation, interpolation, extrapolation",
    )
    parser.add_argument("--out", type=Path, default=CORPUS, help="folder for <set>/<split>.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every split size")
    parser.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    parser.set_defaults(func=run_make_arithmetic)


def run_make_arithmetic(args: argparse.Namespace) -> None:
    from ntl_pretrain.data.arithmetic import make_arithmetic

    sizes = {
        "arithmetic": scaled_sizes(ARITHMETIC_SIZES, args.scale),
        "word_problems": scaled_sizes(WORD_PROBLEM_SIZES, args.scale),
        "addition": scaled_sizes(ADDITION_SIZES, args.scale),
        "multiplication": scaled_sizes(MULTIPLICATION_SIZES, args.scale),
    }
    names = [f"{name}/{split}.jsonl" for name, splits in sizes.items() for split in splits]
    check_outputs_in("--out", args.out, names, args.overwrite)
    for path in make_arithmetic(args.out, sizes, args.seed):
        print(path)


def scaled_sizes(sizes: dict[str, int], scale: float) -> dict[str, int]:
    """Every split size times `--scale` (at least one record each); a scale outside (0, MAX_SCALE] is refused."""
    if not 0 < scale <= MAX_SCALE:
        raise InputError(f"--scale: must be in (0, {MAX_SCALE}], got {scale}")
    return {split: max(1, round(size * scale)) for split, size in sizes.items()}


def _add_make_regression(commands: argparse._SubParsersAction) -> None:
    from ntl_pretrain.data.regression import NOISE_SD

    parser = commands.add_parser(
        "make-regression",
        help="write the noisy regression task f(a,b)=a+b+noise as Q/A jsonl: train, validation, interpolation",
    )
    parser.add_argument("--out", type=Path, default=CORPUS, help="folder for <name>/<split>.jsonl")
    parser.add_argument(
        "--name", default="regression", help="the set's folder under --out (regression-exact: the noise-free set)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--noise-sd", type=float, default=NOISE_SD, help="sd of the Gaussian noise on train and validation answers"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every split size")
    parser.add_argument(
        "--all-questions",
        action="store_true",
        help="write only <name>/train.jsonl.gz: every question the seed's validation and interpolation splits do not "
        "hold, shuffled (study v7's training set)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    parser.set_defaults(func=run_make_regression)


def run_make_regression(args: argparse.Namespace) -> None:
    from ntl_pretrain.data.regression import OPERAND_MAX, make_all_questions, make_regression

    sizes = scaled_sizes(REGRESSION_SIZES, args.scale)
    if sum(sizes.values()) > (OPERAND_MAX + 1) ** 2:
        raise InputError(f"--scale: {sum(sizes.values())} questions, more than the {(OPERAND_MAX + 1) ** 2} there are")
    if not (math.isfinite(args.noise_sd) and args.noise_sd >= 0):
        raise InputError(f"--noise-sd: must be finite and >= 0, got {args.noise_sd}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        raise InputError(f"--name: a folder name (letters, digits, '-', '_', '.'), got {args.name!r}")
    if args.all_questions:
        check_outputs_in("--out", args.out, [f"{args.name}/train.jsonl.gz"], args.overwrite)
        print(make_all_questions(args.out, sizes, args.seed, args.noise_sd, args.name))
        return
    check_outputs_in("--out", args.out, [f"{args.name}/{split}.jsonl" for split in sizes], args.overwrite)
    for path in make_regression(args.out, sizes, args.seed, args.noise_sd, args.name):
        print(path)


def _add_import_prose(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "import-prose", help="cut a Project Gutenberg book into train/validation jsonl documents"
    )
    parser.add_argument("book", type=Path, help="plain-text Gutenberg book, e.g. sentencepiece's botchan.txt")
    parser.add_argument("--out", type=Path, default=CORPUS / "prose")
    parser.add_argument("--lines-per-document", type=int, default=20)
    parser.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    parser.set_defaults(func=run_import_prose)


def run_import_prose(args: argparse.Namespace) -> None:
    from ntl_pretrain.data.prose import import_book

    if args.lines_per_document < 1:
        raise InputError(f"--lines-per-document: must be >= 1, got {args.lines_per_document}")
    check_outputs_in("--out", args.out, ["train.jsonl", "validation.jsonl"], args.overwrite)
    for path in import_book(args.book, args.out, args.lines_per_document):
        print(path)


def _add_train_tokenizer(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("train-tokenizer", help="train the tiny byte-level BPE tokenizer on the corpus")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="folder holding <set>/train.jsonl")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: corpus/tiny-tokenizer, or tiny-tokenizer-<N>digit"
    )
    parser.add_argument("--vocab-size", type=int, default=2048, help="word vocabulary (number chunks come on top)")
    parser.add_argument(
        "--max-digits",
        type=int,
        default=1,
        choices=range(1, 5),
        metavar="{1..4}",
        help="numbers in chunks of at most this many digits, left to right (1: single digits; 3: as Llama-3)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    parser.set_defaults(func=run_train_tokenizer)


def run_train_tokenizer(args: argparse.Namespace) -> None:
    from ntl_pretrain.data.tiny_tokenizer import train_and_save

    files = [args.corpus / name / "train.jsonl" for name in TOKENIZER_SETS]
    missing = [str(file) for file in files if not file.is_file()]
    if missing:
        raise InputError(f"--corpus: missing {', '.join(missing)} (ntl-pretrain data make-arithmetic writes them)")
    if args.vocab_size < 1:
        raise InputError(f"--vocab-size: must be >= 1, got {args.vocab_size}")
    out = args.out or CORPUS / tokenizer_folder(args.max_digits)
    check_output("--out", out, files, args.overwrite, folder=True)
    tokenizer = train_and_save(files, out, args.vocab_size, args.max_digits)
    print(f"{out}: vocab {len(tokenizer)} trained on {', '.join(str(f) for f in files)}")


def tokenizer_folder(max_digits: int) -> str:
    """Where the embedded corpus keeps the tiny tokenizer that spells numbers in chunks of `max_digits`."""
    return "tiny-tokenizer" if max_digits == 1 else f"tiny-tokenizer-{max_digits}digit"


def _add_preview(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "preview", help="print the first packed samples of a recipe with number tokens highlighted"
    )
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. data.seq_len=256")
    parser.add_argument("--samples", type=int, default=2, help="packed sequences to print")
    parser.add_argument("--batches", type=int, default=8, help="batches over which to count number labels")
    parser.add_argument("--split", default="train", choices=["train", "validation"])
    parser.set_defaults(func=run_preview)


def run_preview(args: argparse.Namespace) -> None:
    from ntl_pretrain.data.preview import preview_recipe

    if args.samples < 0:
        raise InputError(f"--samples: must be >= 0, got {args.samples}")
    if args.batches < 1:
        raise InputError(f"--batches: must be >= 1, got {args.batches}")
    preview_recipe(args.recipe, args.overrides, args.samples, args.batches, args.split)
