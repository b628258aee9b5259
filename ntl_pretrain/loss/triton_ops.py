"""The Triton backend's host side: the number tables its kernels read, and their launches (triton_kernels.py).

Legend: N rows, V columns of this shard, K its number-token columns (NumberShard order), M the same K tokens
sorted by class, D digit columns, C classes of the vocabulary.

Imported only when the backend runs (backend.py), so a CPU install without triton never imports it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import triton

from ntl_pretrain.loss import triton_kernels as kernels
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberShard

FEATURES = {"was": kernels.VALUE_DISTANCE.value, "digits": kernels.DIGIT_DISTANCE.value}
"""The kernels' f_j per kind; the others (mse, mae, huber, number) take the value."""
MAX_BLOCK_V = 32768  # Liger-Kernel's row block: few loop trips per row, all of it in registers of 32 warps
MAX_BLOCK_M = 1024  # the largest class of a 1-3-digit tokenizer (1,000 three-digit chunks) in one trip
MAX_WARPS = 32


@dataclass(frozen=True)
class NumberTables:
    """One shard's number tokens as the kernels read them: sorted by class for the class sums of a row, and per
    column for the gradient, which walks every column of the row."""

    member_columns: torch.Tensor
    """int32 [M]: the number-token columns, sorted by class (stable)."""
    member_numbers: torch.Tensor
    """int32 [M]: the same tokens' positions among the shard's K number columns (the [N, K] logits' columns)."""
    member_values: torch.Tensor
    """float32 [M]: their values."""
    member_digits: torch.Tensor
    """uint8 [D, M]: their digits."""
    class_bounds: torch.Tensor
    """int64 [C + 1]: class c's members are [class_bounds[c], class_bounds[c + 1])."""
    largest_class: int
    """Members of the largest class (its block of the class loop)."""
    column_classes: torch.Tensor
    """int32 [V]: each column's class, -1 for a token that is not a number."""
    column_values: torch.Tensor
    """float32 [V]: each column's value (0 for other tokens)."""
    column_digits: torch.Tensor
    """uint8 [D, V]: each column's digits (0 for other tokens)."""


_TABLES: dict[tuple[int, int], tuple[weakref.ref, NumberTables]] = {}


def number_tables(shard: NumberShard, num_columns: int) -> NumberTables:
    """The tables of `shard` (a shard of `num_columns` columns), built once per shard and reused while it lives
    (NumberVocab.shard keeps one per range and device)."""
    key = (id(shard), num_columns)
    cached = _TABLES.get(key)
    if cached is None or cached[0]() is not shard:
        cached = (weakref.ref(shard, lambda _, key=key: _TABLES.pop(key, None)), _build_tables(shard, num_columns))
        _TABLES[key] = cached
    return cached[1]


def _build_tables(shard: NumberShard, num_columns: int) -> NumberTables:
    order = torch.argsort(shard.classes, stable=True)
    counts = torch.bincount(shard.classes, minlength=len(shard.vocab.class_info))
    digits_KD = shard.digits.to(torch.uint8)
    column_classes = torch.full((num_columns,), -1, dtype=torch.int32, device=shard.classes.device)
    column_classes[shard.local_ids] = shard.classes.int()
    column_values = torch.zeros(num_columns, dtype=torch.float32, device=shard.values.device)
    column_values[shard.local_ids] = shard.values.float()
    column_digits = torch.zeros(digits_KD.shape[1], num_columns, dtype=torch.uint8, device=digits_KD.device)
    column_digits[:, shard.local_ids] = digits_KD.T
    return NumberTables(
        member_columns=shard.local_ids[order].int(),
        member_numbers=order.int(),
        member_values=shard.values[order].float(),
        member_digits=digits_KD[order].T.contiguous(),
        class_bounds=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
        largest_class=int(counts.max()) if counts.numel() else 0,
        column_classes=column_classes,
        column_values=column_values,
        column_digits=column_digits,
    )


def row_partials(
    logits_NV: torch.Tensor,
    target_N: torch.Tensor | None,
    classes: ClassRows | None,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor | None, ...]:
    """Per row of `logits_NV` (any float dtype, columns contiguous): with `target_N` (int64 column, -1 where not
    held) its log-sum-exp and target logit; with `classes`, over the label's class: its log-sum-exp (-inf when this
    shard holds none of it) and Σ_j q_j f_j. Returns (lse, target_logit, class_lse, feature_mean), None for what
    was not asked."""
    logits_NV = _columns_contiguous(logits_NV)
    rows = logits_NV.shape[0]
    ce, with_classes = target_N is not None, classes is not None
    lse, target_logit, class_lse, feature_mean = (
        logits_NV.new_empty(rows, dtype=torch.float32) if asked else None
        for asked in (ce, ce, with_classes, with_classes)
    )
    if rows == 0:
        return lse, target_logit, class_lse, feature_mean
    unused = _unused(logits_NV.device)
    c = classes or ClassRows.absent(unused)
    block_v = _block(logits_NV.shape[1], MAX_BLOCK_V)
    kernels.row_partials_kernel[(rows,)](
        logits_NV, logits_NV.stride(0), logits_NV.shape[1],
        unused if target_N is None else target_N, _or(lse, unused), _or(target_logit, unused),
        c.lo, c.hi, c.members, c.member_values, c.member_digits, c.member_count,
        c.label_value, c.label_digits, _or(class_lse, unused), _or(feature_mean, unused),
        transform.scale, transform.softcap or 1.0,
        CE=ce, CLASSES=with_classes, FEATURE=c.feature, DIGITS=c.digits,
        SCALED=transform.scale != 1.0, SOFTCAPPED=transform.softcap is not None,
        BLOCK_V=block_v, BLOCK_M=_block(c.largest_class, MAX_BLOCK_M), num_warps=_warps(block_v),
    )  # fmt: skip
    return lse, target_logit, class_lse, feature_mean


