"""Per-position label facts (`Targets`) from the labels: which positions CE and NTL apply to, the label's column in
this shard, and, for number labels, class, value, scale and reweighing cap.

Legend: N positions, V token ids of the vocabulary, D digit columns.

The per-token facts sit in tables built once per (vocabulary, kind, dtype, device) and reused (`label_tables`),
so a call gathers them with a few indexing ops instead of rebuilding them from the vocabulary: index -1 of each
table is the entry of a position without a number label.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ntl_pretrain.numbers import NumberShard, NumberVocab

# Reweighing charges mass outside the class slightly more than the worst in-class prediction (as ntloss does).
REWEIGH_MARGIN = 1.01


@dataclass(frozen=True)
class Targets:
    """Per-position label facts, all [N]."""

    valid: torch.Tensor  # bool: label is not ignore_index
    is_number: torch.Tensor  # bool: label is a number token (and NTL is on)
    column: torch.Tensor  # int64: label's column in this shard (0 when not owned)
    owned: torch.Tensor  # bool: this shard holds the label's column
    target: torch.Tensor  # int64: label's column in this shard, -1 when not owned (what the Triton kernels take)
    number_class: torch.Tensor  # int64: label's class, -1 when not a number
    value: torch.Tensor  # compute dtype: label's value y (0 when not a number)
    scale: torch.Tensor  # compute dtype: label's scale s (kind digits: its digit count k; 1 when not a number)
    cap: torch.Tensor  # compute dtype: reweigh constant c of the label's class (0 when not a number)
    digits: torch.Tensor  # compute dtype [N, D]: label's digits for kind digits ([N, 0] for the other kinds)


def loss_of_error(error: torch.Tensor, kind: str) -> torch.Tensor:
    """NTL of a prediction `error` scale units away from the label (WAS and MAE: |e|)."""
    if kind == "mse":
        return error.square()
    if kind == "huber":
        return torch.where(error.abs() < 1, 0.5 * error.square(), error.abs() - 0.5)
    return error.abs()


def make_targets(
    labels_N: torch.Tensor,
    shard: NumberShard,
    kind: str | None,
    ignore_index: int,
    vocab_start: int,
    num_columns: int,
    dtype: torch.dtype,
    ntl_labels_N: torch.Tensor | None = None,
    sharded: bool = False,
) -> Targets:
    """CE where `labels_N` is not `ignore_index`; NTL where `ntl_labels_N` (default: `labels_N`) is a number token.
    Where both are set they are the same token (packing.make_batch ignores one or the other, never changes it).
    `sharded`: this shard holds columns [vocab_start, vocab_start + num_columns) of a larger vocabulary."""
    labels_N = labels_N.long()
    valid = labels_N != ignore_index
    labelled = torch.where(valid, labels_N, -1)
    if sharded:
        column = labels_N - vocab_start
        owned = valid & (column >= 0) & (column < num_columns)
        target = torch.where(owned, column, -1)
    else:
        owned, target = valid, labelled
    if ntl_labels_N is not None:
        labelled = torch.where(ntl_labels_N != ignore_index, ntl_labels_N.long(), -1)
    if kind is None:  # every position reads the entry -1: no gather, views of it
        tables = _no_number_tables(dtype, labels_N.device)
        number_class, digits = tables.classes.expand(len(labels_N)), tables.digits.expand(len(labels_N), 0)
        value, scale, cap = tables.facts.expand(-1, len(labels_N)).unbind(0)
    else:
        tables = label_tables(shard, kind, dtype, labels_N.device)
        number_class, digits = tables.classes[labelled], tables.digits[labelled]
        value, scale, cap = tables.facts[:, labelled].unbind(0)
    return Targets(
        valid=valid,
        is_number=number_class >= 0,
        column=target.clamp_min(0),
        owned=owned,
        target=target,
        number_class=number_class,
        value=value,
        scale=scale,
        cap=cap,
        digits=digits,
    )


@dataclass(frozen=True)
class LabelTables:
    """Per token id, then one entry (index -1) for a position whose NTL label is not a number or ignored."""

    classes: torch.Tensor
    """int64 [V + 1]: the token's class, -1 for other tokens."""
    facts: torch.Tensor
    """compute dtype [3, V + 1]: value (0 for other tokens), scale (1; kind digits: the class's digit count), cap."""
    digits: torch.Tensor
    """compute dtype [V + 1, D]: the token's digits for kind digits, else [V + 1, 0]."""


_TABLES: dict[tuple, tuple[weakref.ref, LabelTables]] = {}


def label_tables(shard: NumberShard, kind: str, dtype: torch.dtype, device: torch.device) -> LabelTables:
    """The tables of `shard`'s vocabulary for `kind` in `dtype`, built once and reused while the vocabulary lives
    (NumberVocab keeps one copy per device)."""
    key = (id(shard.vocab), kind, dtype, device)
    cached = _TABLES.get(key)
    if cached is None or cached[0]() is not shard.vocab:
        tables = _build_tables(shard.vocab, shard.class_spread, kind, dtype)
        cached = (weakref.ref(shard.vocab, lambda _, key=key: _TABLES.pop(key, None)), tables)
        _TABLES[key] = cached
    return cached[1]


def _build_tables(vocab: NumberVocab, class_spread: torch.Tensor, kind: str, dtype: torch.dtype) -> LabelTables:
    is_number = vocab.classes >= 0
    number_class = vocab.classes.clamp_min(0)
    zeros = torch.zeros(vocab.vocab_size, dtype=dtype, device=vocab.classes.device)
    value = torch.where(is_number, vocab.values.to(dtype), zeros)
    if kind == "digits":  # reweigh is refused with digits, so its cap is never read
        scale = torch.where(is_number, vocab.class_digits[number_class].to(dtype), zeros + 1)
        digits = torch.where(is_number[:, None], vocab.digits.to(dtype), 0.0)
    else:
        scale = torch.where(is_number, vocab.scales.to(dtype), zeros + 1)
        digits = zeros.new_zeros(vocab.vocab_size, 0)
    spread = class_spread.to(dtype)[number_class]
    cap = torch.where(is_number, REWEIGH_MARGIN * loss_of_error(spread, kind), zeros)
    empty = _no_number_tables(dtype, vocab.classes.device)
    return LabelTables(
        classes=torch.cat([vocab.classes, empty.classes]),
        facts=torch.cat([torch.stack([value, scale, cap]), empty.facts], dim=1),
        digits=torch.cat([digits, empty.digits.new_zeros(1, digits.shape[1])]),
    )


@functools.cache
def _no_number_tables(dtype: torch.dtype, device: torch.device) -> LabelTables:
    """The entry of a position without a number label: class -1, value 0, scale 1, cap 0, no digits."""
    facts = torch.zeros(3, 1, dtype=dtype, device=device)
    facts[1] = 1  # made on the device: no host-to-device copy (which waits for the device)
    return LabelTables(
        classes=torch.full((1,), -1, dtype=torch.int64, device=device),
        facts=facts,
        digits=torch.zeros(1, 0, dtype=dtype, device=device),
    )
