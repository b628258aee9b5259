"""The Triton backend's host side: the number tables its kernels read, and their launches (triton_kernels.py).

Legend: N rows, V columns of this shard, K its number-token columns (NumberShard order), M the same K tokens
sorted by class, D digit columns, C classes of the vocabulary.

Imported only when the backend runs (backend.py), so a CPU install without triton never imports it.
"""

from __future__ import annotations

import dataclasses
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
    """One shard's number tokens as the kernels read them: sorted by class, so that a row's class is one range of
    members [lo, hi)."""

    member_columns: torch.Tensor
    """int32 [M]: the number-token columns, sorted by class (stable)."""
    member_numbers: torch.Tensor
    """int32 [M]: the same tokens' positions among the shard's K number columns (the [N, K] logits' columns)."""
    member_values: torch.Tensor
    """float32 [M]: their values."""
    member_digits: torch.Tensor
    """uint8 [D, M]: their digits."""
    class_starts: torch.Tensor
    """int64 [C + 1]: class c's members are [class_starts[c], class_ends[c]); the last entry, 0, is what a label of
    class -1 (not a number) reads, so that its range is empty."""
    class_ends: torch.Tensor
    largest_class: int
    """Members of the largest class (its block of the class loop)."""


_TABLES: dict[tuple[int, int], tuple[weakref.ref, NumberTables]] = {}


def number_tables(shard: NumberShard) -> NumberTables:
    """The tables of `shard`, built once per shard and reused while it lives (NumberVocab.shard keeps one per range
    and device)."""
    key = id(shard)
    cached = _TABLES.get(key)
    if cached is None or cached[0]() is not shard:
        cached = (weakref.ref(shard, lambda _, key=key: _TABLES.pop(key, None)), _build_tables(shard))
        _TABLES[key] = cached
    return cached[1]


def _build_tables(shard: NumberShard) -> NumberTables:
    order = torch.argsort(shard.classes, stable=True)
    counts = torch.bincount(shard.classes, minlength=len(shard.vocab.class_info))
    digits_KD = shard.digits.to(torch.uint8)
    return NumberTables(
        member_columns=shard.local_ids[order].int(),
        member_numbers=order.int(),
        member_values=shard.values[order].float(),
        member_digits=digits_KD[order].T.contiguous(),
        class_starts=torch.cat([counts.cumsum(0) - counts, counts.new_zeros(1)]),
        class_ends=torch.cat([counts.cumsum(0), counts.new_zeros(1)]),
        largest_class=int(counts.max()) if counts.numel() else 0,
    )


@dataclass(frozen=True)
class ClassRows:
    """Per row, the label's class as a range of `tables`' members, and the label's features (what f_j compares
    with); `members` maps the members to the columns of the logits a kernel reads."""

    lo: torch.Tensor
    """int64 [N]: first member of the label's class (lo == hi: none, or the label is not a number)."""
    hi: torch.Tensor
    label_value: torch.Tensor
    """float32 [N]."""
    label_digits: torch.Tensor
    """float32 [N, D] (kind digits), else [N, 0]."""
    tables: NumberTables
    members: torch.Tensor
    """int32 [M]: tables.member_columns for the logits, tables.member_numbers for [N, K] number-token logits."""
    feature: int
    digits: int

    @classmethod
    def of(cls, number_class_N, value_N, digits_ND, tables: NumberTables, kind: str, members: torch.Tensor):
        """The rows of labels of class `number_class_N` (-1: not a number) against `tables`, read at `members`."""
        lo, hi = tables.class_starts[number_class_N], tables.class_ends[number_class_N]  # class -1: the last entry
        digits = digits_ND.shape[1] if kind == "digits" else 0
        return cls(lo, hi, _f32(value_N), _f32(digits_ND), tables, members, FEATURES.get(kind, 0), digits)

    def reading(self, members: torch.Tensor) -> ClassRows:
        """The same rows read at other columns (the logits' instead of the [N, K] number-token logits')."""
        return dataclasses.replace(self, members=members)

    def rows(self, rows: slice) -> ClassRows:
        return dataclasses.replace(self, lo=self.lo[rows], hi=self.hi[rows], label_value=self.label_value[rows],
                                   label_digits=self.label_digits[rows])  # fmt: skip


