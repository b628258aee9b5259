"""Generation metrics and validation loss: against independent formulas, a one-by-one greedy loop, a scripted
model with known answers, float64 references, and 2 gloo ranks against one process."""

from __future__ import annotations

import argparse
import copy
import json
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.float64_reference import count_ntl_terms, reference_rows
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.data import build_dataloader
from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.evaluation import EvalConfig, QaSetConfig, generation_metrics, validation_metrics
from ntl_pretrain.evaluation.generation import (
    Answered,
    QaExample,
    answer_records,
    answer_sets,
    gather_answers,
    generate_batch,
    prompt_ids,
    set_metrics,
    summarise_sets,
)
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import load_tokenizer, resolve_path

TINY_TOKENIZER = "pkg:ntl_pretrain/corpus/tiny-tokenizer"
VALIDATION = SourceConfig(
    name="arithmetic", path="pkg:ntl_pretrain/corpus/arithmetic/validation.jsonl", template="{question} {answer}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TOKENIZER)


def tiny_model(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# ---- metrics from sums --------------------------------------------------------------------------------------


def aligned_digit_accuracy(predictions: list[str | None], references: list[str]) -> float:
    """Independent of `place_digits`: align decimal strings at the point and compare character by character."""
    right = total = 0
    for prediction, reference in zip(predictions, references, strict=True):
        ref_int, _, ref_frac = format(abs(Decimal(reference)).normalize(), "f").partition(".")
        total += len(ref_int) + len(ref_frac)
        if prediction is None:
            continue
        pred_int, _, pred_frac = format(abs(Decimal(prediction)).normalize(), "f").partition(".")
        pred_int = pred_int.rjust(len(ref_int), "0")[-len(ref_int) :]
        pred_frac = pred_frac.ljust(len(ref_frac), "0")[: len(ref_frac)]
        right += sum(a == b for a, b in zip(ref_int + ref_frac, pred_int + pred_frac, strict=True))
    return right / total


def test_summary_matches_independent_formulas() -> None:
    rng = np.random.default_rng(0)
    references = [str(int(v)) for v in rng.integers(-5000, 5000, 40)] + ["12.5", "-0.75", "3.04"]
    predictions: list[str | None] = []
    for index, reference in enumerate(references):
        if index % 7 == 3:
            predictions.append(None)
        elif index % 3 == 0:
            predictions.append(reference)
        else:
            predictions.append(str(Decimal(reference) + Decimal(int(rng.integers(-300, 300))) / 4))
    answered = [
        Answered(QaExample("q", ref), "", None if pred is None else Decimal(pred))
        for pred, ref in zip(predictions, references, strict=True)
    ]
    metrics = set_metrics(answered)

    parsed = [(float(p), float(r)) for p, r in zip(predictions, references, strict=True) if p is not None]
    y_hat, y = np.array([p for p, _ in parsed]), np.array([r for _, r in parsed])
    exact = sum(p is not None and Decimal(p) == Decimal(r) for p, r in zip(predictions, references, strict=True))
    assert metrics["examples"] == len(references)
    assert metrics["exact_match"] == pytest.approx(exact / len(references))
    assert metrics["unparseable"] == pytest.approx(predictions.count(None) / len(references))
    assert metrics["mae"] == pytest.approx(np.abs(y_hat - y).mean())
    assert metrics["log_mae"] == pytest.approx(np.log10(1 + np.abs(y_hat - y)).mean())
    assert metrics["r2"] == pytest.approx(1 - ((y - y_hat) ** 2).sum() / ((y - y.mean()) ** 2).sum())
    assert metrics["digit_accuracy"] == pytest.approx(aligned_digit_accuracy(predictions, references))


def test_summary_without_parseable_answers_is_nan_not_an_error() -> None:
    metrics = set_metrics([Answered(QaExample("q", "12"), "none", None)])
    assert metrics["unparseable"] == 1.0 and metrics["exact_match"] == 0.0 and metrics["digit_accuracy"] == 0.0
    assert math.isnan(metrics["mae"]) and math.isnan(metrics["r2"])


def exact_r2(predictions: list[str], references: list[str]) -> Fraction:
    """R² in exact rational arithmetic: the decimal strings are rationals, so nothing is rounded."""
    y_hat, y = [Fraction(p) for p in predictions], [Fraction(r) for r in references]
    mean = sum(y) / len(y)
    return 1 - sum((a - b) ** 2 for a, b in zip(y, y_hat, strict=True)) / sum((a - mean) ** 2 for a in y)


def answered_as(predictions: list[str], references: list[str]) -> list[Answered]:
    return [Answered(QaExample("q", r), p, Decimal(p)) for p, r in zip(predictions, references, strict=True)]


def test_r2_is_nan_exactly_when_the_references_do_not_vary() -> None:
    for count in range(2, 12):  # the one-pass variance of 3 x 0.7 was 2e-17, which gave an R² of -4.5e13
        predictions = ["0.6", *["0.7"] * (count - 1)]
        assert math.isnan(set_metrics(answered_as(predictions, ["0.7"] * count))["r2"]), count
    # the smallest variation still gives a finite R²: a perfect answer scores exactly 1
    assert set_metrics(answered_as(["0.7", "0.7000001"], ["0.7", "0.7000001"]))["r2"] == 1.0


def test_r2_survives_a_large_shared_offset() -> None:
    references = ["100000000.1", "100000000.2", "100000000.3", "100000000.4", "100000000.5"]
    predictions = ["100000000.15", "100000000.25", "100000000.35", "100000000.45", "100000000.55"]
    expected = exact_r2(predictions, references)
    assert expected == Fraction(7, 8)
    assert set_metrics(answered_as(predictions, references))["r2"] == pytest.approx(float(expected), rel=1e-12)


# ---- generation ---------------------------------------------------------------------------------------------


class ScriptedModel(torch.nn.Module):
    """Answers each prompt with a fixed text (then EOS), the way `generate` returns: prompt followed by new ids."""

    def __init__(self, tokenizer, script: dict[str, str]):
        super().__init__()
        self.tokenizer, self.script = tokenizer, script
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **_):
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m][1:])
            new = self.tokenizer(self.script[prompt], add_special_tokens=False)["input_ids"] + [eos_token_id]
            new = (new + [pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(ids + new)
        return torch.tensor(rows)


def test_generation_metrics_on_scripted_answers(tokenizer, tmp_path) -> None:
    records = [
        ("What is 2 + 3?", "5", " 5"),
        ("Subtract 4 from 1.", "-3", " -3 apples"),
        ("What is 10 * 12?", "120", " 1,20"),  # "1,20" is not comma-grouped: parses as 1
        ("Divide 9 by 2.", "4.5", " 4.50"),
        ("What is 7 - 7?", "0", " nothing"),
    ]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a, _ in records))
    model = ScriptedModel(tokenizer, {q: out for q, _, out in records})
    cfg = EvalConfig(qa_sets=[QaSetConfig(path=str(path), name="toy")], batch_size=2, max_examples=None)
    metrics = generation_metrics(model, tokenizer, cfg)
    assert model.calls == 3  # 5 prompts in batches of 2
    assert metrics["eval/toy/exact_match"] == pytest.approx(3 / 5)
    assert metrics["eval/toy/unparseable"] == pytest.approx(1 / 5)
    assert metrics["eval/toy/mae"] == pytest.approx((0 + 0 + 119 + 0) / 4)
    # digits: 5 (1/1), -3 (1/1), 120 vs 1 (0/3), 4.5 (2/2), 0 unparseable (0/1)
    assert metrics["eval/toy/digit_accuracy"] == pytest.approx(4 / 8)
    assert model.training  # restored


