"""Validation CE, perplexity and NTL of an HF causal LM on held-out sources.

The held-out sources are packed exactly as the trainer packs them (`ntl_pretrain.data`, split "validation": each
source on its own, with the run's `seq_len` and `per_document_attention`), and the model runs as the trainer ran
it: restarting position ids, no attention mask and no KV cache, the mode in which transformers keeps sdpa and
eager attention inside each packed document (docs/data.md). So `val_ce`, `val_ntl` (of the run's NTL kind) and
`val_number_ce` equal the trainer's over the whole split. NTL is measured with a fixed kind (WAS by default)
whatever the model was trained with, so a CE-only model gets an NTL too, and so are the digit-wise NTL
(`val_ntl_digits`) and the number-level NTL (`val_ntl_number`, integers: `float_level` off), which every model gets
beside the chosen kind. A Q/A source (one with an answer field, docs/data.md) also gets CE and NTL at its answer
labels alone (`val_answer_ce`, `val_answer_ntl_<kind>`, `val_answer_ntl_digits`): the answer's tokens and its EOS,
teacher-forced after the question, where the operands' random digits do not dilute them. With a process group
every rank reads its blocks (the loader gives every rank equally many batches) and the sums are all-reduced.

Shapes: B micro-batch, T sequence, V model vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ntl_pretrain.data import build_dataloader
from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.packing import IGNORE_INDEX
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

MICRO_BATCH = 8
"""Sequences per forward of `ntl-pretrain eval`'s validation (memory only: the sums do not depend on it)."""
MEASURED_BESIDE = ("digits", "number")
"""NTL kinds every model is measured with beside the chosen one, whatever it trained with: the digit-wise distance
(the near misses the class-scaled kinds barely see on multi-digit tokens) and the whole-number error."""
ANSWER_KINDS_BESIDE = ("digits",)
"""Of those, the ones also measured at the answer labels alone."""


def validation_metrics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[SourceConfig],
    *,
    seq_len: int,
    micro_batch_size: int = MICRO_BATCH,
    max_sequences: int | None = None,
    ntl_kind: str = "was",
    per_document_attention: bool = False,
) -> dict[str, float]:
    """`val_ce`, `val_perplexity`, `val_ntl_<kind>`, `val_ntl_digits`, `val_ntl_number`, `val_tokens`,
    `val_number_tokens`, `val_numbers` and `val_number_ce` (CE where the label is a number token: where NTL acts, and
    where it may trade CE for closer numbers; per number token), with Q/A sources `val_answer_ce`,
    `val_answer_ntl_<kind>`, `val_answer_ntl_digits` and `val_answer_tokens`, over all sources and ranks, and with
    several sources the same per source as `val/<source>/ce` etc. (e.g. prose apart from arithmetic).
    Each source is packed on its own, as in the trainer; `max_sequences`: only the first N packed sequences of the
    split, its sources in order (`sequence_cap`: what the trainer's `train.eval_max_batches` evaluates);
    `per_document_attention`: the run's `data.per_document_attention`. Call on every rank.
    """
    was_training = model.training
    model.eval()
    try:
        number_vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
        per_source, left = {}, max_sequences
        for source in sources:
            data = DataConfig(sources=[source], validation=[source], seq_len=seq_len,
                              per_document_attention=per_document_attention)  # fmt: skip
            per_source[source.label], taken = _source_sums(
                model, tokenizer, data, number_vocab, micro_batch_size, left, ntl_kind
            )
            left = None if left is None else left - taken
    finally:
        model.train(was_training)
    answers = {source.label: source.answer is not None for source in sources}
    overall = {name: sum(sums[name] for sums in per_source.values()) for name in _total_names(ntl_kind)}
    metrics = _summary(overall, "val_", ntl_kind, any(answers.values()))
    if len(per_source) > 1:
        for label, sums in per_source.items():
            if sums["tokens"]:  # a source the cap left out has no metrics of its own, rather than a CE of 0
                metrics.update(_summary(sums, f"val/{label}/", ntl_kind, answers[label]))
    return metrics


def sequence_cap(max_batches: int | None, micro_batch_size: int, ranks: int) -> int | None:
    """The packed sequences `train.eval_max_batches: max_batches` evaluates: each of the `ranks` takes every
    `ranks`-th sequence of the split (`data.pipeline.validation_batches`) and evaluates its first `max_batches`
    micro-batches of `micro_batch_size`, so together they cover its first `max_batches × micro_batch_size × ranks`
    sequences, sources in order."""
    return None if max_batches is None else max_batches * micro_batch_size * ranks


