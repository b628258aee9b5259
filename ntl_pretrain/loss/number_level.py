"""Number-level NTL (`kind="number"`): one relative-error loss per whole number, assembled across its tokens.

Legend: N positions (the labels flattened; rows run along their last dimension), T positions of one row.

A number is a maximal run of consecutive positions of one row whose labels are number tokens. A token with a
word-start marker (space, `Ġ`, `▁`) starts a new number; an unmarked one continues the run (Llama-3 `"123","45"` is
12345; GPT-2 `"Ġ12","34"` is 1234); in a WordPiece vocabulary (one with `##` number tokens) only `##` continues.
Ignored and non-number labels end a number, and so does a row's end (a packed block's boundary). With
`float_level`, one decimal-point label between two number labels, the second one continuing, joins them and adds no
digits (`12.34` is the integer 1234, as in `ntloss`).

The fused kernels compute ŷ_t = Σ_{k∈C(t)} q_k v_k at every number position (the expectation MSE uses, with
unscaled values). With e_t the digits of the number's later tokens, ŷ = Σ_t ŷ_t·10^e_t, y = Σ_t v(label_t)·10^e_t
and the number's loss is L = |ŷ − y| / (|ŷ| + |y| + eps), eps = float32 epsilon as in `ntloss`, counted once, at
the number's first position. Its gradient reaches the class logits of position t through
dL/dŷ_t = dL/dŷ · 10^e_t, the `slope` this module hands the kernels: dL/dz_j = slope_t · q_j (v_j − ŷ_t).

Spans come from cumulative sums along the rows and index_add over positions: no Python loop over positions, no host
sync (arrays are sized N, an upper bound on the count of numbers). Assembly runs in float64: numbers of up to 15
digits are exact; longer ones are rounded to float64's 16 significant digits (their later digits then move the loss
less than float64 can show) and never overflow, because a number of more than `MAX_PLACE` digits is assembled
divided by 10^(digits − MAX_PLACE), which leaves its relative error as it is (eps is then negligible either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntl_pretrain.numbers import NumberVocab

EPS = torch.finfo(torch.float32).eps
# Numbers are assembled below 10^MAX_PLACE, so |ŷ| + |y| stays far from float64's largest value (1.8e308).
MAX_PLACE = 300


@dataclass(frozen=True)
class NumberSpans:
    """Where the numbers are among N flattened positions."""

    number: torch.Tensor
    """int64 [N]: index of the number each number position belongs to, -1 elsewhere (joined decimal points too)."""
    first: torch.Tensor
    """bool [N]: the position is a number's first token (where its loss is counted)."""
    place: torch.Tensor
    """float64 [N]: 10^e_t (divided by the number's 10^(digits − MAX_PLACE) when it is longer); 0 off numbers."""
    count: torch.Tensor
    """int64 scalar: how many numbers."""


def find_number_spans(
    labels: torch.Tensor, nv: NumberVocab, ignore_index: int = -100, float_level: bool = False
) -> NumberSpans:
    """The numbers in `labels` [..., T] (rows along the last dimension), for positions flattened in order."""
    nv = nv.to(labels.device)
    labels_RT = labels.reshape(-1, labels.shape[-1]) if labels.dim() else labels.reshape(1, 1)
    valid_RT = labels_RT != ignore_index
    safe_RT = torch.where(valid_RT, labels_RT, 0)
    class_RT = torch.where(valid_RT, nv.classes[safe_RT], -1)
    is_number_RT = class_RT >= 0
    continues_RT = is_number_RT & nv.class_continues[class_RT.clamp_min(0)]
    joined_RT = continues_RT & _shifted(is_number_RT, 1)
    if float_level:
        is_point_RT = valid_RT & nv.decimal_points[safe_RT]
        joined_RT |= continues_RT & _shifted(is_point_RT, 1) & _shifted(is_number_RT, 2)
    first_N = (is_number_RT & ~joined_RT).reshape(-1)
    is_number_N = is_number_RT.reshape(-1)
    number_N = torch.where(is_number_N, torch.cumsum(first_N, 0) - 1, -1)
    digits_N = torch.where(is_number_N, nv.class_digits[class_RT.clamp_min(0)].reshape(-1), 0)
    later_digits_N, total_digits_N = _later_digits(digits_N, number_N, first_N)
    exponent_N = later_digits_N - (total_digits_N - MAX_PLACE).clamp_min(0)
    place_N = torch.where(is_number_N, torch.pow(10.0, exponent_N.double()), 0.0)
    return NumberSpans(number_N, first_N, place_N, first_N.sum())