def greedy_one_by_one(model, tokenizer, prompt: str, max_new_tokens: int, chat_template: str = "none") -> str:
    """Reference decoding: no padding, no cache, argmax over the full forward at each step."""
    ids = prompt_ids(tokenizer, prompt, chat_template)
    new: list[int] = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits_V = model(torch.tensor([ids + new])).logits[0, -1]
        token = int(logits_V.argmax())
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
    return tokenizer.decode(new)


def test_batched_left_padded_generation_equals_one_by_one_greedy(tokenizer) -> None:
    model = tiny_model(tokenizer)
    prompts = ["What is 2 + 3?", "Evaluate (897 + 5712) * 6.", "Hi", "Calculate 23440 divided by 80."]
    cfg = EvalConfig(max_new_tokens=8)
    with torch.no_grad():
        batched = generate_batch(model, tokenizer, prompts, cfg, synced=False)
    assert batched == [greedy_one_by_one(model, tokenizer, prompt, 8) for prompt in prompts]


CHAT = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|bot|>{% endif %}"
)


@pytest.fixture
def chat_tokenizer(tokenizer):
    """The tiny tokenizer with a chat template, as an Instruct model's has (a copy: the module's stays plain)."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT
    return chat


def test_auto_chat_template_sends_the_prompt_as_a_user_turn_and_none_as_text_after_eos(tokenizer, chat_tokenizer):
    turn = chat_tokenizer("<|user|>12+7=<|end|><|bot|>", add_special_tokens=False)["input_ids"]
    assert prompt_ids(chat_tokenizer, "12+7=", "auto") == turn
    text = [tokenizer.eos_token_id, *tokenizer("12+7=", add_special_tokens=False)["input_ids"]]
    assert prompt_ids(chat_tokenizer, "12+7=", "none") == text
    assert prompt_ids(tokenizer, "12+7=", "auto") == text  # no template: the text, as pretraining showed it


def test_generation_with_the_chat_template_equals_one_by_one_greedy_on_its_turns(chat_tokenizer) -> None:
    model = tiny_model(chat_tokenizer)
    prompts = ["What is 2 + 3?", "Hi", "Calculate 23440 divided by 80."]
    cfg = EvalConfig(max_new_tokens=6, chat_template="auto")
    with torch.no_grad():
        batched = generate_batch(model, chat_tokenizer, prompts, cfg, synced=False)
        plain = generate_batch(model, chat_tokenizer, prompts, EvalConfig(max_new_tokens=6), synced=False)
    assert batched == [greedy_one_by_one(model, chat_tokenizer, prompt, 6, "auto") for prompt in prompts]
    assert batched != plain  # the template reached the model


def test_eval_takes_the_chat_template_from_the_flag_else_the_run():
    from ntl_pretrain.evaluation.arguments import register
    from ntl_pretrain.evaluation.commands import eval_config_from_args

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    run = EvalConfig(chat_template="auto")
    assert eval_config_from_args(parser.parse_args(["eval", "x"]), run).chat_template == "auto"
    flagged = parser.parse_args(["eval", "x", "--chat-template", "none"])
    assert eval_config_from_args(flagged, run).chat_template == "none"
    assert eval_config_from_args(parser.parse_args(["eval", "x"])).chat_template is None  # the model's kind decides


def test_an_instruct_model_is_asked_in_its_chat_template_unless_told_otherwise(tokenizer, chat_tokenizer):
    """Issue 71: the shipped SmolLM2 weights are an Instruct model's, which answered a raw prompt with its end-of-turn
    token at once (scored unparseable) unless given `--chat-template auto`. By default now a model whose EOS ends a
    turn of its template (an Instruct model's) is asked in the template; one whose template ends turns with another
    token (a base model's, whose EOS ends a text) gets the text; `none` and `auto` still decide."""
    instruct = copy.deepcopy(chat_tokenizer)
    instruct.chat_template = CHAT.replace("<|end|>", tokenizer.eos_token)
    turn = instruct(f"<|user|>12+7={tokenizer.eos_token}<|bot|>", add_special_tokens=False)["input_ids"]
    text = [tokenizer.eos_token_id, *tokenizer("12+7=", add_special_tokens=False)["input_ids"]]
    assert prompt_ids(instruct, "12+7=", None) == turn
    assert prompt_ids(instruct, "12+7=", "none") == text
    assert prompt_ids(chat_tokenizer, "12+7=", None) == text  # a base model's template: its EOS is not a turn's end
    assert prompt_ids(tokenizer, "12+7=", None) == text


# ---- validation loss ----------------------------------------------------------------------------------------


def reference_validation(model, tokenizer, max_batches: int) -> dict[str, float]:
    """F.cross_entropy and the float64 NTL-WAS and number-level NTL of docs/loss.md over the same packed batches."""
    data = DataConfig(sources=[VALIDATION], validation=[VALIDATION], seq_len=64)
    loader = build_dataloader(
        data, tokenizer, micro_batch_size=4, dp_rank=0, dp_world_size=1, seed=0, split="validation"
    )
    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    ce = ntl = tokens = numbers = number_ce = ntl_number = whole_numbers = ntl_digits = 0.0
    for index, batch in enumerate(loader):
        if index == max_batches:
            break
        with torch.no_grad():
            logits_NV = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.flatten(0, 1)
        labels_N = batch["labels"].flatten()
        ce_N = F.cross_entropy(logits_NV.double(), labels_N, ignore_index=-100, reduction="none")
        at_number_N = (labels_N != -100) & (nv.classes[labels_N.clamp(min=0)] >= 0)
        ce += ce_N.sum().item()
        number_ce += ce_N[at_number_N].sum().item()
        _, ntl_N = reference_rows(logits_NV, labels_N, nv, "was", reweigh=False)
        ntl += ntl_N.sum().item()
        ntl_digits += reference_rows(logits_NV, labels_N, nv, "digits", reweigh=False)[1].sum().item()
        _, number_ntl_N = reference_rows(logits_NV, batch["labels"], nv, "number", reweigh=False)
        ntl_number += number_ntl_N.sum().item()
        whole_numbers += count_ntl_terms(batch["labels"], nv, "number")
        tokens += (labels_N != -100).sum().item()
        numbers += at_number_N.sum().item()
    return {"val_ce": ce / tokens, "val_ntl_was": ntl / numbers, "val_tokens": tokens, "val_number_tokens": numbers,
            "val_number_ce": number_ce / numbers, "val_ntl_number": ntl_number / whole_numbers,
            "val_numbers": whole_numbers, "val_ntl_digits": ntl_digits / numbers}  # fmt: skip


def test_validation_metrics_match_float64_reference(tokenizer) -> None:
    model = tiny_model(tokenizer)
    got = validation_metrics(model, tokenizer, [VALIDATION], seq_len=64, micro_batch_size=4, max_sequences=12)
    expected = reference_validation(model, tokenizer, max_batches=3)
    assert got["val_tokens"] == expected["val_tokens"] and got["val_number_tokens"] == expected["val_number_tokens"]
    assert got["val_ce"] == pytest.approx(expected["val_ce"], rel=1e-5)
    assert got["val_ntl_was"] == pytest.approx(expected["val_ntl_was"], rel=1e-5)
    assert got["val_ntl_digits"] == pytest.approx(expected["val_ntl_digits"], rel=1e-5)
    assert got["val_numbers"] == expected["val_numbers"] < expected["val_number_tokens"]  # multi-token numbers
    assert got["val_ntl_number"] == pytest.approx(expected["val_ntl_number"], rel=1e-5)
    assert got["val_number_ce"] == pytest.approx(expected["val_number_ce"], rel=1e-5)
    # an untrained model: CE is near log V everywhere, yet the number positions differ by far more than rel=1e-5
    assert expected["val_number_ce"] != pytest.approx(expected["val_ce"], rel=1e-3)
    assert got["val_perplexity"] == pytest.approx(math.exp(expected["val_ce"]), rel=1e-5)


def trainers_capped_validation(model, tokenizer, data: DataConfig, max_batches: int, micro_batch: int, ranks: int):
    """(CE, label tokens) the trainer logs with `train.eval_max_batches: max_batches`: each of its `ranks` evaluates
    the first `max_batches` micro-batches of its validation loader over all sources (`Trainer._lockstep`), as
    `helpers.launches.assert_model_reproduces_logged_validation` checks against real runs' logged numbers."""
    ce = tokens = 0.0
    for rank in range(ranks):
        loader = build_dataloader(data, tokenizer, micro_batch_size=micro_batch, dp_rank=rank, dp_world_size=ranks,
                                  seed=0, split="validation")  # fmt: skip
        for _, batch in zip(range(max_batches), loader, strict=False):
            with torch.no_grad():
                logits_NV = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.flatten(0, 1)
            labels_N = batch["labels"].flatten()
            ce += F.cross_entropy(logits_NV.double(), labels_N, ignore_index=-100, reduction="sum").item()
            tokens += (labels_N != -100).sum().item()
    return ce, tokens


@pytest.mark.parametrize(("max_batches", "micro_batch", "ranks"), [(1, 4, 1), (3, 2, 3)])
def test_eval_caps_validation_as_the_trainer_does(tokenizer, tmp_path, max_batches, micro_batch, ranks) -> None:
    """`train.eval_max_batches: N` covers the first N x micro-batch x ranks sequences of the whole split; eval's
    cap counts the same (`sequence_cap`), in one process, so the aggregate `val_ce` of the same weights is the same.
    It capped each source at N of its own batches of 8 (issue 60: 7.07 against the trainer's 7.11). Two short
    sources, so that a cap ends inside the first one, or inside the second."""
    from ntl_pretrain.evaluation.validation import sequence_cap

    model = tiny_model(tokenizer)
    sources = []
    for name, count in (("arithmetic", 20), ("word_problems", 23)):
        lines = resolve_path(f"pkg:ntl_pretrain/corpus/{name}/validation.jsonl").read_text().splitlines(True)
        (tmp_path / f"{name}.jsonl").write_text("".join(lines[:count]))
        sources.append(SourceConfig(name=name, path=str(tmp_path / f"{name}.jsonl"), template="{question} {answer}"))
    data = DataConfig(sources=sources, validation=sources, seq_len=64)
    ce, tokens = trainers_capped_validation(model, tokenizer, data, max_batches, micro_batch, ranks)
    got = validation_metrics(model, tokenizer, sources, seq_len=64,
                             max_sequences=sequence_cap(max_batches, micro_batch, ranks))  # fmt: skip
    assert got["val_tokens"] == tokens
    assert got["val_ce"] == pytest.approx(ce / tokens, rel=1e-6)
    assert ("val/word_problems/tokens" in got) == (max_batches * micro_batch * ranks > 6)  # arithmetic: 6 sequences


# ---- two ranks ----------------------------------------------------------------------------------------------

QA_CFG = EvalConfig(max_examples=7, batch_size=2, max_new_tokens=6)  # 7 questions: ranks get 4 and 3


def _metrics_on_this_process(validation_path: str) -> dict:
    """The metrics, plus (under "answers") every question's answer gathered in question order."""
    tokenizer = load_tokenizer(TINY_TOKENIZER)
    model = tiny_model(tokenizer)
    answered = answer_sets(model, tokenizer, QA_CFG)
    metrics: dict = summarise_sets(answered)
    source = SourceConfig(name="held_out", path=validation_path, template="{question} {answer}")
    metrics.update(validation_metrics(model, tokenizer, [source], seq_len=64, micro_batch_size=2))
    return metrics | {"answers": answer_records(gather_answers(answered))}


def _check_ranks_agree_with(expected: dict, validation_path: str) -> None:
    got = _metrics_on_this_process(validation_path)
    assert got.keys() == expected.keys()
    assert got.pop("answers") == expected["answers"]  # both ranks hold all 7, in file order
    for key, value in got.items():
        assert value == pytest.approx(expected[key], rel=1e-5, nan_ok=True), key


@pytest.mark.slow
def test_two_ranks_give_the_single_process_metrics(tmp_path) -> None:
    from helpers.distributed import run_distributed

    from ntl_pretrain.tokenizer import resolve_path

    held_out = tmp_path / "held_out.jsonl"  # 50 records: an odd number of 64-token blocks, so ranks differ
    held_out.write_text("".join(resolve_path(VALIDATION.path).read_text().splitlines(keepends=True)[:50]))
    expected = _metrics_on_this_process(str(held_out))
    assert expected["eval/arithmetic_interpolation/examples"] == 7
    run_distributed(_check_ranks_agree_with, 2, expected, str(held_out))
