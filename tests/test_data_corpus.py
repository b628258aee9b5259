"""The embedded corpus, its generator, the prose importer, the tiny tokenizer and the data commands."""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
from helpers.real_tokenizers import TOKENIZER_FILES
from transformers import AutoTokenizer

from ntl_pretrain.data import commands
from ntl_pretrain.data.arithmetic import make_set
from ntl_pretrain.data.commands import CORPUS, tokenizer_folder
from ntl_pretrain.data.prose import split_book
from ntl_pretrain.data.regression import make_splits, noisy
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import load_tokenizer

NUMBER = r"-?\d+(?:\.\d+)?"
# Each phrasing the generator uses, as an independent recipe for the expected value.
PHRASINGS = [
    (rf"^(?:What is|Calculate) ({NUMBER}) ([-+*/]) ({NUMBER})\??\.?$", lambda a, op, b: f"{a} {op} {b}"),
    (rf"^Add ({NUMBER}) and ({NUMBER})\.$", lambda a, b: f"{a} + {b}"),
    (rf"^Subtract ({NUMBER}) from ({NUMBER})\.$", lambda b, a: f"{a} - {b}"),
    (rf"^(?:Multiply ({NUMBER}) and|Calculate ({NUMBER}) times) ({NUMBER})\.$", lambda a, c, b: f"{a or c} * {b}"),
    (rf"^(?:Divide ({NUMBER}) by|Calculate ({NUMBER}) divided by) ({NUMBER})\.$", lambda a, c, b: f"{a or c} / {b}"),
    (r"^Evaluate (.*)\.$", lambda expression: expression),
]


def exact_value(question: str) -> Fraction:
    for pattern, to_expression in PHRASINGS:
        match = re.match(pattern, question)
        if match:
            expression = re.sub(NUMBER, lambda m: f"Fraction('{m.group()}')", to_expression(*match.groups()))
            return eval(expression, {"Fraction": Fraction})  # our own generated, regex-checked text
    raise AssertionError(f"unknown phrasing: {question}")


SIZES = {"train": 400, "validation": 50, "interpolation": 50, "extrapolation": 50}


def test_arithmetic_answers_are_exact_and_splits_disjoint():
    splits = make_set("arithmetic", SIZES, seed=3)
    for split, examples in splits.items():
        assert len(examples) == SIZES[split]
        for example in examples:
            assert Fraction(example["answer"]) == exact_value(example["question"]), example
    questions = [{e["question"] for e in examples} for examples in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions))
    assert any("." in e["question"] for e in splits["train"])  # decimals
    assert any(e["question"].startswith("Evaluate") for e in splits["train"])  # multi-step


def largest_numbers(examples) -> list[float]:
    """The largest number in each question, sorted."""
    return sorted(max(abs(float(n)) for n in re.findall(NUMBER, e["question"])) for e in examples)


def test_extrapolation_uses_larger_numbers_and_generation_is_deterministic():
    for set_name in ("arithmetic", "word_problems"):
        splits = make_set(set_name, SIZES, seed=5)
        train, extrapolation = largest_numbers(splits["train"]), largest_numbers(splits["extrapolation"])
        assert extrapolation[0] >= 10_000  # every question has a 5-digit number
        assert extrapolation[len(extrapolation) // 2] > 10 * train[len(train) // 2]
        assert make_set(set_name, SIZES, seed=5) == splits
        assert make_set(set_name, SIZES, seed=6) != splits


def test_addition_is_compact_exact_and_holds_out_interpolation_and_larger_operands():
    sizes = {"train": 3000, "validation": 300, "interpolation": 500, "extrapolation": 200}
    splits = make_set("addition", sizes, seed=0)
    operands = {}
    for split, examples in splits.items():
        assert len(examples) == sizes[split]
        pairs = [re.fullmatch(r"(\d+)\+(\d+)=", e["question"]).groups() for e in examples]
        assert [int(e["answer"]) for e in examples] == [int(a) + int(b) for a, b in pairs]
        operands[split] = [int(n) for pair in pairs for n in pair]
    for split in ("train", "validation", "interpolation"):
        assert max(operands[split]) < 100 and min(operands[split]) < 10  # one and two digits
    assert min(operands["extrapolation"]) >= 100 and max(operands["extrapolation"]) < 1000
    questions = [{e["question"] for e in examples} for examples in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions))  # 4,000 distinct of the 10,000 sums


