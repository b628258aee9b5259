"""Noisy regression: a number answer from a number question, with Gaussian noise on the training target.

The task study v4's exploratory pilot trains on (NTL's home regime: the paper's loss is a regression loss on number
tokens). A question `f(a,b)=` holds two integers `a, b` in 0..499; the noise-free answer is `a + b` (0..998).
Training and validation answers are `round(a + b + e)` with `e ~ N(0, noise_sd²)`, clipped to 0..999, so no model can
answer them exactly and the best prediction, under absolute or squared error, is the noise-free value; the
interpolation answers are that noise-free value, so `ntl-pretrain eval`'s `mae` on them is the error against it.

Why `a + b` on 0..499: it is smooth (linear) in the operands' values, which the study's model learns in 1,000 steps
with the 3-digit tokenizer (study v3: R² 0.999, MAE 0.66 on `a+b=` with a, b < 100), and 0..499 puts the answers
across 0..998: under `tiny-tokenizer-3digit` every operand and every answer is one token, 98% of the answers
3-digit tokens, the tokens whose near misses kind `was` hardly sees (docs/loss.md). The prompt `f(a,b)=` holds no
number but the operands and is not `a+b=`, whose answers in the addition corpus are exact. Measured: plain CE
(recipes/study/regression/ce.yaml, seed 0) reaches MAE 11.7 against the noise-free answers after 1,000 steps (R² 0.994).
Why sd 10: 1% of the range, so the function dominates and clipping changes none of the committed records, yet the noisy
target spreads over ~40 neighbouring answer tokens (4% of the answers are exact), the regime where a loss that knows
which tokens are near should matter; its mean absolute deviation, 8, is the error of answering with one noisy draw.

Generation is a pure function of the seed, the noise and the split sizes (`ntl-pretrain data make-regression`); as in
`arithmetic.py`, no question appears in two splits.

Study v7 asks the question in a pretraining regime, where each training example is seen about once: its training set
(`make-regression --all-questions`) is every one of the 250,000 questions that the seed's validation and
interpolation splits do not hold (248,500), in a fixed shuffled order, the same order at every noise level.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

from ntl_pretrain.data.arithmetic import Example, split_rng, write_jsonl
from ntl_pretrain.outputs import write_file

SET_NAME = "regression"
OPERAND_MAX = 499
"""Operands are drawn uniformly from 0..OPERAND_MAX (250,000 questions in all)."""
ANSWER_MIN, ANSWER_MAX = 0, 999
"""Noisy answers are clipped to this range."""
NOISE_SD = 10.0
"""Standard deviation of the Gaussian noise on training and validation answers (1% of the answer range)."""
SPLITS = ("train", "validation", "interpolation")
HELD_OUT_SPLITS = ("validation", "interpolation")
NOISY_SPLITS = ("train", "validation")
"""Splits whose answers carry noise; interpolation answers are the noise-free value."""


def target(a: int, b: int) -> int:
    """The noise-free answer."""
    return a + b


def question(a: int, b: int) -> str:
    return f"f({a},{b})="


def noisy(value: int, rng: random.Random, noise_sd: float) -> int:
    """`value` plus Gaussian noise, rounded to an integer (half to even) and clipped to ANSWER_MIN..ANSWER_MAX."""
    return min(ANSWER_MAX, max(ANSWER_MIN, round(value + rng.gauss(0.0, noise_sd))))


def draw_example(rng: random.Random, noise_sd: float | None) -> Example:
    """One record; `noise_sd` None gives the noise-free answer (and draws no noise)."""
    a, b = rng.randint(0, OPERAND_MAX), rng.randint(0, OPERAND_MAX)
    answer = target(a, b) if noise_sd is None else noisy(target(a, b), rng, noise_sd)
    return {"question": question(a, b), "answer": str(answer)}


def make_splits(sizes: dict[str, int], seed: int, noise_sd: float = NOISE_SD) -> dict[str, list[Example]]:
    """Every split in SPLITS, `sizes[split]` records each, questions pairwise distinct within and across splits."""
    if not (math.isfinite(noise_sd) and noise_sd >= 0):
        raise ValueError(f"noise_sd: must be finite and >= 0, got {noise_sd}")
    if sum(sizes[split] for split in SPLITS) > (OPERAND_MAX + 1) ** 2:
        raise ValueError(f"sizes: at most {(OPERAND_MAX + 1) ** 2} distinct questions, asked for {sizes}")
    splits: dict[str, list[Example]] = {}
    used: set[str] = set()
    for split in SPLITS:
        rng = split_rng(seed, SET_NAME, split)
        examples: list[Example] = []
        while len(examples) < sizes[split]:
            example = draw_example(rng, noise_sd if split in NOISY_SPLITS else None)
            if example["question"] not in used:
                used.add(example["question"])
                examples.append(example)
        splits[split] = examples
    return splits


def make_regression(
    out_dir: Path, sizes: dict[str, int], seed: int, noise_sd: float = NOISE_SD, folder: str = SET_NAME
) -> list[Path]:
    """Write `<out_dir>/<folder>/<split>.jsonl`; returns the written paths. The questions depend on the seed and the
    sizes only (never on `folder` or the noise), so two noise levels of one seed ask the same questions."""
    written = []
    for split, examples in make_splits(sizes, seed, noise_sd).items():
        path = out_dir / folder / f"{split}.jsonl"
        write_jsonl(path, examples)
        written.append(path)
    return written


def every_other_question(sizes: dict[str, int], seed: int, noise_sd: float = NOISE_SD) -> list[Example]:
    """Every question that `make_splits(sizes, seed)` puts in no held-out split, each once, in an order shuffled by
    the seed alone; answered like the train split (`noise_sd` 0: noise-free), with the noise drawn in that order from
    a stream of its own, so two noise levels ask the same questions in the same order."""
    splits = make_splits(sizes, seed, noise_sd)
    held_out = {example["question"] for split in HELD_OUT_SPLITS for example in splits[split]}
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1) if question(a, b) not in held_out]
    split_rng(seed, SET_NAME, "all-questions").shuffle(pairs)
    noise = split_rng(seed, SET_NAME, "all-questions-noise")
    answers = (noisy(target(a, b), noise, noise_sd) if noise_sd else target(a, b) for a, b in pairs)
    return [{"question": question(a, b), "answer": str(answer)} for (a, b), answer in zip(pairs, answers, strict=True)]


def make_all_questions(out_dir: Path, sizes: dict[str, int], seed: int, noise_sd: float, folder: str) -> Path:
    """Write `every_other_question` as `<out_dir>/<folder>/train.jsonl.gz` (gzip without a time stamp or a name, so
    the file is the same byte for byte whenever it is made); the held-out splits are the regular set's files."""
    text = "".join(json.dumps(example) + "\n" for example in every_other_question(sizes, seed, noise_sd))
    packed = gzip.compress(text.encode(), compresslevel=9, mtime=0)
    return write_file(out_dir / folder / "train.jsonl.gz", lambda partial: partial.write_bytes(packed))
