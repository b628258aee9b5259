"""Validation CE, perplexity and NTL of an HF causal LM on held-out sources.

The held-out sources are packed exactly as the trainer packs them (`ntl_pretrain.data`, split "validation": each
source on its own, with the run's `seq_len` and `per_document_attention`), and the model runs as the trainer ran
it: restarting position ids, no attention mask and no KV cache, the mode in which transformers keeps sdpa and
eager attention inside each packed document (docs/data.md). So `val_ce`, `val_ntl` (of the run's NTL kind) and
`val_number_ce` equal the trainer's over the whole split. NTL is measured with a fixed kind (WAS by default)
whatever the model was trained with, so a CE-only model gets an NTL too, and so is the number-level NTL
(`val_ntl_number`, integers: `float_level` off), which every model gets beside the chosen kind. A Q/A source (one
with an answer field, docs/data.md) also gets CE and NTL at its answer labels alone (`val_answer_ce`,
`val_answer_ntl_<kind>`): the answer's tokens and its EOS, teacher-forced after the question, where the operands'
random digits do not dilute them. With a process group every rank reads its blocks (the loader gives every rank
equally many batches) and the sums are all-reduced.

Shapes: B micro-batch, T sequence, V model vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ntl_pretrain.data import build_dataloader
from ntl_pretrain.data.config import DataConfig, SourceConfig
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab


def validation_metrics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[SourceConfig],
    *,
    seq_len: int,
    micro_batch_size: int = 8,
    max_batches: int | None = None,
    ntl_kind: str = "was",
    per_document_attention: bool = False,
) -> dict[str, float]:
    """`val_ce`, `val_perplexity`, `val_ntl_<kind>`, `val_ntl_number`, `val_tokens`, `val_number_tokens`, `val_numbers`
    and `val_number_ce` (CE where the label is a number token: where NTL acts, and where it may trade CE for closer
    numbers; per number token), with Q/A sources `val_answer_ce`, `val_answer_ntl_<kind>` and `val_answer_tokens`,
    over all
    sources and ranks, and with several sources the same per source as `val/<source>/ce` etc. (e.g. prose apart
    from arithmetic).
    Each source is packed on its own, as in the trainer; `max_batches` caps each source's micro-batches per rank;
    `per_document_attention`: the run's `data.per_document_attention`. Call on every rank.
    """
    was_training = model.training
    model.eval()
    try:
        number_vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
        per_source = {}
        for source in sources:
            data = DataConfig(sources=[source], validation=[source], seq_len=seq_len,
                              per_document_attention=per_document_attention)  # fmt: skip
            per_source[source.label] = _source_sums(
                model, tokenizer, data, number_vocab, micro_batch_size, max_batches, ntl_kind
            )
    finally:
        model.train(was_training)
    answers = {source.label: source.answer is not None for source in sources}
    metrics = _summary(sum(per_source.values()), "val_", ntl_kind, any(answers.values()))
    if len(per_source) > 1:
        for label, sums in per_source.items():
            metrics.update(_summary(sums, f"val/{label}/", ntl_kind, answers[label]))
    return metrics


def _source_sums(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    number_vocab: NumberVocab,
    micro_batch_size: int,
    max_batches: int | None,
    ntl_kind: str,
) -> torch.Tensor:
    """float64 [11]: summed CE, summed NTL, label tokens, number-label tokens, summed CE at number labels, summed
    number-level NTL, numbers, then summed CE, label tokens, summed NTL and NTL terms at the answer labels (0 for a
    source without answers) of `data`'s one validation source over all ranks."""
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
    sums = torch.zeros(11, dtype=torch.float64)
    is_number_V = (number_vocab.classes >= 0).to(model.device)
    with torch.no_grad():
        for index, batch in enumerate(loader):
            if max_batches is not None and index == max_batches:
                break
            logits_BTV = packed_forward(model, batch["input_ids"], batch["position_ids"])
            labels_BT = batch["labels"].to(model.device)
            out = ce_ntl_loss(logits_BTV, labels_BT, number_vocab, kind=ntl_kind, weight=1.0, reduction="none")
            at_number_BT = (labels_BT != -100) & is_number_V[labels_BT.clamp_min(0)]
            number_ce = torch.where(at_number_BT, out.ce, 0.0).sum()
            whole = out  # the number-level NTL, whatever the chosen kind
            if ntl_kind != "number":
                whole = ce_ntl_loss(logits_BTV, labels_BT, number_vocab, kind="number", reduction="sum")
            totals = [out.ce.sum(), out.ntl.sum(), out.num_tokens, at_number_BT.sum(), number_ce,
                      whole.ntl.sum(), whole.num_number_tokens]  # fmt: skip
            totals += _answer_totals(logits_BTV, labels_BT, batch, number_vocab, ntl_kind)
            sums += torch.stack(totals).double().cpu()
    if world > 1:
        dist.all_reduce(sums)
    return sums


def _answer_totals(logits_BTV, labels_BT, batch, number_vocab, ntl_kind) -> list[torch.Tensor]:
    """[summed CE, label tokens, summed NTL, NTL terms] at the batch's answer labels (zeros when it has none)."""
    if "answer_mask" not in batch:
        return [torch.zeros((), dtype=torch.float64, device=labels_BT.device)] * 4
    answer_labels_BT = torch.where(batch["answer_mask"].to(labels_BT.device), labels_BT, -100)
    out = ce_ntl_loss(logits_BTV, answer_labels_BT, number_vocab, kind=ntl_kind, weight=1.0, reduction="sum")
    return [out.ce, out.num_tokens, out.ntl, out.num_number_tokens]


def packed_forward(model: PreTrainedModel, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of packed rows as the trainer computes them. `use_cache=False` matters: with a cache (the
    exported config keeps `use_cache: true` for generation) transformers skips the packed-sequence mask it builds
    from restarting position ids, and attention would cross document boundaries."""
    device = model.device
    return model(input_ids=input_ids_BT.to(device), position_ids=position_ids_BT.to(device), use_cache=False).logits


def _summary(sums: torch.Tensor, prefix: str, ntl_kind: str, answers: bool) -> dict[str, float]:
    ce, ntl, tokens, number_tokens, number_ce, ntl_number, numbers, *answer_sums = sums.tolist()
    mean_ce = ce / max(tokens, 1.0)
    answer_ce, answer_tokens, answer_ntl, answer_ntl_terms = answer_sums
    answer_metrics = {
        f"{prefix}answer_ce": answer_ce / max(answer_tokens, 1.0),
        f"{prefix}answer_ntl_{ntl_kind}": answer_ntl / max(answer_ntl_terms, 1.0),
        f"{prefix}answer_tokens": answer_tokens,
    }
    return {
        **(answer_metrics if answers else {}),
        f"{prefix}ce": mean_ce,
        f"{prefix}perplexity": math.exp(mean_ce),
        f"{prefix}ntl_{ntl_kind}": ntl / max(numbers if ntl_kind == "number" else number_tokens, 1.0),
        f"{prefix}ntl_number": ntl_number / max(numbers, 1.0),
        f"{prefix}tokens": tokens,
        f"{prefix}number_tokens": number_tokens,
        f"{prefix}numbers": numbers,
        f"{prefix}number_ce": number_ce / max(number_tokens, 1.0),
    }