def test_multiplication_splits_all_900_questions_and_extrapolates_to_three_digits():
    splits = make_set("multiplication", {"train": 600, "validation": 100, "interpolation": 200, "extrapolation": 500},
                      seed=0)  # fmt: skip
    pairs = {}
    for split, examples in splits.items():
        found = [tuple(map(int, re.fullmatch(r"(\d+)\*(\d)=", e["question"]).groups())) for e in examples]
        assert [int(e["answer"]) for e in examples] == [a * b for a, b in found]
        pairs[split] = set(found)
    held_in = pairs["train"] | pairs["validation"] | pairs["interpolation"]
    assert held_in == {(a, b) for a in range(10, 100) for b in range(10)}  # every question once, in one split
    assert all(100 <= a < 1000 for a, _ in pairs["extrapolation"]) and len(pairs["extrapolation"]) == 500


def test_committed_corpus_is_small_and_regenerates_byte_for_byte(tmp_path):
    total = sum(path.stat().st_size for path in CORPUS.rglob("*") if path.is_file())
    assert total < 7_000_000  # 6.8 MB with study v7's two 248,500-question training sets (1.6 MB each, issue 69)
    run(["data", "make-arithmetic", "--out", str(tmp_path), "--seed", "0"])
    run(["data", "make-regression", "--out", str(tmp_path), "--seed", "0"])
    exact = ["--noise-sd", "0", "--name", "regression-exact"]
    run(["data", "make-regression", "--out", str(tmp_path), "--seed", "0", *exact])
    run(
        [
            "data",
            "make-regression",
            "--out",
            str(tmp_path),
            "--seed",
            "0",
            "--all-questions",
            "--name",
            "regression-all",
        ]
    )
    run(["data", "make-regression", "--out", str(tmp_path), "--seed", "0", "--all-questions", *exact[:2], "--name",
         "regression-all-exact"])  # fmt: skip
    written = sorted(
        path.relative_to(tmp_path) for pattern in ("*.jsonl", "*.jsonl.gz") for path in tmp_path.rglob(pattern)
    )
    assert Path("regression/train.jsonl") in written and Path("regression-all/train.jsonl.gz") in written
    generated = (path.relative_to(CORPUS) for pattern in ("*.jsonl", "*.jsonl.gz") for path in CORPUS.rglob(pattern)
                 if path.parent.name != "prose")  # fmt: skip
    assert written == sorted(generated)  # every committed generated file, the regression tasks' included
    for path in written:  # a gzip file by its content: its bytes depend on the zlib that packed it
        read = gzip.decompress if path.suffix == ".gz" else bytes
        assert read((tmp_path / path).read_bytes()) == read((CORPUS / path).read_bytes()), path


def read_jsonl(path: Path) -> list[dict]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def regression_records(examples) -> list[tuple[int, int, int]]:
    """(a, b, answer) of each `f(a,b)=` record."""
    return [(*map(int, re.fullmatch(r"f\((\d+),(\d+)\)=", e["question"]).groups()), int(e["answer"])) for e in examples]