@dataclass(frozen=True)
class ClassRows:
    """Per row, the label's class among a table's members, and the label's features (what f_j compares with)."""

    lo: torch.Tensor
    """int64 [N]: first member of the label's class (lo == hi: none, or the label is not a number)."""
    hi: torch.Tensor
    members: torch.Tensor
    """int32 [M]: the members' columns in the logits the kernel reads."""
    member_values: torch.Tensor
    member_digits: torch.Tensor
    member_count: int
    label_value: torch.Tensor
    """float32 [N]."""
    label_digits: torch.Tensor
    """float32 [N, D] (kind digits), else [N, 0]."""
    largest_class: int
    feature: int
    digits: int

    @classmethod
    def of(cls, number_class_N, value_N, digits_ND, tables: NumberTables, kind: str, members: torch.Tensor):
        """The rows of labels of class `number_class_N` (-1: not a number) against `tables`, whose members are at
        the columns `members` (tables.member_columns for the logits, tables.member_numbers for [N, K] ones)."""
        is_number = number_class_N >= 0
        number_class = number_class_N.clamp_min(0)
        bounds = tables.class_bounds
        lo = torch.where(is_number, bounds[number_class], 0)
        hi = torch.where(is_number, bounds[number_class + 1], 0)
        digits = digits_ND.shape[1] if kind == "digits" else 0
        return cls(lo, hi, members, tables.member_values, tables.member_digits, members.numel(), _f32(value_N),
                   _f32(digits_ND), tables.largest_class, FEATURES.get(kind, 0), digits)  # fmt: skip

    @classmethod
    def absent(cls, unused: torch.Tensor) -> ClassRows:
        return cls(unused, unused, unused, unused, unused, 0, unused, unused, 0, 0, 0)


@dataclass(frozen=True)
class NumberGradRows:
    """Per row, what the NTL term of the gradient needs: d loss / d z_j += q_j (alpha f_j + beta) on the label's
    class (fused.py's number_coefficients)."""

    number_class: torch.Tensor
    """int64 [N], -1 where the label is not a number."""
    class_lse: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    label_value: torch.Tensor
    label_digits: torch.Tensor
    """float32 [N, D] (kind digits), else [N, 0]."""


def logits_grad(
    logits_NV: torch.Tensor,
    grad_NV: torch.Tensor,
    lse_N: torch.Tensor,
    softmax_weight_N: torch.Tensor,
    target_N: torch.Tensor,
    target_grad_N: torch.Tensor,
    numbers: NumberGradRows | None,
    tables: NumberTables | None,
    kind: str | None,
    transform: LogitTransform = IDENTITY,
) -> None:
    """Write d loss / d (raw logits) into `grad_NV` (may be `logits_NV` itself): softmax_weight·p_j, plus
    target_grad at column target (-1: none here), plus the NTL term of `numbers` (None: CE only), then the
    transform's chain rule."""
    logits_NV = _columns_contiguous(logits_NV)
    rows = logits_NV.shape[0]
    if rows == 0:
        return
    if grad_NV.stride(1) != 1:
        raise ValueError("logits_grad writes rows of contiguous columns")
    unused = _unused(logits_NV.device)
    n = numbers or NumberGradRows(unused, unused, unused, unused, unused, unused)
    digits = n.label_digits.shape[1] if kind == "digits" and numbers is not None else 0
    block_v = _block(logits_NV.shape[1], MAX_BLOCK_V)
    kernels.logits_grad_kernel[(rows,)](
        logits_NV, logits_NV.stride(0), grad_NV, grad_NV.stride(0), logits_NV.shape[1],
        _f32(lse_N), _f32(softmax_weight_N), target_N, _f32(target_grad_N),
        n.number_class, _f32(n.class_lse), _f32(n.alpha), _f32(n.beta), _f32(n.label_value), _f32(n.label_digits),
        unused if tables is None else tables.column_classes, unused if tables is None else tables.column_values,
        unused if tables is None else tables.column_digits,
        transform.scale, transform.softcap or 1.0,
        NUMBERS=numbers is not None, FEATURE=FEATURES.get(kind, 0), DIGITS=digits,
        SCALED=transform.scale != 1.0, SOFTCAPPED=transform.softcap is not None,
        BLOCK_V=block_v, num_warps=_warps(block_v),
    )  # fmt: skip


def _columns_contiguous(x_NV: torch.Tensor) -> torch.Tensor:
    return x_NV if x_NV.stride(1) == 1 else x_NV.contiguous()


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Per-row values as the kernels index them: fp32, contiguous (they are, but for a strided or fp16 caller's)."""
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


@functools.cache
def _unused(device: torch.device) -> torch.Tensor:
    """The pointer passed for an argument a kernel's constexpr flags leave unread."""
    return torch.empty(0, dtype=torch.float32, device=device)


def _or(x: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    return fallback if x is None else x


def _block(size: int, largest: int) -> int:
    return min(largest, triton.next_power_of_2(max(size, 1)))


def _warps(block: int) -> int:
    return max(4, min(MAX_WARPS, block // 1024))
