"""`ce_ntl_loss`: the training objective CE + λ·NTL on logits, dense or sharded by vocabulary."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from ntl_pretrain.loss.backend import resolve_backend
from ntl_pretrain.loss.fused import FusedCeNtl, TritonCeNtlLoss, compute_dtype
from ntl_pretrain.loss.number_level import find_number_spans
from ntl_pretrain.loss.targets import make_targets
from ntl_pretrain.numbers import NumberShard, NumberVocab

VALUE_KINDS = ("was", "mse", "mae", "huber")
"""Kinds that judge a number token by its value (scaled by its class): the ones `reweigh` applies to."""
TOKEN_KINDS = (*VALUE_KINDS, "digits")
KINDS = (*TOKEN_KINDS, "number")
"""Token-level kinds judge each number token ("digits" digit by digit, the others by its value); "number" judges
whole numbers across their tokens (number_level.py)."""
UNWEIGHABLE_KINDS = {"number": "it weighs single tokens", "digits": "its distance has no class value range"}
"""Kinds that refuse `reweigh`, and why."""
REDUCTIONS = ("mean", "sum", "none")
DEFAULT_NTL_WEIGHT = 0.3
"""λ when none is given (the paper's and the recipes' default)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """ce + ntl_weight * ntl."""
    ce: torch.Tensor
    """Cross-entropy: mean over non-ignored positions, their sum, or per position (0 where ignored)."""
    ntl: torch.Tensor
    """Number Token Loss: mean over number-label positions, their sum, or per position (0 elsewhere). Kind
    "number": one term per number, at its first position; "mean" divides by the count of numbers."""
    num_tokens: torch.Tensor
    """int64 scalar: positions whose label is not ignore_index."""
    num_number_tokens: torch.Tensor
    """int64 scalar: how many NTL terms: positions whose label is a number token (0 when kind is None), or with kind
    "number" how many numbers."""
    number_ce: torch.Tensor
    """Detached cross-entropy at the number-label positions only (where NTL acts, so where CE it costs shows),
    reduced like `ntl` (with kind "number", "mean" gives the CE of a whole number's tokens per number)."""


def ce_ntl_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    nv: NumberVocab | None,
    kind: str | None = "was",
    ntl_weight: float = DEFAULT_NTL_WEIGHT,
    reweigh: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    group: torch.distributed.ProcessGroup | None = None,
    vocab_start: int = 0,
    float_level: bool = False,
    ntl_labels: torch.Tensor | None = None,
    backend: str = "auto",
    **deprecated,
) -> LossOutput:
    """Cross-entropy plus `ntl_weight` (λ) times the Number Token Loss of `kind` (was|mse|mae|huber|digits|number, or
    None for CE only). "digits" is WAS over the digits of a multi-digit token: sum_j q_j (1/k) sum_i |d_j[i] - d_t[i]|,
    so a near miss in any digit costs as much as on a single-digit token (docs/loss.md); on single digits it is
    "was". "number" is one loss per whole number across its tokens, along the last dimension of `labels`;
    `float_level` lets one decimal point join two runs of number labels into one number (number_level.py).
    `ntl_labels` (shaped like `labels`): where NTL applies, when that differs from where CE does (loss on answers
    only, packing.py); each position's label is then ignored in one of them or the same token in both.

    `logits` [..., V] (fp32/bf16/fp16; math runs in fp32, fp64 stays fp64) and `labels` [...] are aligned
    position by position: shift them before calling for next-token prediction. With `group`, `logits` holds the
    columns [vocab_start, vocab_start + V) of the vocabulary `nv` describes and every rank of the group gets the
    loss of the full vocabulary; each rank's gradient covers its own columns. "mean" divides by this call's
    counts (a batch without number labels has ntl = 0); to normalise over a global batch, take "sum" and divide
    by the counts summed over it. `backend`: "torch", "triton" (Triton kernels; CUDA) or "auto" (backend.py).
    `weight=` is the old name of `ntl_weight` (deprecated: one name for λ here and in `linear_ce_ntl_loss`).
    """
    ntl_weight = renamed_ntl_weight(ntl_weight, deprecated)
    logits_NV, targets, shard, spans, backend = _prepared(
        logits, labels, nv, kind, reduction, ignore_index, group, vocab_start, reweigh, ntl_labels, float_level, backend
    )
    ce_N, ntl_N = FusedCeNtl.apply(logits_NV, targets, shard, kind, reweigh, group, spans, backend)
    num_tokens = targets.valid.sum()
    num_number_tokens = targets.is_number.sum() if spans is None else spans.count
    number_ce_N = torch.zeros_like(ce_N) if kind is None else torch.where(targets.is_number, ce_N.detach(), 0.0)
    if reduction == "none":
        ce, ntl, number_ce = ce_N.view(labels.shape), ntl_N.view(labels.shape), number_ce_N.view(labels.shape)
    elif reduction == "sum":
        ce, ntl, number_ce = ce_N.sum(), ntl_N.sum(), number_ce_N.sum()
    else:
        numbers = num_number_tokens.clamp_min(1)
        ce, ntl, number_ce = ce_N.sum() / num_tokens.clamp_min(1), ntl_N.sum() / numbers, number_ce_N.sum() / numbers
    return LossOutput(ce + ntl_weight * ntl, ce, ntl, num_tokens, num_number_tokens, number_ce)