def test_regression_is_deterministic_noisy_in_training_and_noise_free_held_out():
    sizes = {"train": 7000, "validation": 500, "interpolation": 1000}
    splits = make_splits(sizes, seed=0)
    assert make_splits(sizes, seed=0) == splits
    assert make_splits(sizes, seed=1) != splits
    records = {split: regression_records(examples) for split, examples in splits.items()}
    for split, rows in records.items():
        assert len(rows) == sizes[split]
        assert all(0 <= a <= 499 and 0 <= b <= 499 and 0 <= y <= 999 for a, b, y in rows), split
    assert [y for _, _, y in records["interpolation"]] == [a + b for a, b, _ in records["interpolation"]]
    for split in ("train", "validation"):  # answers carry N(0, 10²) noise, rounded: sd sqrt(100 + 1/12)
        residuals = [y - (a + b) for a, b, y in records[split]]
        n = len(residuals)
        mean, sd = sum(residuals) / n, (sum(r * r for r in residuals) / n) ** 0.5
        assert abs(mean) < 4 * 10 / n**0.5 and abs(sd - 10) < 4 * 10 / (2 * n) ** 0.5, (split, mean, sd)
        assert sum(r == 0 for r in residuals) / n < 0.06  # exact answers are rare (1/(10 sqrt(2 pi)) = 4%)
    assert min(y for _, _, y in records["train"]) < 50 and max(y for _, _, y in records["train"]) > 950
    questions = [{e["question"] for e in examples} for examples in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions))  # no question in two splits
    exact = make_splits({"train": 300, "validation": 10, "interpolation": 10}, seed=0, noise_sd=0)
    assert all(y == a + b for split in exact.values() for a, b, y in regression_records(split))


def test_noise_free_regression_asks_the_noisy_sets_questions_with_exact_answers():
    """Study v6's noise-free arms (corpus/regression-exact/): the same questions in every split, answered a + b, so
    only the labels' noise differs between the two sets (and the held-out sets are the same file's bytes)."""
    for split in ("train", "validation", "interpolation"):
        noisy_set = read_jsonl(CORPUS / "regression" / f"{split}.jsonl")
        exact_set = read_jsonl(CORPUS / "regression-exact" / f"{split}.jsonl")
        assert [e["question"] for e in exact_set] == [e["question"] for e in noisy_set], split
        assert all(y == a + b for a, b, y in regression_records(exact_set)), split
    assert (CORPUS / "regression-exact" / "interpolation.jsonl").read_bytes() == (
        CORPUS / "regression" / "interpolation.jsonl"
    ).read_bytes()


def test_all_questions_sets_hold_every_question_but_the_held_out_once_in_one_shuffled_order():
    """Study v7's training sets (corpus/regression-all*/): the 248,500 questions that regression/'s validation and
    interpolation splits do not hold, each once, shuffled, in the same order noisy and noise-free."""
    noisy_rows = regression_records(read_jsonl(CORPUS / "regression-all" / "train.jsonl.gz"))
    exact_rows = regression_records(read_jsonl(CORPUS / "regression-all-exact" / "train.jsonl.gz"))
    held_out = {(a, b) for split in ("validation", "interpolation")
                for a, b, _ in regression_records(read_jsonl(CORPUS / "regression" / f"{split}.jsonl"))}  # fmt: skip
    pairs = [(a, b) for a, b, _ in noisy_rows]
    assert len(held_out) == 1500 and len(pairs) == len(set(pairs)) == 248_500
    assert set(pairs) | held_out == {(a, b) for a in range(500) for b in range(500)} and not set(pairs) & held_out
    assert [(a, b) for a, b, _ in exact_rows] == pairs and all(y == a + b for a, b, y in exact_rows)
    rises = sum(a + b < c + d for (a, b), (c, d) in zip(pairs[:-1], pairs[1:], strict=True))
    assert rises / len(pairs) == pytest.approx(0.5, abs=0.01)  # shuffled: the sum rises half the time
    residuals = [y - (a + b) for a, b, y in noisy_rows if 30 <= a + b <= 969]  # away from the clipping
    n = len(residuals)
    mean, sd = sum(residuals) / n, (sum(r * r for r in residuals) / n) ** 0.5
    assert abs(mean) < 4 * 10 / n**0.5 and abs(sd - (100 + 1 / 12) ** 0.5) < 4 * 10 / (2 * n) ** 0.5, (mean, sd)
    assert all(0 <= y <= 999 for _, _, y in noisy_rows)


def test_regression_noise_is_clipped_to_the_answer_range():
    rng = random.Random(0)
    low = [noisy(0, rng, 10.0) for _ in range(2000)]
    high = [noisy(998, rng, 10.0) for _ in range(2000)]
    assert min(low) == 0 and 0.4 < low.count(0) / len(low) < 0.6  # half the draws fall below 0 (and 0.5 rounds to 0)
    assert max(high) == 999 and 0.4 < high.count(999) / len(high) < 0.6