def _source_sums(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    number_vocab: NumberVocab,
    micro_batch_size: int,
    max_sequences: int | None,
    ntl_kind: str,
) -> tuple[dict[str, float], int]:
    """The sums `_batch_totals` names over the first `max_sequences` packed sequences (all when None) of `data`'s
    one validation source, on all ranks; and how many sequences that was."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    loader = build_dataloader(
        data,
        tokenizer,
        micro_batch_size=micro_batch_size,
        dp_rank=rank,
        dp_world_size=world,
        seed=0,
        split="validation",
    )
    names = _total_names(ntl_kind)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)  # the last: sequences evaluated
    limit = math.inf if max_sequences is None else max_sequences
    with torch.no_grad():
        for index, batch in enumerate(loader):
            # This rank's rows are the sequences rank, rank + world, ... of the source (`validation_batches`).
            sequence_B = rank + world * (index * micro_batch_size + torch.arange(batch["labels"].shape[0]))
            kept_B = sequence_B < limit
            if not kept_B.any():
                break
            batch = {key: value[kept_B] for key, value in batch.items()}
            logits_BTV = packed_forward(model, batch["input_ids"], batch["position_ids"])
            totals = _batch_totals(logits_BTV, batch["labels"].to(model.device), batch, number_vocab, ntl_kind)
            sums[:-1] += torch.stack([totals[name] for name in names]).double().cpu()
            sums[-1] += (batch["labels"] != IGNORE_INDEX).any(dim=1).sum()  # a padding row (the split's end) has none
    if world > 1:
        dist.all_reduce(sums)
    return dict(zip(names, sums[:-1].tolist(), strict=True)), int(sums[-1])


def measured_kinds(ntl_kind: str) -> tuple[str, ...]:
    """The chosen kind, then those of MEASURED_BESIDE that it is not."""
    return (ntl_kind, *(kind for kind in MEASURED_BESIDE if kind != ntl_kind))


def _answer_kinds(ntl_kind: str) -> tuple[str, ...]:
    return tuple(kind for kind in measured_kinds(ntl_kind) if kind == ntl_kind or kind in ANSWER_KINDS_BESIDE)


def _total_names(ntl_kind: str) -> list[str]:
    """What `_batch_totals` sums, in a fixed order (every rank all-reduces the same vector)."""
    names = ["ce", "tokens", "number_tokens", "number_ce", "answer_ce", "answer_tokens"]
    names += [f"{name}_{kind}" for kind in measured_kinds(ntl_kind) for name in ("ntl", "terms")]
    return names + [f"{name}_{kind}" for kind in _answer_kinds(ntl_kind) for name in ("answer_ntl", "answer_terms")]


def _batch_totals(logits_BTV, labels_BT, batch, number_vocab, ntl_kind) -> dict[str, torch.Tensor]:
    """One micro-batch's sums: CE and label tokens; number-label tokens and the CE at them; per measured kind its
    summed NTL and NTL terms (number-label tokens, or numbers); the same at the answer labels (zeros without)."""
    out = ce_ntl_loss(logits_BTV, labels_BT, number_vocab, kind=ntl_kind, ntl_weight=1.0, reduction="none")
    is_number_V = (number_vocab.classes >= 0).to(labels_BT.device)
    at_number_BT = (labels_BT != -100) & is_number_V[labels_BT.clamp_min(0)]
    totals = {"ce": out.ce.sum(), "tokens": out.num_tokens, "number_tokens": at_number_BT.sum(),
              "number_ce": torch.where(at_number_BT, out.ce, 0.0).sum()}  # fmt: skip
    for kind in measured_kinds(ntl_kind):
        measured = out if kind == ntl_kind else ce_ntl_loss(logits_BTV, labels_BT, number_vocab, kind=kind,
                                                              reduction="sum")  # fmt: skip
        totals |= {f"ntl_{kind}": measured.ntl.sum(), f"terms_{kind}": measured.num_number_tokens}
    answer_mask_BT = batch.get("answer_mask", torch.zeros_like(labels_BT, dtype=torch.bool)).to(labels_BT.device)
    answer_labels_BT = torch.where(answer_mask_BT, labels_BT, -100)
    for kind in _answer_kinds(ntl_kind):
        answer = ce_ntl_loss(logits_BTV, answer_labels_BT, number_vocab, kind=kind, ntl_weight=1.0, reduction="sum")
        totals |= {f"answer_ntl_{kind}": answer.ntl, f"answer_terms_{kind}": answer.num_number_tokens}
    # the answer CE is the same whatever the kind: the last call's
    return totals | {"answer_ce": answer.ce, "answer_tokens": answer.num_tokens}


def packed_forward(model: PreTrainedModel, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of packed rows as the trainer computes them. `use_cache=False` matters: with a cache (the
    exported config keeps `use_cache: true` for generation) transformers skips the packed-sequence mask it builds
    from restarting position ids, and attention would cross document boundaries."""
    device = model.device
    return model(input_ids=input_ids_BT.to(device), position_ids=position_ids_BT.to(device), use_cache=False).logits


def _summary(sums: dict[str, float], prefix: str, ntl_kind: str, answers: bool) -> dict[str, float]:
    mean_ce = sums["ce"] / max(sums["tokens"], 1.0)
    answer_metrics = {
        f"{prefix}answer_ce": sums["answer_ce"] / max(sums["answer_tokens"], 1.0),
        **{f"{prefix}answer_ntl_{kind}": sums[f"answer_ntl_{kind}"] / max(sums[f"answer_terms_{kind}"], 1.0)
           for kind in _answer_kinds(ntl_kind)},
        f"{prefix}answer_tokens": sums["answer_tokens"],
    }  # fmt: skip
    return {
        **(answer_metrics if answers else {}),
        f"{prefix}ce": mean_ce,
        f"{prefix}perplexity": math.exp(mean_ce),
        **{f"{prefix}ntl_{kind}": sums[f"ntl_{kind}"] / max(sums[f"terms_{kind}"], 1.0) for kind in
           measured_kinds(ntl_kind)},
        f"{prefix}tokens": sums["tokens"],
        f"{prefix}number_tokens": sums["number_tokens"],
        f"{prefix}numbers": sums["terms_number"],
        f"{prefix}number_ce": sums["number_ce"] / max(sums["number_tokens"], 1.0),
    }  # fmt: skip
