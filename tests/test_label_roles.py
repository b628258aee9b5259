"""Which labels carry which loss (`ce_labels`, `ntl_labels`: `all` or `answer`, per source).

Data: a Q/A source with `all` packs to exactly the batches of the same text as a plain source; with `answer`, the
labels left are each record's answer tokens and its EOS, for real tokenizers whose numbers are single digits,
1-3-digit chunks or GPT-2 merges. Loss: with CE and NTL on different labels, per-position CE and NTL are 0 where
their labels are ignored and equal the float64 reference elsewhere, with its gradients, for the dense kernel, the
chunked head and both sharded by vocabulary over 2 gloo ranks. Validation: `val_answer_*` are CE and NTL over the
answer labels alone. (Global-batch normalisation with differing masks: test_train_invariance.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.float64_reference import assert_close_relative, count_ntl_terms, reference_rows
from helpers.real_tokenizers import real_tokenizer
from test_vocab_parallel import BOUNDARIES, make_batch, synthetic_vocab

from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader
from ntl_pretrain.data.config import validate_sources
from ntl_pretrain.data.packing import IGNORE_INDEX
from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
ADDITION = REPO / "ntl_pretrain" / "corpus" / "addition" / "validation.jsonl"
TOKENIZERS = {
    "tiny-1digit": lambda: load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer"),
    "tiny-3digit": lambda: load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit"),
    "llama3": lambda: real_tokenizer("llama3"),
    "gpt2": lambda: real_tokenizer("gpt2"),
}


def qa_records(folder: Path, count: int, template_space: bool) -> tuple[Path, Path, list[dict]]:
    """The first `count` addition records as a Q/A file and, joined as the template joins them, as a text file."""
    records = [json.loads(line) for line in ADDITION.read_text().splitlines()[:count]]
    joiner = " " if template_space else ""
    qa, text = folder / "qa.jsonl", folder / "text.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in records))
    text.write_text("".join(json.dumps({"text": r["question"] + joiner + r["answer"]}) + "\n" for r in records))
    return qa, text, records


def batches(source: SourceConfig, tokenizer, count: int, seq_len: int = 24) -> list[dict[str, torch.Tensor]]:
    """The first `count` micro-batches of 4 rows of one reader, in stream order (no shuffling)."""
    cfg = DataConfig(sources=[source], seq_len=seq_len, shuffle_buffer=0, per_document_attention=True)
    validate_sources(cfg)
    loader = build_dataloader(cfg, tokenizer, micro_batch_size=4, dp_rank=0, dp_world_size=1, seed=0)
    stream = iter(loader)
    return [next(stream) for _ in range(count)]


def test_a_qa_source_with_all_labels_packs_as_the_same_plain_text(tmp_path):
    tokenizer = TOKENIZERS["tiny-3digit"]()
    qa, text, _ = qa_records(tmp_path, 60, template_space=False)
    tagged = batches(SourceConfig(path=str(qa), template="{question}{answer}"), tokenizer, 6)
    plain = batches(SourceConfig(path=str(text)), tokenizer, 6)
    for got, want in zip(tagged, plain, strict=True):
        assert got.keys() == want.keys() == {"input_ids", "labels", "position_ids"}
        for key in want:
            assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("template_space", [False, True])
def test_answer_labels_are_each_records_answer_and_its_eos(tmp_path, name, template_space):
    tokenizer = TOKENIZERS[name]()
    qa, _, records = qa_records(tmp_path, 40, template_space)
    template = "{question} {answer}" if template_space else "{question}{answer}"
    source = SourceConfig(path=str(qa), template=template, ce_labels="answer", ntl_labels="answer")
    stream = batches(source, tokenizer, 8)
    labels = torch.cat([batch["labels"].reshape(-1) for batch in stream])
    ntl_labels = torch.cat([batch["ntl_labels"].reshape(-1) for batch in stream])
    assert torch.equal(labels, ntl_labels)
    kept = labels[labels != IGNORE_INDEX].tolist()
    answers, current = [], []
    for token in kept:  # answers in stream order, each ended by EOS
        if token == tokenizer.eos_token_id:
            answers.append(tokenizer.decode(current).strip())
            current = []
        else:
            current.append(token)
    # blocks overlap by one token, so every label shows exactly once; the training stream cycles over the records
    assert len(answers) > len(records)
    assert answers == [record["answer"] for record in (records * 9)[: len(answers)]]


def test_ntl_on_answers_only_keeps_every_ce_label(tmp_path):
    tokenizer = TOKENIZERS["tiny-1digit"]()
    qa, _, _ = qa_records(tmp_path, 40, template_space=False)
    plain = batches(SourceConfig(path=str(qa), template="{question}{answer}"), tokenizer, 4)
    roles = batches(SourceConfig(path=str(qa), template="{question}{answer}", ntl_labels="answer"), tokenizer, 4)
    eos = tokenizer.eos_token_id
    for got, want in zip(roles, plain, strict=True):
        assert torch.equal(got["labels"], want["labels"])
        ntl_kept = got["ntl_labels"] != IGNORE_INDEX
        assert torch.equal(got["ntl_labels"][ntl_kept], want["labels"][ntl_kept])
        # each row's NTL labels are the labels after an "=" up to and including the EOS
        for input_row, label_row, kept_row in zip(want["input_ids"], want["labels"], ntl_kept, strict=True):
            in_answer, expected = False, []
            for token, label in zip(input_row.tolist(), label_row.tolist(), strict=True):
                in_answer = in_answer or tokenizer.decode([token]) == "="
                expected.append(in_answer and label != IGNORE_INDEX)
                in_answer = in_answer and label != eos
            assert kept_row.tolist() == expected


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"template": "{question} {answer}", "ce_labels": "answer", "answer_field": "reply"}, "answer_field"),
        ({"text_field": "text", "ntl_labels": "answer"}, "ntl_labels: 'answer' needs a Q/A source"),
        ({"template": "{q} {a}", "ce_labels": "answer"}, "ce_labels: 'answer' needs a Q/A source"),
    ],
)
def test_answer_roles_without_an_answer_are_refused(tmp_path, keys, message):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2", "q": "x", "a": "y", "text": "t"}) + "\n")
    with pytest.raises(ValueError, match=message):
        validate_sources(DataConfig(sources=[SourceConfig(path=str(path), **keys)]))


def test_validation_sources_take_no_label_roles(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    source = SourceConfig(path=str(path), template="{question}{answer}")
    held_out = SourceConfig(path=str(path), template="{question}{answer}", ce_labels="answer")
    with pytest.raises(ValueError, match="validation.0: ce_labels/ntl_labels apply to training sources"):
        validate_sources(DataConfig(sources=[source], validation=[held_out]))


def role_labels(labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CE and NTL labels from one set: each ignores labels the other keeps (as answer-only roles do)."""
    draw = torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed))
    return labels.masked_fill(draw < 0.3, IGNORE_INDEX), labels.masked_fill(draw > 0.7, IGNORE_INDEX)


