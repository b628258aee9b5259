"""CE + NTL per position in float64, vectorised, written from design.md's definition (not from fused.py).

Shared by the vocabulary-parallel and chunked-head tests: autograd through this gives the reference gradients.
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


def reference_rows(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, nv: NumberVocab | None, kind: str | None, reweigh: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE [N], NTL [N]) in float64, zero where they do not apply; ignore_index is -100."""
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
    else:
        ntl_N = loss_of_error(((q_NV * values_V[None, :]).sum(1) - y_N) / s_N, kind)
    if reweigh:
        largest = values_V.masked_fill(~members_NV, -math.inf).amax(1)
        smallest = values_V.masked_fill(~members_NV, math.inf).amin(1)
        worst_N = loss_of_error((largest - smallest) / s_N, kind)
        mass_N = torch.exp(torch.logsumexp(class_z_NV, 1) - lse_N)
        ntl_N = ntl_N * mass_N + REWEIGH_MARGIN * worst_N * (1 - mass_N)
    return ce_N, torch.where(is_number_N, ntl_N, 0.0)


def reduce_rows(ce_N: torch.Tensor, ntl_N: torch.Tensor, labels_N: torch.Tensor, nv, kind, reduction: str):
    """(CE, NTL) reduced like ce_ntl_loss: "mean" over non-ignored / number-label positions, "sum", or "none"."""
    if reduction == "none":
        return ce_N, ntl_N
    if reduction == "sum":
        return ce_N.sum(), ntl_N.sum()
    valid_N = labels_N != -100
    num_numbers = 0 if kind is None else int((nv.classes[torch.where(valid_N, labels_N, 0)] >= 0)[valid_N].sum())
    return ce_N.sum() / max(1, int(valid_N.sum())), ntl_N.sum() / max(1, num_numbers)


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, relative: float, what: str) -> None:
    """Elementwise within `relative` of the value, or of the tensor's largest magnitude for entries near zero."""
    actual, expected = actual.detach(), expected.detach().double()
    floor = relative * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double(), expected, rtol=relative, atol=floor + 1e-12, msg=lambda m: f"{what}: {m}"
    )
