"""How often the number-level NTL meets a zero target in the embedded corpus (issue 12's "zero-target case").

    python bench/zero_targets.py

A number whose value is 0 costs |ŷ| / (|ŷ| + eps) ≈ 1 unless the expectation ŷ is within float32 eps of 0, so
such numbers weigh on the loss almost whatever the model predicts. For every training set of the embedded corpus,
tokenised as the recipes do (one record a row), and for the single-digit and the 1-3-digit tiny tokenizers and
Llama-3: the numbers, the share of them whose value is 0, and where those zeros come from (a lone `0`, or the `0`
before a decimal point, which is its own number unless `float_level` joins `0.5` into 5).
"""

from __future__ import annotations

import json
from importlib import resources

import torch

from ntl_pretrain.loss.number_level import find_number_spans
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import load_tokenizer

TOKENIZERS = {
    "tiny (1 digit)": "pkg:ntl_pretrain/corpus/tiny-tokenizer",
    "tiny (1-3 digits)": "pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit",
    "Llama-3": "pkg:quicktok/data/llama3.vocab",
}
SETS = ("addition", "arithmetic", "word_problems", "prose")


def texts(name: str) -> list[str]:
    """The set's training records as the recipes template them (Q/A sets: "{question} {answer}")."""
    lines = (resources.files("ntl_pretrain") / "corpus" / name / "train.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["text"] if "text" in r else f"{r['question']} {r['answer']}" for r in records]


def zero_share(tokenizer, nv: NumberVocab, rows: list[str], float_level: bool) -> tuple[int, float]:
    """(numbers, share of them whose value is 0)."""
    numbers = zeros = 0
    for text in rows:
        labels = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        spans = find_number_spans(labels, nv, float_level=float_level)
        values = torch.nan_to_num(nv.values[labels[0]].double()) * spans.place
        per_number = torch.zeros(labels.numel(), dtype=torch.float64).index_add_(0, spans.number.clamp_min(0), values)
        count = int(spans.count)
        numbers += count
        zeros += int((per_number[:count] == 0).sum())
    return numbers, zeros / max(numbers, 1)


def main() -> None:
    print(f"{'tokenizer':20}{'set':16}{'numbers':>10}{'zero share':>12}{'with float_level':>18}")
    for label, spec in TOKENIZERS.items():
        tokenizer = load_tokenizer(spec)
        nv = NumberVocab.from_tokenizer(tokenizer)
        for name in SETS:
            rows = texts(name)
            numbers, share = zero_share(tokenizer, nv, rows, float_level=False)
            _, joined_share = zero_share(tokenizer, nv, rows, float_level=True)
            print(f"{label:20}{name:16}{numbers:>10,}{share:>12.2%}{joined_share:>18.2%}")


if __name__ == "__main__":
    main()