def test_split_book_keeps_the_body_and_holds_out_the_last_chapter():
    book = (
        "\ufeffProject Gutenberg header\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
        "CHAPTER I\r\none\r\ntwo\r\nthree\r\nCHAPTER II.\r\nfour\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nlicence text\r\n"
    )
    splits = split_book(book, lines_per_document=2)
    assert splits["train"] == [{"text": "CHAPTER I\none"}, {"text": "two\nthree"}]
    assert splits["validation"] == [{"text": "CHAPTER II.\nfour"}]


def test_tiny_tokenizer_loads_offline_and_spells_numbers_in_digits(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    assert len(tokenizer) == 2048 and tokenizer.eos_token == "<|endoftext|>"
    text = "Ana pays 1250.75 dollars for 12 apples."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if re.search("[0-9]", p)] == list("125075" + "12")
    assert sorted(t for t in tokenizer.get_vocab() if re.search("[0-9]", t)) == list("0123456789")


@pytest.mark.parametrize("max_digits", [1, 3])
def test_tiny_tokenizers_retrain_byte_for_byte(tmp_path, max_digits):
    run(["data", "train-tokenizer", "--max-digits", str(max_digits), "--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shipped = CORPUS / tokenizer_folder(max_digits) / name
        assert (tmp_path / name).read_bytes() == shipped.read_bytes(), name


def test_three_digit_tokenizer_chunks_numbers_left_to_right_as_llama3(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    chunked = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer-3digit")
    single = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    llama3 = load_tokenizer(TOKENIZER_FILES["llama3"])
    numbers = ["7", "12", "305", "1250", "12345", "0071", "1234567890123"]
    for number in numbers:
        expected = [number[i : i + 3] for i in range(0, len(number), 3)]
        assert chunked.tokenize(number) == expected, number
        assert llama3.tokenize(number) == expected, number  # the reference this tokenizer imitates
    text = "Ana pays 1250.75 dollars for 12 apples; 57+38=95."
    ids = chunked(text)["input_ids"]
    assert chunked.decode(ids) == text
    # Words are spelled exactly as by the single-digit tokenizer: only numbers differ.
    words = "Ana pays dollars for apples; the sum is"
    assert chunked(words)["input_ids"] == single(words)["input_ids"]
    digit_tokens = [t for t in chunked.get_vocab() if re.search("[0-9]", t)]
    assert len(digit_tokens) == 10 + 100 + 1000 and all(t.isdigit() for t in digit_tokens)
    classes = NumberVocab.from_tokenizer(chunked).class_info
    assert [(c.marker, c.digits) for c in classes] == [("none", 1), ("none", 2), ("none", 3)]


def run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    args.func(args)


def write_recipe(folder: Path) -> Path:
    numbers = [json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) for i in range(50)]
    (folder / "qa.jsonl").write_text("\n".join(numbers) + "\n")
    recipe = {
        "model": {"model_type": "llama"},
        "tokenizer": {"path": str(CORPUS / "tiny-tokenizer")},
        "data": {
            "seq_len": 32,
            "shuffle_buffer": 0,
            "sources": [{"path": str(folder / "qa.jsonl"), "template": "{q} {a}"}],
        },
        "train": {"micro_batch_size": 2},
    }
    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def test_preview_highlights_numbers_and_counts_number_labels(tmp_path, capsys):
    run(["data", "preview", str(write_recipe(tmp_path)), "--samples", "1", "--batches", "4"])
    out = capsys.readouterr().out
    assert "What is [0] + [1]? [1]<|endoftext|>What is [1] + [1]? [2]" in out
    # Independent count over the same 4 batches x 2 rows x 32 labels: "What is N + 1? M<eos>" documents.
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    stream = [t for i in range(50) for t in tokenizer(f"What is {i} + 1? {i + 1}")["input_ids"] + [0]]
    labels = stream[1 : 4 * 2 * 32 + 1]
    digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    expected = sum(label in digits for label in labels) / len(labels)
    assert f"number-token labels: {expected:.1%}" in out