def reference(logits_NV, ce_labels, ntl_labels, nv, kind) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-position CE from the CE labels and NTL from the NTL labels."""
    ce_N, _ = reference_rows(logits_NV, ce_labels, nv, kind, False)
    _, ntl_N = reference_rows(logits_NV, ntl_labels, nv, kind, False)
    return ce_N, ntl_N


@pytest.mark.parametrize("kind", KINDS)
def test_dense_losses_follow_the_masks_with_the_reference_gradient(kind):
    nv = synthetic_vocab()
    logits, labels = make_batch(nv, "mixed", seed=3, shape=(4, 9))
    ce_labels, ntl_labels = role_labels(labels, seed=3)
    ours = logits.clone().requires_grad_(True)
    out = ce_ntl_loss(ours, ce_labels, nv, kind=kind, reduction="none", ntl_labels=ntl_labels)
    (out.ce.sum() + 0.3 * out.ntl.sum()).backward()
    theirs = logits.clone().requires_grad_(True)
    ce_N, ntl_N = reference(theirs.view(-1, nv.vocab_size), ce_labels, ntl_labels, nv, kind)
    (ce_N.sum() + 0.3 * ntl_N.sum()).backward()

    assert bool((out.ce[ce_labels == IGNORE_INDEX] == 0).all())
    if kind != "number":  # a number's loss sits at its first position
        assert bool((out.ntl[ntl_labels == IGNORE_INDEX] == 0).all())
    assert float(out.ntl.detach().abs().sum()) > 0
    assert float(out.ce.detach()[ntl_labels == IGNORE_INDEX].abs().sum()) > 0  # CE where NTL is off
    assert_close_relative(out.ce.reshape(-1), ce_N, 1e-9, f"{kind} ce")
    assert_close_relative(out.ntl.reshape(-1), ntl_N, 1e-9, f"{kind} ntl")
    assert_close_relative(ours.grad, theirs.grad, 1e-9, f"{kind} grad")
    mean = ce_ntl_loss(logits, ce_labels, nv, kind=kind, reduction="mean", ntl_labels=ntl_labels)
    assert int(mean.num_tokens) == int((ce_labels != IGNORE_INDEX).sum())
    assert int(mean.num_number_tokens) == count_ntl_terms(ntl_labels, nv, kind)


def test_ntl_labels_equal_to_the_labels_change_nothing():
    nv = synthetic_vocab()
    logits, labels = make_batch(nv, "mixed", seed=5, shape=(3, 7))
    for kind in KINDS:
        plain = ce_ntl_loss(logits, labels, nv, kind=kind, reduction="none")
        same = ce_ntl_loss(logits, labels, nv, kind=kind, reduction="none", ntl_labels=labels.clone())
        assert torch.equal(plain.ce, same.ce) and torch.equal(plain.ntl, same.ntl), kind


def test_ntl_labels_that_name_another_token_are_refused():
    nv = synthetic_vocab()
    logits, labels = make_batch(nv, "all_numbers", seed=1)
    with pytest.raises(RuntimeError, match="ntl_labels must equal labels"):
        ce_ntl_loss(logits, labels, nv, ntl_labels=(labels + 1) % nv.vocab_size)


def chunked_case(kind: str, group=None, bounds=None) -> None:
    """linear_ce_ntl_loss (whole, or this rank's vocabulary rows with `group`) against the float64 reference."""
    nv = synthetic_vocab()
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(4, 9, 6, generator=generator, dtype=torch.float64)
    weight = torch.randn(nv.vocab_size, 6, generator=generator, dtype=torch.float64)
    _, labels = make_batch(nv, "mixed", seed=7, shape=(4, 9))
    ce_labels, ntl_labels = role_labels(labels, seed=7)
    lo, hi = (0, nv.vocab_size) if group is None else (bounds[dist.get_rank()], bounds[dist.get_rank() + 1])
    h, w = hidden.clone().requires_grad_(True), weight[lo:hi].clone().requires_grad_(True)
    out = linear_ce_ntl_loss(h, w, ce_labels, nv, kind=kind, reduction="sum", chunk_size=5, group=group,
                             vocab_start=lo, ntl_labels=ntl_labels)  # fmt: skip
    out.loss.backward()
    if group is not None:
        dist.all_reduce(h.grad, group=group)  # each shard's hidden gradient is its share
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ce_N, ntl_N = reference((h_ref @ w_ref.T).view(-1, nv.vocab_size), ce_labels, ntl_labels, nv, kind)
    (ce_N.sum() + 0.3 * ntl_N.sum()).backward()
    assert_close_relative(out.ce, ce_N.sum(), 1e-9, f"{kind} chunked ce")
    assert_close_relative(out.ntl, ntl_N.sum(), 1e-9, f"{kind} chunked ntl")
    assert_close_relative(h.grad, h_ref.grad, 1e-9, f"{kind} chunked hidden grad")
    assert_close_relative(w.grad, w_ref.grad[lo:hi], 1e-9, f"{kind} chunked weight grad")


@pytest.mark.parametrize("kind", ["was", "mse", "number"])
def test_chunked_head_follows_the_masks(kind):
    chunked_case(kind)


def sharded_cases() -> None:
    """Both vocabulary-parallel paths, on uneven shards: the kernel on logits, and the chunked linear head."""
    nv, rank = synthetic_vocab(), dist.get_rank()
    bounds = BOUNDARIES[dist.get_world_size()]
    for kind in KINDS:
        logits, labels = make_batch(nv, "mixed", seed=2, shape=(4, 9))
        ce_labels, ntl_labels = role_labels(labels, seed=2)
        local = logits[..., bounds[rank] : bounds[rank + 1]].clone().requires_grad_(True)
        out = ce_ntl_loss(local, ce_labels, nv, kind=kind, reduction="none", group=dist.group.WORLD,
                          vocab_start=bounds[rank], ntl_labels=ntl_labels)  # fmt: skip
        (out.ce.sum() + 0.3 * out.ntl.sum()).backward()
        full = logits.clone().requires_grad_(True)
        ce_N, ntl_N = reference(full.view(-1, nv.vocab_size), ce_labels, ntl_labels, nv, kind)
        (ce_N.sum() + 0.3 * ntl_N.sum()).backward()
        assert_close_relative(out.ce.reshape(-1), ce_N, 1e-9, f"{kind} sharded ce")
        assert_close_relative(out.ntl.reshape(-1), ntl_N, 1e-9, f"{kind} sharded ntl")
        assert_close_relative(local.grad, full.grad[..., bounds[rank] : bounds[rank + 1]], 1e-9, f"{kind} grad")
        chunked_case(kind, dist.group.WORLD, bounds)


@pytest.mark.slow
def test_vocab_parallel_losses_follow_the_masks():
    run_distributed(sharded_cases, 2)


def test_a_resume_that_changes_the_label_roles_is_refused(tmp_path):
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.train.resume_guard import data_differences, write_data_fingerprint

    study = REPO / "recipes" / "study" / "3digit"
    everywhere, answers = load_recipe(study / "ntl-was.yaml"), load_recipe(study / "ntl-was-answer.yaml")
    write_data_fingerprint(tmp_path, everywhere)
    assert data_differences(tmp_path, {}, everywhere) == []
    (difference,) = data_differences(tmp_path, {}, answers)
    assert difference.key == "data.sources[addition].label_roles"
    assert (difference.saved, difference.wanted) == (None, {"answer": "answer", "ce": "all", "ntl": "answer"})


def test_val_answer_metrics_are_ce_and_ntl_at_each_answer_given_its_question(tmp_path):
    """`validation_metrics` packs the records into one block (per-document attention); the reference runs each
    record alone and scores the labels from its answer's first digit to its EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ntl_pretrain.evaluation.validation import validation_metrics
    from ntl_pretrain.numbers import NumberVocab

    tokenizer = TOKENIZERS["tiny-1digit"]()
    qa, _, records = qa_records(tmp_path, 30, template_space=False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    model = LlamaForCausalLM(config).double().eval()
    source = SourceConfig(path=str(qa), template="{question}{answer}")
    got = validation_metrics(model, tokenizer, [source], seq_len=400, per_document_attention=True)

    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=config.vocab_size)
    ce, ntl, ntl_digits, tokens, number_tokens = 0.0, 0.0, 0.0, 0, 0
    for record in records:
        question = tokenizer(record["question"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(record["answer"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([question + answer + [tokenizer.eos_token_id]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(question) - 1 : -1]
        labels = ids[0, len(question) :]
        ce_N, ntl_N = reference_rows(logits, labels, nv, "was", False)
        ce, ntl = ce + float(ce_N.sum()), ntl + float(ntl_N.sum())
        ntl_digits += float(reference_rows(logits, labels, nv, "digits", False)[1].sum())
        tokens, number_tokens = tokens + len(labels), number_tokens + count_ntl_terms(labels, nv, "was")
    assert got["val_answer_tokens"] == tokens == sum(len(r["answer"]) + 1 for r in records)
    assert got["val_answer_ce"] == pytest.approx(ce / tokens, rel=1e-9)
    assert got["val_answer_ntl_was"] == pytest.approx(ntl / number_tokens, rel=1e-9)
    assert got["val_answer_ntl_digits"] == pytest.approx(ntl_digits / number_tokens, rel=1e-9)
    assert got["val_answer_ce"] != pytest.approx(got["val_ce"], rel=1e-3)  # all labels score otherwise