def row_partials(
    logits_NV: torch.Tensor,
    target_N: torch.Tensor | None,
    classes: ClassRows | None,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor | None, ...]:
    """Per row of `logits_NV` (any float dtype and strides): with `target_N` (int64 column, -1 where not held) its
    log-sum-exp and target logit; with `classes`, over the label's class: its log-sum-exp (-inf when this shard
    holds none of it) and Σ_j q_j f_j. Returns (lse, target_logit, class_lse, feature_mean), None for what was not
    asked."""
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
    c = classes or _no_classes(unused)
    block_v = _block(logits_NV.shape[1], MAX_BLOCK_V)
    kernels.row_partials_kernel[(rows,)](
        logits_NV, logits_NV.stride(0), logits_NV.shape[1],
        _or(target_N, unused), _or(lse, unused), _or(target_logit, unused),
        c.lo, c.hi, c.members, c.tables.member_values, c.tables.member_digits, c.members.numel(),
        c.label_value, c.label_digits, _or(class_lse, unused), _or(feature_mean, unused),
        transform.scale, transform.softcap or 1.0,
        CE=ce, CLASSES=with_classes, FEATURE=c.feature, DIGITS=c.digits,
        SCALED=transform.scale != 1.0, SOFTCAPPED=transform.softcap is not None,
        BLOCK_V=block_v, BLOCK_M=_block(c.tables.largest_class, MAX_BLOCK_M), VECTOR=_vector(logits_NV),
        num_warps=_warps(block_v),
    )  # fmt: skip
    return lse, target_logit, class_lse, feature_mean


@dataclass(frozen=True)
class NumberGradRows:
    """Per row, what the NTL term of the gradient needs: d loss / d z_j += q_j (alpha f_j + beta) on the label's
    class (fused.py's number_coefficients)."""

    classes: ClassRows
    """The label's class, read at the logits' columns."""
    class_lse: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor


def logits_grad(
    logits_NV: torch.Tensor,
    grad_NV: torch.Tensor,
    lse_N: torch.Tensor,
    softmax_weight_N: torch.Tensor,
    target_N: torch.Tensor,
    target_grad_N: torch.Tensor,
    numbers: NumberGradRows | None,
    transform: LogitTransform = IDENTITY,
) -> None:
    """Write d loss / d (raw logits) into `grad_NV` (row-major; may be `logits_NV` itself, and a buffer sharing some
    of their memory otherwise is refused): softmax_weight·p_j, plus target_grad at column target (-1: none here),
    plus the NTL term of `numbers` (None: CE only), then the transform's chain rule."""
    _launch_grad(logits_NV, grad_NV, lse_N, None, softmax_weight_N, target_N, target_grad_N, numbers, transform)