def _shifted(mask_RT: torch.Tensor, by: int) -> torch.Tensor:
    """mask_RT moved `by` positions later along each row (False where nothing precedes)."""
    out = torch.zeros_like(mask_RT)
    out[:, by:] = mask_RT[:, : mask_RT.shape[1] - by]
    return out


def _later_digits(digits_N, number_N, first_N) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: e_t, the digits of its number's later tokens, and the number's total digits."""
    safe_N = number_N.clamp_min(0)
    inclusive_N = torch.cumsum(digits_N, 0)
    total_S = torch.zeros_like(digits_N).index_add_(0, safe_N, digits_N)
    before_S = torch.zeros_like(digits_N).index_add_(0, safe_N, torch.where(first_N, inclusive_N - digits_N, 0))
    total_N = total_S[safe_N]
    return torch.where(number_N >= 0, before_S[safe_N] + total_N - inclusive_N, 0), total_N


def number_losses(
    expected_N: torch.Tensor, value_N: torch.Tensor, spans: NumberSpans
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N]: each number's L at its first position, 0 elsewhere; slope [N]: dL_number/dŷ_t at each number
    position, 0 elsewhere), both in expected_N's dtype, from ŷ_t (`expected_N`) and the label values y_t."""
    safe_N = spans.number.clamp_min(0)
    in_number_N = spans.number >= 0
    zeros_S = torch.zeros(safe_N.numel(), dtype=torch.float64, device=safe_N.device)
    predicted_S = zeros_S.index_add(0, safe_N, torch.where(in_number_N, expected_N.double() * spans.place, 0.0))
    target_S = zeros_S.index_add(0, safe_N, torch.where(in_number_N, value_N.double() * spans.place, 0.0))
    error_S = predicted_S - target_S
    total_S = predicted_S.abs() + target_S.abs() + EPS
    loss_S = error_S.abs() / total_S
    # d/dŷ of |ŷ − y| / (|ŷ| + |y| + eps), with torch's sign(0) = 0 for |·| at 0.
    slope_S = (error_S.sign() - loss_S * predicted_S.sign()) / total_S
    loss_N = torch.where(spans.first, loss_S[safe_N], 0.0)
    slope_N = torch.where(in_number_N, slope_S[safe_N] * spans.place, 0.0)
    return loss_N.to(expected_N.dtype), slope_N.to(expected_N.dtype)


def gradient_at_first(grad_N: torch.Tensor, spans: NumberSpans) -> torch.Tensor:
    """Per number position, the upstream gradient of its number's loss (given at the number's first position);
    0 elsewhere."""
    safe_N = spans.number.clamp_min(0)
    per_number_S = torch.zeros_like(grad_N).index_add_(0, safe_N, torch.where(spans.first, grad_N, 0.0))
    return torch.where(spans.number >= 0, per_number_S[safe_N], 0.0)


def count_numbers(
    labels: torch.Tensor, nv: NumberVocab, ignore_index: int = -100, float_level: bool = False
) -> torch.Tensor:
    """int64 scalar: how many numbers `labels` holds (the normaliser of the number-level NTL)."""
    return find_number_spans(labels, nv, ignore_index, float_level).count
