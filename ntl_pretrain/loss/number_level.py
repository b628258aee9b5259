"""Number-level NTL (issue 12): one relative-error loss per whole number, assembled across its tokens.

A number is a maximal run of consecutive positions (along the last dim of `labels`) whose labels are number
tokens. A token with a word-start marker (space, `Ġ`, `▁`) starts a new number; in a WordPiece vocabulary (one
with `##` number tokens) a number continues only through `##` tokens. With e_t the digits in the number's later
tokens, ŷ = Σ_t ŷ_t·10^e_t where ŷ_t is the expected value under the softmax over the label's number class, and
y = Σ_t value(label_t)·10^e_t. Loss per number: |ŷ − y| / (|ŷ| + |y| + eps), eps = float32 epsilon (as ntloss).

Spans come from cumulative sums and scatter reductions: no host syncs. The assembly runs in float64, so numbers
up to 15 digits are exact; longer ones are rounded (relative error ~1e-16), not overflowed, up to 308 digits.
This module is the dense reference form; it is not yet wired into `ce_ntl_loss` or the trainer.
"""

from __future__ import annotations

import torch

from ntl_pretrain.numbers import NumberVocab

EPS = torch.finfo(torch.float32).eps


def token_tables(nv: NumberVocab, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class: digit count [C] (int64) and whether its tokens continue a number [C] (bool); plus the class
    of each token [V]. In a WordPiece vocabulary only `##` continues; otherwise only unmarked tokens do."""
    markers = [c.marker for c in nv.class_info]
    wordpiece = "wordpiece" in markers
    continues = [m == "wordpiece" if wordpiece else m == "none" for m in markers]
    digits = torch.tensor([c.digits for c in nv.class_info], dtype=torch.int64, device=device)
    return digits, torch.tensor(continues, dtype=torch.bool, device=device), nv.classes.to(device)


def find_spans(labels: torch.Tensor, nv: NumberVocab, ignore_index: int = -100):
    """For flattened positions: (is_number [N] bool, starts [N] bool, span [N] int64 index of each number
    position's number (-1 elsewhere), later_digits [N] int64 e_t, count of numbers as a 0-d int64 tensor)."""
    digits_C, continues_C, classes_V = token_tables(nv, labels.device)
    valid = labels != ignore_index
    cls = torch.where(valid, classes_V[labels.clamp_min(0)], -1)
    is_number = cls >= 0
    safe_cls = cls.clamp_min(0)
    previous_is_number = torch.zeros_like(is_number)
    previous_is_number[..., 1:] = is_number[..., :-1]  # never across rows: position 0 of a row starts afresh
    starts = (is_number & ~(previous_is_number & continues_C[safe_cls])).reshape(-1)
    is_number = is_number.reshape(-1)
    digits = torch.where(is_number, digits_C[safe_cls].reshape(-1), 0)
    span = torch.where(is_number, torch.cumsum(starts.long(), 0) - 1, -1)
    count = starts.sum()
    cumulative = torch.cumsum(digits, 0)
    # e_t = (digits up to the number's end) - (digits up to t): the end is base + total of the number.
    num_spans = labels.numel()  # upper bound on the count, so no host sync is needed for sizes
    safe_span = span.clamp_min(0)
    total = torch.zeros(num_spans, dtype=torch.int64, device=labels.device).index_add_(0, safe_span, digits)
    base = torch.zeros(num_spans, dtype=torch.int64, device=labels.device).index_add_(
        0, safe_span, torch.where(starts, cumulative - digits, 0)
    )
    later_digits = torch.where(is_number, base[safe_span] + total[safe_span] - cumulative, 0)
    return is_number, starts, span, later_digits, count


def expected_token_values(logits_NV: torch.Tensor, labels_N: torch.Tensor, nv: NumberVocab) -> torch.Tensor:
    """ŷ_t [N] float64: expected value under the softmax over each position's label class (0 off numbers)."""
    classes_V = nv.classes.to(logits_NV.device)
    values_V = nv.values.to(logits_NV.device)
    label_cls = torch.where(labels_N >= 0, classes_V[labels_N.clamp_min(0)], -1)
    out = torch.zeros(labels_N.shape, dtype=torch.float64, device=logits_NV.device)
    for c in range(len(nv.class_info)):  # a handful of classes; the loop is over the vocabulary's classes only
        members = torch.nonzero(classes_V == c).flatten()
        probs = torch.softmax(logits_NV[:, members].double(), dim=-1)
        out = torch.where(label_cls == c, probs @ values_V[members].double(), out)
    return out


def number_losses(logits: torch.Tensor, labels: torch.Tensor, nv: NumberVocab, ignore_index: int = -100):
    """(per-number loss at each number's first position [...] float64, 0 elsewhere; count of numbers)."""
    labels_N = labels.reshape(-1)
    logits_NV = logits.reshape(-1, logits.shape[-1])
    is_number, starts, span, later_digits, count = find_spans(labels, nv, ignore_index)
    safe_span = span.clamp_min(0)
    place = torch.pow(10.0, later_digits.double())
    predicted_t = torch.where(is_number, expected_token_values(logits_NV, labels_N, nv) * place, 0.0)
    values_V = nv.values.to(logits.device).double()
    target_t = torch.where(is_number, values_V[labels_N.clamp_min(0)].nan_to_num(0.0) * place, 0.0)
    zeros = torch.zeros(labels_N.numel(), dtype=torch.float64, device=logits.device)
    predicted = zeros.index_add(0, safe_span, predicted_t)
    target = zeros.index_add(0, safe_span, target_t)
    per_number = (predicted - target).abs() / (predicted.abs() + target.abs() + EPS)
    loss_N = torch.where(starts, per_number[safe_span], 0.0)
    return loss_N.view(labels.shape), count


def count_numbers(labels: torch.Tensor, nv: NumberVocab, ignore_index: int = -100) -> torch.Tensor:
    """0-d int64: how many numbers the labels hold (the normaliser of the number-level NTL)."""
    return find_spans(labels, nv, ignore_index)[4]