def ce_ntl_training_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    nv: NumberVocab | None,
    kind: str | None = "was",
    ntl_weight: float = DEFAULT_NTL_WEIGHT,
    reweigh: bool = False,
    ignore_index: int = -100,
    float_level: bool = False,
    ntl_labels: torch.Tensor | None = None,
    num_tokens: torch.Tensor | float | None = None,
    num_number_tokens: torch.Tensor | float | None = None,
    backend: str = "auto",
) -> LossOutput:
    """`ce_ntl_loss` as a training step takes it: loss = ΣCE / num_tokens + λ·ΣNTL / num_number_tokens (the global
    batch's counts, each taken as at least 1; None: no division), and only `loss` differentiable; `ce`, `ntl` and
    `number_ce` are detached sums. The Triton backend forms d loss / d logits in this call, reading the logits once
    for it, and keeps that gradient instead of the logits (one [N, V] buffer; `TritonCeNtlLoss`); the torch backend
    computes it in backward, as `ce_ntl_loss` does. The other arguments as in `ce_ntl_loss`."""
    logits_NV, targets, shard, spans, backend = _prepared(logits, labels, nv, kind, "sum", ignore_index, None, 0,
                                                          reweigh, ntl_labels, float_level, backend)  # fmt: skip
    num_ntl_terms = targets.is_number.sum() if spans is None else spans.count
    dtype = compute_dtype(logits)
    g_ce_N = _row_weights(1.0, num_tokens, targets.valid, dtype)
    g_ntl_N = _row_weights(ntl_weight, num_number_tokens, targets.valid, dtype)
    if backend == "triton":
        loss, ce_N, ntl_N = TritonCeNtlLoss.apply(logits_NV, targets, shard, kind, reweigh, spans, g_ce_N, g_ntl_N)
    else:
        ce_N, ntl_N = FusedCeNtl.apply(logits_NV, targets, shard, kind, reweigh, None, spans, backend)
        loss = (g_ce_N * ce_N).sum() + (g_ntl_N * ntl_N).sum()
        ce_N, ntl_N = ce_N.detach(), ntl_N.detach()
    number_ce = torch.where(targets.is_number, ce_N, 0.0).sum()
    return LossOutput(loss, ce_N.sum(), ntl_N.sum(), targets.valid.sum(), num_ntl_terms, number_ce)


