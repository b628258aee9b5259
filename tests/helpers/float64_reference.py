"""CE + NTL per position in float64, vectorised, written from the definition in docs/loss.md (not from fused.py).

Shared by the vocabulary-parallel and chunked-head tests: autograd through this gives the reference gradients.
The number-level kind walks each row of the labels in Python, one number at a time (not number_level.py's
cumulative sums), and assembles each number by Horner's rule.
Legend: N positions, V vocabulary.
"""

from __future__ import annotations

import math

import torch

from ntl_pretrain.numbers import NumberVocab

REWEIGH_MARGIN = 1.01


def loss_of_error(error: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "mse":
        return error**2
    if kind == "huber":
        return torch.where(error.abs() < 1, 0.5 * error**2, error.abs() - 0.5)
    return error.abs()


def reference_numbers(labels: torch.Tensor, nv: NumberVocab, float_level: bool = False) -> list[list[tuple[int, int]]]:
    """Each number in `labels` (rows along the last dimension) as its tokens' [(flat position, digits)]."""
    joining = "wordpiece" if any(c.marker == "wordpiece" for c in nv.class_info) else "none"
    rows = labels.reshape(-1, labels.shape[-1]).tolist()
    numbers = []
    for r, row in enumerate(rows):
        current, after_point = None, False  # the number the previous token belongs to; whether a point followed
        for t, label in enumerate(row):
            number_class = int(nv.classes[label]) if label != -100 else -1
            if number_class < 0:
                joins_next = float_level and label != -100 and bool(nv.decimal_points[label]) and not after_point
                current, after_point = (current, True) if joins_next and current is not None else (None, False)
                continue
            info = nv.class_info[number_class]
            if current is None or info.marker != joining:
                current = []
                numbers.append(current)
            current.append((r * len(row) + t, info.digits))
            after_point = False
    return numbers


def number_level_rows(expected_N: torch.Tensor, labels: torch.Tensor, nv: NumberVocab, float_level: bool):
    """Per position: each number's |ŷ − y| / (|ŷ| + |y| + eps) at its first position, 0 elsewhere."""
    labels_N = labels.reshape(-1)
    values = torch.nan_to_num(nv.values.double())
    losses = [expected_N.new_zeros(())] * labels_N.numel()
    for number in reference_numbers(labels, nv, float_level):
        predicted = target = 0.0
        for position, digits in number:
            predicted = predicted * 10.0**digits + expected_N[position]
            target = target * 10.0**digits + float(values[labels_N[position]])
        eps = float(torch.finfo(torch.float32).eps)
        losses[number[0][0]] = (predicted - target).abs() / (predicted.abs() + abs(target) + eps)
    return torch.stack(losses)


def reference_rows(
    logits_NV: torch.Tensor,
    labels: torch.Tensor,
    nv: NumberVocab | None,
    kind: str | None,
    reweigh: bool,
    float_level: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE [N], NTL [N]) in float64, zero where they do not apply; ignore_index is -100. `labels` [..., T] are the
    N positions' labels; the number-level kind reads numbers along their last dimension."""
    labels_N = labels.reshape(-1)
    z_NV = logits_NV.double()
    valid_N = labels_N != -100
    label_N = torch.where(valid_N, labels_N, 0)
    lse_N = torch.logsumexp(z_NV, 1)
    ce_N = torch.where(valid_N, lse_N - z_NV.gather(1, label_N[:, None]).squeeze(1), 0.0)
    if kind is None:
        return ce_N, torch.zeros_like(ce_N)
    class_N = torch.where(valid_N, nv.classes[label_N], -1)
    is_number_N = class_N >= 0
    # Rows without a number label look at the whole row, so that no softmax runs over an empty set (NaN gradients).
    members_NV = (nv.classes[None, :] == class_N[:, None]) | ~is_number_N[:, None]
    values_V = torch.nan_to_num(nv.values.double())
    y_N = values_V[label_N]
    s_N = torch.where(is_number_N, torch.nan_to_num(nv.scales.double(), nan=1.0)[label_N], 1.0)
    class_z_NV = z_NV.masked_fill(~members_NV, -math.inf)
    q_NV = torch.softmax(class_z_NV, 1)
    if kind == "was":
        ntl_N = (q_NV * (values_V[None, :] - y_N[:, None]).abs()).sum(1) / s_N
    elif kind == "digits":
        ntl_N = (q_NV * digit_distances(label_N, nv)).sum(1)
    elif kind == "number":
        ntl_N = number_level_rows((q_NV * values_V[None, :]).sum(1), labels, nv, float_level)
    else:
        ntl_N = loss_of_error(((q_NV * values_V[None, :]).sum(1) - y_N) / s_N, kind)
    if reweigh:
        largest = values_V.masked_fill(~members_NV, -math.inf).amax(1)
        smallest = values_V.masked_fill(~members_NV, math.inf).amin(1)
        worst_N = loss_of_error((largest - smallest) / s_N, kind)
        mass_N = torch.exp(torch.logsumexp(class_z_NV, 1) - lse_N)
        ntl_N = ntl_N * mass_N + REWEIGH_MARGIN * worst_N * (1 - mass_N)
    return ce_N, torch.where(is_number_N, ntl_N, 0.0)


def digit_distances(label_N: torch.Tensor, nv: NumberVocab) -> torch.Tensor:
    """[N, V] float64: (1/k) Σ_i |d_j[i] − d_t[i]| from each row's label t to every number token j of t's class
    (k digits each), 0 elsewhere; one class at a time, from the tokens' digit strings."""
    distance_NV = torch.zeros(label_N.numel(), nv.vocab_size, dtype=torch.float64)
    for number_class, info in enumerate(nv.class_info):
        members = (nv.classes == number_class).nonzero().flatten()
        rows = (nv.classes[label_N] == number_class).nonzero().flatten()
        if rows.numel() == 0:
            continue
        member_digits = nv.digits[members, : info.digits].double()
        label_digits = nv.digits[label_N[rows], : info.digits].double()
        distance = (label_digits[:, None, :] - member_digits[None, :, :]).abs().sum(2) / info.digits
        distance_NV[rows[:, None], members[None, :]] = distance
    return distance_NV


def reduce_rows(ce_N, ntl_N, labels: torch.Tensor, nv, kind, reduction: str, float_level: bool = False):
    """(CE, NTL) reduced like ce_ntl_loss: "mean" over non-ignored / number-label positions (numbers for the
    number-level kind), "sum", or "none"."""
    if reduction == "none":
        return ce_N, ntl_N
    if reduction == "sum":
        return ce_N.sum(), ntl_N.sum()
    num_terms = count_ntl_terms(labels, nv, kind, float_level)
    return ce_N.sum() / max(1, int((labels != -100).sum())), ntl_N.sum() / max(1, num_terms)


def count_ntl_terms(labels: torch.Tensor, nv, kind, float_level: bool = False) -> int:
    """Number-label positions, or numbers for the number-level kind (0 without NTL)."""
    if kind is None:
        return 0
    if kind == "number":
        return len(reference_numbers(labels, nv, float_level))
    valid = labels != -100
    return int((nv.classes[torch.where(valid, labels, 0)] >= 0)[valid].sum())


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, relative: float, what: str) -> None:
    """Elementwise within `relative` of the value, or of the tensor's largest magnitude for entries near zero."""
    actual, expected = actual.detach(), expected.detach().double()
    floor = relative * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double(), expected, rtol=relative, atol=floor + 1e-12, msg=lambda m: f"{what}: {m}"
    )
