"""Arithmetic and numeric word-problem generator, in the spirit of DeepMind's mathematics dataset.

Every example is a `{"question": str, "answer": str}` record. Numbers are drawn by digit count, so the
extrapolation split asks the same kinds of questions with larger numbers than training ever shows.
Arithmetic is exact (`decimal.Decimal`); answers are written without trailing zeros. Generation is a
pure function of the seed and the split name, so `ntl-pretrain data make-arithmetic` is reproducible.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from ntl_pretrain.outputs import write_text

Example = dict[str, str]


@dataclass(frozen=True)
class Difficulty:
    """How large the numbers of a split are."""

    min_digits: int
    """Fewest integer digits of an operand."""
    max_digits: int
    """Most integer digits of an operand."""
    max_decimals: int = 2
    """Most digits after the decimal point of a decimal operand."""


def format_number(value: Decimal) -> str:
    """Plain positional notation without trailing zeros: 12.50 -> '12.5', 3.0 -> '3', -0 -> '0'."""
    text = f"{value.normalize():f}"
    return "0" if text in ("-0", "0") else text


def draw_integer(rng: random.Random, level: Difficulty) -> int:
    digits = rng.randint(level.min_digits, level.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def draw_number(rng: random.Random, level: Difficulty, decimals: int) -> Decimal:
    """An operand with `decimals` digits after the point (0 gives an integer)."""
    fraction = rng.randint(0, 10**decimals - 1) if decimals else 0
    return Decimal(draw_integer(rng, level)) + Decimal(fraction).scaleb(-decimals)


def draw_decimals(rng: random.Random, level: Difficulty) -> int:
    """Half of the questions use integers, the rest one or more decimal places."""
    return 0 if rng.random() < 0.5 else rng.randint(1, level.max_decimals)


def add_or_subtract(rng: random.Random, level: Difficulty) -> Example:
    decimals = draw_decimals(rng, level)
    a, b = draw_number(rng, level, decimals), draw_number(rng, level, decimals)
    if rng.random() < 0.5:
        phrasing = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Calculate {a} + {b}."])
        result = a + b
    else:
        phrasing = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "Calculate {a} - {b}."])
        result = a - b
    return _example(phrasing.format(a=format_number(a), b=format_number(b)), result)


def multiply(rng: random.Random, level: Difficulty) -> Example:
    decimals = draw_decimals(rng, level)
    a = draw_number(rng, level, decimals)
    b = draw_number(rng, Difficulty(1, max(1, level.max_digits - 2), level.max_decimals), 0)
    phrasing = rng.choice(["What is {a} * {b}?", "Multiply {a} and {b}.", "Calculate {a} times {b}."])
    return _example(phrasing.format(a=format_number(a), b=format_number(b)), a * b)


def divide(rng: random.Random, level: Difficulty) -> Example:
    """Division built backwards from the quotient, so every answer is exact."""
    quotient = draw_number(rng, level, draw_decimals(rng, level))
    divisor = Decimal(rng.randint(2, 10 ** max(1, level.max_digits - 2) - 1))
    dividend = quotient * divisor
    phrasing = rng.choice(["What is {a} / {b}?", "Divide {a} by {b}.", "Calculate {a} divided by {b}."])
    return _example(phrasing.format(a=format_number(dividend), b=format_number(divisor)), quotient)


def multi_step(rng: random.Random, level: Difficulty) -> Example:
    """`(a op b) op c` with integers, e.g. 'Evaluate (12 + 7) * 3 - 5.'"""
    terms = [Decimal(draw_integer(rng, level)) for _ in range(3)]
    small = Decimal(rng.randint(2, 12))
    first, second = rng.choice("+-"), rng.choice("+-*")
    inner = terms[0] + terms[1] if first == "+" else terms[0] - terms[1]
    operand = small if second == "*" else terms[2]
    outer = {"+": inner + operand, "-": inner - operand, "*": inner * operand}[second]
    text = f"({format_number(terms[0])} {first} {format_number(terms[1])}) {second} {format_number(operand)}"
    return _example(f"Evaluate {text}.", outer)


NAMES = ["Ana", "Ben", "Chen", "Dara", "Emil", "Fatima", "Goro", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
ITEMS = ["notebooks", "apples", "tickets", "bolts", "candles", "stamps", "bottles", "pencils"]


def word_problem_purchase(rng: random.Random, level: Difficulty) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, 9 * level.max_digits)
    price = draw_number(rng, Difficulty(level.min_digits, level.max_digits - 1 or 1), 2)
    question = f"{name} buys {count} {item} at {format_number(price)} dollars each. How many dollars does {name} spend?"
    return _example(question, count * price)


def word_problem_change(rng: random.Random, level: Difficulty) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, 9)
    price = draw_number(rng, level, rng.randint(0, 2))
    paid = (count * price // 10 + 1) * 10 + 10 * rng.randint(0, 5)
    question = (
        f"{name} pays {format_number(paid)} dollars for {count} {item} that cost "
        f"{format_number(price)} dollars each. How much change does {name} get?"
    )
    return _example(question, paid - count * price)


def word_problem_sharing(rng: random.Random, level: Difficulty) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    people = rng.randint(2, 12)
    each = draw_integer(rng, level)
    question = (
        f"{name} shares {people * each} {item} equally among {people} friends. How many {item} does each friend get?"
    )
    return _example(question, Decimal(each))


def word_problem_savings(rng: random.Random, level: Difficulty) -> Example:
    name = rng.choice(NAMES)
    start, weekly, weeks = draw_integer(rng, level), draw_integer(rng, level), rng.randint(2, 52)
    question = (
        f"{name} has {start} dollars and saves {weekly} dollars every week. "
        f"How many dollars does {name} have after {weeks} weeks?"
    )
    return _example(question, Decimal(start + weekly * weeks))


def word_problem_distance(rng: random.Random, level: Difficulty) -> Example:
    name = rng.choice(NAMES)
    speed = draw_number(rng, level, rng.randint(0, 1))
    hours = Decimal(rng.randint(1, 12)) / (2 if rng.random() < 0.3 else 1)
    question = (
        f"{name} drives at {format_number(speed)} kilometres per hour for {format_number(hours)} hours. "
        f"How many kilometres does {name} drive?"
    )
    return _example(question, speed * hours)


def compact_addition(rng: random.Random, level: Difficulty) -> Example:
    """`a+b=` with integers and nothing else: no words to model, so a model of about a million parameters spends
    its capacity on the digits and learns part of the task on a CPU in minutes (the study's task)."""
    a, b = draw_integer(rng, level), draw_integer(rng, level)
    return _example(f"{a}+{b}=", Decimal(a + b))


def compact_multiplication(rng: random.Random, level: Difficulty) -> Example:
    """`a*b=` with `a` of the level's digit counts and `b` a single digit: the study's second task, where how far an
    answer is off matters more than exactness (two-digit `a`: 900 questions in all)."""
    a, b = draw_integer(rng, level), rng.randint(0, 9)
    return _example(f"{a}*{b}=", Decimal(a * b))


Generator = Callable[[random.Random, Difficulty], Example]


@dataclass(frozen=True)
class QuestionSet:
    """Generators, drawn uniformly (one listed twice comes twice as often), and the operand sizes of each
    split. Interpolation questions come from the training distribution (but are never training questions);
    extrapolation questions use operands with more digits than any training operand."""

    generators: list[Generator]
    train: Difficulty
    extrapolation: Difficulty

    def level(self, split: str) -> Difficulty:
        return self.extrapolation if split == "extrapolation" else self.train


MIXED = {"train": Difficulty(min_digits=1, max_digits=4), "extrapolation": Difficulty(min_digits=5, max_digits=6)}
SETS: dict[str, QuestionSet] = {
    "arithmetic": QuestionSet([add_or_subtract, add_or_subtract, multiply, divide, multi_step], **MIXED),
    "word_problems": QuestionSet(
        [word_problem_purchase, word_problem_change, word_problem_sharing, word_problem_savings, word_problem_distance],
        **MIXED,
    ),
    "addition": QuestionSet([compact_addition], train=Difficulty(1, 2, 0), extrapolation=Difficulty(3, 3, 0)),
    "multiplication": QuestionSet(
        [compact_multiplication], train=Difficulty(2, 2, 0), extrapolation=Difficulty(3, 3, 0)
    ),
}


def _example(question: str, answer: Decimal) -> Example:
    return {"question": question, "answer": format_number(answer)}


def split_rng(seed: int, set_name: str, split: str) -> random.Random:
    """Independent, stable stream per (seed, set, split); `hash()` is salted per process, crc32 is not."""
    return random.Random(seed * 1_000_003 + zlib.crc32(f"{set_name}/{split}".encode()))


def generate(
    generators: list[Generator], rng: random.Random, level: Difficulty, count: int, exclude: set[str]
) -> Iterator[Example]:
    """`count` examples whose questions are pairwise distinct and not in `exclude`."""
    seen = set(exclude)
    produced = 0
    while produced < count:
        example = rng.choice(generators)(rng, level)
        if example["question"] in seen:
            continue
        seen.add(example["question"])
        produced += 1
        yield example


SPLITS = ("train", "validation", "interpolation", "extrapolation")


def make_set(set_name: str, sizes: dict[str, int], seed: int) -> dict[str, list[Example]]:
    """All splits of one set; validation and interpolation never repeat a training question."""
    splits: dict[str, list[Example]] = {}
    used: set[str] = set()
    question_set = SETS[set_name]
    for split in SPLITS:
        rng = split_rng(seed, set_name, split)
        examples = generate(question_set.generators, rng, question_set.level(split), sizes[split], used)
        splits[split] = list(examples)
        used.update(example["question"] for example in splits[split])
    return splits


def write_jsonl(path: Path, examples: list[Example]) -> None:
    """Written beside `path` and renamed into place (outputs.py): never half a file, never through a symlink."""
    write_text(path, "".join(json.dumps(example, ensure_ascii=False) + "\n" for example in examples))


def make_arithmetic(out_dir: Path, sizes: dict[str, dict[str, int]], seed: int) -> list[Path]:
    """Write `<out_dir>/<set>/<split>.jsonl` for every set in `sizes`; returns the written paths."""
    written = []
    for set_name, set_sizes in sizes.items():
        for split, examples in make_set(set_name, set_sizes, seed).items():
            path = out_dir / set_name / f"{split}.jsonl"
            write_jsonl(path, examples)
            written.append(path)
    return written