def _row_weights(numerator: float, count, like_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """numerator / count (count at least 1; None: the numerator alone), as the per-row weight [N] of the loss."""
    weight = torch.as_tensor(numerator, dtype=dtype, device=like_N.device)
    if count is not None:
        weight = weight / torch.as_tensor(count, device=like_N.device).clamp_min(1).to(dtype)
    return weight.expand(like_N.shape)


def _prepared(logits, labels, nv, kind, reduction, ignore_index, group, vocab_start, reweigh, ntl_labels, float_level,
              backend):  # fmt: skip
    """The checked arguments as `FusedCeNtl` takes them: (logits [N, V], targets, shard, number spans, backend)."""
    check_loss_arguments(logits, labels, nv, kind, reduction, ignore_index, group, vocab_start, reweigh, ntl_labels)
    backend = resolve_backend(backend, logits.device, logits.dtype)
    num_columns = logits.shape[-1]
    logits_NV = logits.reshape(-1, num_columns)
    shard = nv.shard(vocab_start, vocab_start + num_columns, logits.device) if kind else no_number_shard(logits.device)
    ntl_labels_N = None if ntl_labels is None else ntl_labels.reshape(-1)
    targets = make_targets(labels.reshape(-1), shard, kind, ignore_index, vocab_start, num_columns,
                           compute_dtype(logits), ntl_labels_N, sharded=group is not None)  # fmt: skip
    number_labels = labels if ntl_labels is None else ntl_labels
    spans = find_number_spans(number_labels, nv, ignore_index, float_level) if kind == "number" else None
    return logits_NV, targets, shard, spans, backend


def renamed_ntl_weight(ntl_weight: float, deprecated: dict) -> float:
    """λ from `ntl_weight`, or from the keyword `weight` it replaced (a DeprecationWarning for one release: accepted
    through version 0.2, gone after); any other keyword is the TypeError Python gives an unknown one."""
    unknown = sorted(set(deprecated) - {"weight"})
    if unknown:
        raise TypeError(f"ce_ntl_loss() got an unexpected keyword argument {unknown[0]!r}")
    if "weight" not in deprecated:
        return ntl_weight
    if ntl_weight != DEFAULT_NTL_WEIGHT:
        raise TypeError("ce_ntl_loss() got both ntl_weight= and its deprecated name weight=; pass ntl_weight= only")
    message = "ce_ntl_loss(weight=) is deprecated: λ is `ntl_weight=`, as in linear_ce_ntl_loss"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return deprecated["weight"]


@functools.cache
def no_number_shard(device: torch.device) -> NumberShard:
    """The shard a CE-only loss (kind=None) runs with: no number columns, so the class work is empty."""
    empty = torch.zeros(0, device=device)
    return NumberShard(vocab=None, local_ids=empty.long(), values=empty, classes=empty.long(), class_spread=empty,
                       digits=empty.view(0, 0))  # fmt: skip


def check_loss_arguments(
    logits, labels, nv, kind, reduction, ignore_index, group, vocab_start, reweigh=False, ntl_labels=None
) -> None:
    """Raise an error that says what was expected for any argument `ce_ntl_loss` cannot take."""
    if ntl_labels is not None:
        if ntl_labels.shape != labels.shape:
            raise ValueError(f"ntl_labels {tuple(ntl_labels.shape)} must have labels' shape {tuple(labels.shape)}")
        torch._assert_async(
            ((ntl_labels == labels) | (ntl_labels == ignore_index) | (labels == ignore_index)).all(),
            "ntl_labels must equal labels wherever neither is ignore_index",
        )
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    if kind in UNWEIGHABLE_KINDS and reweigh:
        raise ValueError(f"reweigh is not defined for kind={kind!r} ({UNWEIGHABLE_KINDS[kind]})")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 (or int32) token ids, got {labels.dtype}")
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have the leading shape of logits [..., V]: logits {tuple(logits.shape)} "
            f"needs labels {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if kind is not None:
        if nv is None:
            raise ValueError(f"kind={kind!r} needs a NumberVocab (nv); pass kind=None for cross-entropy only")
        nv.require_numbers()
    vocab_size = nv.vocab_size if nv is not None else None
    if group is None:
        if vocab_start != 0:
            raise ValueError("vocab_start is only meaningful with a vocabulary-parallel group")
        if vocab_size is not None and logits.shape[-1] != vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} columns but the NumberVocab describes {vocab_size} "
                f"tokens; build it with NumberVocab.from_tokenizer(tok, vocab_size={logits.shape[-1]})"
            )
    elif vocab_size is not None and not 0 <= vocab_start < vocab_start + logits.shape[-1] <= vocab_size:
        raise ValueError(
            f"shard [{vocab_start}, {vocab_start + logits.shape[-1]}) is outside the {vocab_size}-token "
            f"vocabulary of the NumberVocab"
        )
    # A sharded rank knows the full vocabulary size only through nv; without nv it can check the lower bound.
    upper = vocab_size if vocab_size is not None else (None if group is not None else logits.shape[-1])
    in_range = labels >= 0 if upper is None else (labels >= 0) & (labels < upper)
    # An async assert: no host sync on accelerators (torch.compile-friendly); on CPU it raises at once.
    torch._assert_async(
        (in_range | (labels == ignore_index)).all(),
        f"labels must be token ids in [0, {upper}) or ignore_index={ignore_index}",
    )
