"""How often the number-level NTL meets a zero target in the embedded corpus (issue 12's "zero-target case"), and
how much of a trained model's number-level loss and gradient such targets make.

    python bench/zero_targets.py [--run RUN_DIR ...]

A number whose value is 0 costs |ŷ| / (|ŷ| + eps) ≈ 1 unless the expectation ŷ is within float32 eps of 0, so
such numbers weigh on the loss almost whatever the model predicts. For every training set of the embedded corpus,
tokenised as the recipes do (one record a row), and for the single-digit and the 1-3-digit tiny tokenizers and
Llama-3: the numbers, the share of them whose value is 0, and where those zeros come from (a lone `0`, or the `0`
before a decimal point, which is its own number unless `float_level` joins `0.5` into 5).
With `--run`: each run's last checkpoint on its (first) validation set, one micro-batch of packed blocks after
another: the share of numbers with a zero target, their mean loss against the others', and their share of the
summed loss and of the gradient norm on the logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
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


def number_targets(labels_BT: torch.Tensor, nv: NumberVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """(y of the number at each number's first position [N] float64, 0 elsewhere; bool [N] first positions)."""
    spans = find_number_spans(labels_BT, nv)
    labels_N = labels_BT.reshape(-1)
    values_N = torch.nan_to_num(nv.values[labels_N.clamp_min(0)].double()) * spans.place
    per_number = torch.zeros(labels_N.numel(), dtype=torch.float64).index_add_(0, spans.number.clamp_min(0), values_N)
    return torch.where(spans.first, per_number[spans.number.clamp_min(0)], 0.0), spans.first


def run_shares(run: str, max_batches: int) -> dict[str, float]:
    """A run's last checkpoint on its validation blocks: zero-target numbers' share of numbers, loss and gradient."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ntl_pretrain.data import build_dataloader
    from ntl_pretrain.evaluation.model_folder import export_for_eval, recipe_validation, resolve_target
    from ntl_pretrain.evaluation.validation import packed_forward
    from ntl_pretrain.loss import ce_ntl_loss

    target = resolve_target(run)
    with tempfile.TemporaryDirectory() as folder:
        exported = export_for_eval(target, folder)
        model = AutoModelForCausalLM.from_pretrained(exported.hf_folder)
        tokenizer = AutoTokenizer.from_pretrained(exported.hf_folder)
    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    validation = recipe_validation(target)
    data = dataclasses.replace(validation, sources=validation.validation[:1], validation=validation.validation[:1])
    loader = build_dataloader(data, tokenizer, micro_batch_size=8, dp_rank=0, dp_world_size=1, seed=0,
                              split="validation")  # fmt: skip
    totals = torch.zeros(6, dtype=torch.float64)  # numbers, zero numbers, loss, zero loss, grad², zero grad²
    for index, batch in enumerate(loader):
        if index == max_batches:
            break
        with torch.no_grad():
            logits = packed_forward(model, batch["input_ids"], batch["position_ids"])
        logits.requires_grad_(True)
        loss_N = ce_ntl_loss(logits, batch["labels"], nv, kind="number", reduction="none").ntl.reshape(-1)
        value_N, first_N = number_targets(batch["labels"], nv)
        zero_N = first_N & (value_N == 0)
        zero_grad, other_grad = (torch.autograd.grad(loss_N[mask].sum(), logits, retain_graph=True)[0]
                                 for mask in (zero_N, first_N & ~zero_N))  # fmt: skip
        totals += torch.tensor(
            [
                first_N.sum(),
                zero_N.sum(),
                loss_N.sum(),
                loss_N[zero_N].sum(),
                (zero_grad + other_grad).square().sum(),
                zero_grad.square().sum(),
            ],
            dtype=torch.float64,
        )
    numbers, zeros, loss, zero_loss, grad2, zero_grad2 = totals.tolist()
    return {"numbers": numbers, "zero share": zeros / numbers, "zero mean loss": zero_loss / max(zeros, 1),
            "other mean loss": (loss - zero_loss) / (numbers - zeros), "zero loss share": zero_loss / loss,
            "zero grad-norm share": (zero_grad2 / grad2) ** 0.5, "step": target.step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="*", default=[], help="run directories to measure on their validation set")
    parser.add_argument("--max-batches", type=int, default=20, help="validation micro-batches of 8 blocks per run")
    args = parser.parse_args()
    for run in args.run:
        print(run, {key: round(value, 4) for key, value in run_shares(run, args.max_batches).items()})
    if args.run:
        return
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