def stats_and_grad(
    logits_NV: torch.Tensor,
    grad_NV: torch.Tensor,
    softmax_weight_N: torch.Tensor,
    target_N: torch.Tensor,
    target_grad_N: torch.Tensor,
    numbers: NumberGradRows | None,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_partials`' log-sum-exps and target logits and `logits_grad` into `grad_NV` (a buffer of its own, or the
    logits themselves), in one kernel: for rows whose per-row weights do not depend on their own log-sum-exps (no
    group to combine them over, no reweighing). Returns (lse, target_logit)."""
    rows = logits_NV.shape[0]
    lse_N, target_logit_N = (logits_NV.new_empty(rows, dtype=torch.float32) for _ in range(2))
    _launch_grad(logits_NV, grad_NV, lse_N, target_logit_N, softmax_weight_N, target_N, target_grad_N, numbers,
                 transform)  # fmt: skip
    return lse_N, target_logit_N


def scale_unless_one(x_NV: torch.Tensor, factor_1: torch.Tensor) -> None:
    """x *= factor (fp32 [1] on x's device) in place, without a host sync: a factor of exactly 1 reads and writes
    nothing of x."""
    if x_NV.numel() == 0:
        return
    block_v = _block(x_NV.shape[1], MAX_BLOCK_V)
    kernels.scale_unless_one_kernel[(x_NV.shape[0],)](
        x_NV, x_NV.stride(0), x_NV.shape[1], factor_1, BLOCK_V=block_v, VECTOR=_vector(x_NV), num_warps=_warps(block_v)
    )


def _launch_grad(logits_NV, grad_NV, lse_N, target_logit_N, softmax_weight_N, target_N, target_grad_N, numbers,
                 transform) -> None:  # fmt: skip
    """The gradient kernel; with `target_logit_N` (an output) it computes the log-sum-exps into `lse_N` first."""
    in_place = _same_view(grad_NV, logits_NV)
    if not in_place and _overlap(grad_NV, logits_NV):
        raise ValueError("logits_grad: the gradient buffer shares memory with the logits; pass a separate buffer, or "
                         "the logits tensor itself to write the gradient over them")  # fmt: skip
    if grad_NV.stride(1) != 1 or grad_NV.shape != logits_NV.shape:
        raise ValueError("logits_grad writes rows of contiguous columns, shaped as the logits")
    logits_NV = _columns_contiguous(logits_NV)
    rows = logits_NV.shape[0]
    if rows == 0:
        return
    unused = _unused(logits_NV.device)
    n = numbers or NumberGradRows(_no_classes(unused), unused, unused, unused)
    c = n.classes
    stash = unused
    if in_place and numbers is not None:  # the class members' logits, kept from the pass that overwrites them
        stash = torch.empty(rows, max(c.tables.largest_class, 1), dtype=torch.float32, device=logits_NV.device)
    block_v, vector = _block(logits_NV.shape[1], MAX_BLOCK_V), _vector(logits_NV)
    kernels.logits_grad_kernel[(rows,)](
        logits_NV, logits_NV.stride(0), grad_NV, grad_NV.stride(0), logits_NV.shape[1],
        lse_N, _or(target_logit_N, unused), _f32(softmax_weight_N), target_N, _f32(target_grad_N),
        c.lo, c.hi, _f32(n.class_lse), _f32(n.alpha), _f32(n.beta), c.label_value, c.label_digits,
        c.members, c.tables.member_values, c.tables.member_digits, c.members.numel(), stash, stash.stride(0),
        transform.scale, transform.softcap or 1.0,
        ROW_LSE=target_logit_N is not None, NUMBERS=numbers is not None, FEATURE=c.feature, DIGITS=c.digits,
        SCALED=transform.scale != 1.0, SOFTCAPPED=transform.softcap is not None, IN_PLACE=in_place,
        GRAD_ALIGNED=_aligned_alike(grad_NV, logits_NV, vector), BLOCK_V=block_v,
        BLOCK_M=_block(c.tables.largest_class, MAX_BLOCK_M), VECTOR=vector, num_warps=_warps(block_v),
    )  # fmt: skip


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements in the same layout (the gradient written over the logits)."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of `a` and `b` (first to last byte they can address) intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    spans = []
    for x in (a, b):
        last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride(), strict=True))
        spans.append((x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()))
    (a_start, a_end), (b_start, b_end) = spans
    return a_start < b_end and b_start < a_end


def _vector(x_NV: torch.Tensor) -> int:
    """Elements of x's dtype in a 16-byte vector: the widest load a thread issues."""
    return 16 // x_NV.element_size()


def _aligned_alike(grad_NV: torch.Tensor, logits_NV: torch.Tensor, vector: int) -> bool:
    """Whether every row of grad starts at the same offset modulo a vector as the logits' row does, so that the
    columns the kernel reads in whole vectors are whole vectors of grad too (Triton's launch checks both tensors'
    16-byte alignment)."""
    same_size = grad_NV.element_size() == logits_NV.element_size()
    return same_size and (grad_NV.stride(0) - logits_NV.stride(0)) % vector == 0


def _no_classes(unused: torch.Tensor) -> ClassRows:
    """The ClassRows of a launch without number work (its pointers are never read)."""
    tables = NumberTables(unused, unused, unused, unused, unused, unused, 0)
    return ClassRows(unused, unused, unused, unused, tables, unused, 0, 0)


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
