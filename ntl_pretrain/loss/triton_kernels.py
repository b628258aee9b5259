"""Triton kernels of CE + NTL: one program per row of logits, fp32 math whatever the logits' dtype.

Legend: V columns of the logits (a row's vocabulary, or this rank's shard of it), M number-token columns sorted by
class (a class is a contiguous range [lo, hi) of them), D digit columns of the digit tables.

`row_partials_kernel` (forward): per row, this shard's log-sum-exp (online, Liger-Kernel style), the target logit,
and over the label's class: its log-sum-exp and the softmax-weighted mean of the kind's feature f_j.
`logits_grad_kernel` (backward, or in place over the logits in the chunked head, which may have it compute the
row's log-sum-exp first): per column
    d loss / d z_j = w·p_j + g_t·[j = t] + [j ∈ C(t)]·q_j·(alpha·f_j + beta),
p the softmax over the row, q over the label's class, w, g_t, alpha and beta per-row coefficients (fused.py), then
the logit transform's chain rule. The loop over the row is plain CE; the label's class members get their whole
gradient after it, so the NTL work is the class's columns of the number rows only, and the loop keeps to what
Liger-Kernel's cross-entropy holds in registers (no spills: tests/test_triton_resources.py). The feature f_j of a
number column: its value v_j (mse, mae, huber, number), its distance |v_j − y| from the label's value (was), or its
summed digit differences Σ_i |d_j[i] − d_t[i]| (digits).

Imported only when the Triton backend runs (backend.py): `@triton.jit` decides at import whether the kernels are
compiled for the GPU or interpreted on CPU tensors (`TRITON_INTERPRET=1`).
"""

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether these kernels are decorated for Triton's interpreter (they then take CPU tensors): `@triton.jit` reads
the variable as it decorates (triton 3.x: `triton.knobs.runtime.interpret`)."""

VALUE: tl.constexpr = tl.constexpr(0)
VALUE_DISTANCE: tl.constexpr = tl.constexpr(1)
DIGIT_DISTANCE: tl.constexpr = tl.constexpr(2)
# tanh's odd Taylor series to x^13 is within 1e-7 of tanh below this |x|; above it the exp form does not cancel.
TANH_SERIES_LIMIT: tl.constexpr = tl.constexpr(0.5)


@triton.jit
def _tanh(x):
    """tanh in fp32 to about one ulp without libdevice (which the interpreter lacks): (1 - e^-2|x|) / (1 + e^-2|x|)
    cancels near 0, where the series takes over."""
    magnitude = tl.abs(x)
    e = tl.exp(-2.0 * magnitude)
    far = (1.0 - e) / (1.0 + e)
    s = x * x
    near = 1.0 + s * (
        -1.0 / 3
        + s * (2.0 / 15 + s * (-17.0 / 315 + s * (62.0 / 2835 + s * (-1382.0 / 155925 + s * 21844.0 / 6081075))))
    )
    return tl.where(magnitude < TANH_SERIES_LIMIT, x * near, tl.where(x < 0, -far, far))


@triton.jit
def _transformed(z, scale, softcap, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr):
    """The architecture's logit post-processing (logit_transform.py): scale·z, then cap·tanh(·/cap). Called only
    where there is one (`if SCALED or SOFTCAPPED`): the interpreter pays milliseconds per call of a jitted helper."""
    if SCALED:
        z = z * scale
    if SOFTCAPPED:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _feature(value, digits_ptr, digits_stride, index, mask, label_value, label_digits_ptr, FEATURE: tl.constexpr,
             DIGITS: tl.constexpr):  # fmt: skip
    """f_j of the number columns at `index` (their value `value`; digit d of column j at digits_ptr + d·stride + j)."""
    if FEATURE == VALUE:
        return value
    if FEATURE == VALUE_DISTANCE:
        return tl.abs(value - label_value)
    distance = tl.zeros_like(value)
    for d in tl.static_range(DIGITS):
        digit = tl.load(digits_ptr + d * digits_stride + index, mask=mask, other=0).to(tl.float32)
        distance += tl.abs(digit - tl.load(label_digits_ptr + d))
    return distance


@triton.jit
def _chained(grad, y, scale, softcap, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr):
    """d loss / d (raw logit) from d loss / d y, y the transformed logit: times scale · (1 - (y / cap)²)."""
    if SOFTCAPPED:
        ratio = y / softcap
        grad = grad * (1.0 - ratio * ratio)
    if SCALED:
        grad = grad * scale
    return grad


@triton.jit
def _finite_shift(running_max):
    """The shift of an online log-sum-exp: its running max, or 0 where that is infinite, so that a block of -inf
    logits adds exp(-inf) = 0 and a +inf logit makes the sum +inf (not exp(inf - inf), NaN) as torch.logsumexp."""
    return tl.where(tl.abs(running_max) == float("inf"), 0.0, running_max)


@triton.jit
def _row_lse(row_ptr, num_columns, scale, softcap, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr,
             BLOCK_V: tl.constexpr):  # fmt: skip
    """Log-sum-exp of the row's (transformed) logits, online over blocks of BLOCK_V columns (Liger-Kernel style)."""
    offsets = tl.arange(0, BLOCK_V)
    running_max, running_sum = float("-inf"), 0.0
    for start in range(0, num_columns, BLOCK_V):
        columns = start + offsets
        inside = columns < num_columns
        z = tl.load(row_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        if SCALED or SOFTCAPPED:
            z = _transformed(z, scale, softcap, SCALED, SOFTCAPPED)
        z = tl.where(inside, z, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, 0))
        shift = _finite_shift(new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), 0)
        running_max = new_max
    return running_max + tl.log(running_sum)


@triton.jit
def _target_logit(row_ptr, target, scale, softcap, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr):
    """The (transformed) logit at column `target`, 0 where target is -1 (this shard does not hold it)."""
    owned = target >= 0
    logit = tl.load(row_ptr + tl.maximum(target, 0), mask=owned, other=0.0).to(tl.float32)
    if SCALED or SOFTCAPPED:
        logit = _transformed(logit, scale, softcap, SCALED, SOFTCAPPED)
    return tl.where(owned, logit, 0.0)


@triton.jit
def row_partials_kernel(
    logits_ptr, logits_stride, num_columns,
    target_ptr, lse_ptr, target_logit_ptr,
    class_lo_ptr, class_hi_ptr, member_column_ptr, member_value_ptr, member_digits_ptr, member_count,
    label_value_ptr, label_digits_ptr, class_lse_ptr, feature_mean_ptr,
    scale, softcap,
    CE: tl.constexpr, CLASSES: tl.constexpr, FEATURE: tl.constexpr, DIGITS: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """CE: log-sum-exp of the row and its logit at column target (-1: this shard does not hold it; 0 is written).
    CLASSES: over members [class_lo, class_hi) (member_column_ptr maps them to columns): the class log-sum-exp
    (-inf when empty) and Σ_j q_j f_j (0 when empty)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    if CE:
        tl.store(lse_ptr + row, _row_lse(row_ptr, num_columns, scale, softcap, SCALED, SOFTCAPPED, BLOCK_V))
        target = tl.load(target_ptr + row)
        tl.store(target_logit_ptr + row, _target_logit(row_ptr, target, scale, softcap, SCALED, SOFTCAPPED))
    if CLASSES:
        lo, hi = tl.load(class_lo_ptr + row), tl.load(class_hi_ptr + row)
        label_value = tl.load(label_value_ptr + row)
        label_digits_ptr += row * DIGITS
        member_offsets = tl.arange(0, BLOCK_M)
        class_max, class_sum, feature_sum = float("-inf"), 0.0, 0.0
        for start in range(lo, hi, BLOCK_M):
            members = start + member_offsets
            inside = members < hi
            columns = tl.load(member_column_ptr + members, mask=inside, other=0)
            z = tl.load(row_ptr + columns, mask=inside, other=0.0).to(tl.float32)
            if SCALED or SOFTCAPPED:
                z = _transformed(z, scale, softcap, SCALED, SOFTCAPPED)
            z = tl.where(inside, z, float("-inf"))
            value = tl.load(member_value_ptr + members, mask=inside, other=0.0)
            feature = _feature(value, member_digits_ptr, member_count, members, inside, label_value, label_digits_ptr,
                               FEATURE, DIGITS)  # fmt: skip
            new_max = tl.maximum(class_max, tl.max(z, 0))
            shift = _finite_shift(new_max)
            rescale = tl.exp(class_max - shift)
            weights = tl.exp(z - shift)
            class_sum = class_sum * rescale + tl.sum(weights, 0)
            feature_sum = feature_sum * rescale + tl.sum(tl.where(inside, weights * feature, 0.0), 0)
            class_max = new_max
        # a class with members sums to at least 1 (its largest term is exp(0)); an empty one has log-sum-exp -inf
        tl.store(
            class_lse_ptr + row, tl.where(class_sum > 0, class_max + tl.log(tl.maximum(class_sum, 1.0)), class_max)
        )
        tl.store(feature_mean_ptr + row, tl.where(class_sum > 0, feature_sum / tl.maximum(class_sum, 1e-38), 0.0))


@triton.jit
def logits_grad_kernel(
    logits_ptr, logits_stride, grad_ptr, grad_stride, num_columns,
    lse_ptr, target_logit_ptr, softmax_weight_ptr, target_ptr, target_grad_ptr,
    class_lo_ptr, class_hi_ptr, class_lse_ptr, alpha_ptr, beta_ptr, label_value_ptr, label_digits_ptr,
    member_column_ptr, member_value_ptr, member_digits_ptr, member_count,
    scale, softcap,
    ROW_LSE: tl.constexpr, NUMBERS: tl.constexpr, FEATURE: tl.constexpr, DIGITS: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """d loss / d (raw logits) of one row into grad (its dtype; grad may be the logits themselves).

    ROW_LSE: first compute the row's log-sum-exp and target logit and store them at lse_ptr and target_logit_ptr
    (the chunked head's forward, fused), else read the log-sum-exp at lse_ptr. The loop over the row's columns is
    plain cross-entropy, w·p_j + g_t·[j = t]; NUMBERS then overwrites the columns of the label's class, members
    [class_lo, class_hi) (one block of BLOCK_M: every class of a real tokenizer holds at most 1,000 tokens), with
    their whole gradient, the NTL term q_j·(alpha·f_j + beta) included. Those members' logits are read before the
    loop (which may overwrite them) and their gradients held in registers until after it: so the NTL work is a few
    loads a row, and rows without a number label (lo == hi) mask it all off. Barriers order the threads of the
    program: every read of the row before the loop's first write, the loop's writes before the members'."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    out_ptr = grad_ptr + row * grad_stride
    target = tl.load(target_ptr + row)
    if ROW_LSE:
        lse = _row_lse(row_ptr, num_columns, scale, softcap, SCALED, SOFTCAPPED, BLOCK_V)
        tl.store(lse_ptr + row, lse)
        tl.store(target_logit_ptr + row, _target_logit(row_ptr, target, scale, softcap, SCALED, SOFTCAPPED))
    else:
        lse = tl.load(lse_ptr + row)
    softmax_weight = tl.load(softmax_weight_ptr + row)
    target_grad = tl.load(target_grad_ptr + row)
    if NUMBERS:
        lo, hi = tl.load(class_lo_ptr + row), tl.load(class_hi_ptr + row)
        members = lo + tl.arange(0, BLOCK_M)
        in_class = members < hi
        member_columns = tl.load(member_column_ptr + members, mask=in_class, other=0)
        z = tl.load(row_ptr + member_columns, mask=in_class, other=0.0).to(tl.float32)
        if SCALED or SOFTCAPPED:
            z = _transformed(z, scale, softcap, SCALED, SOFTCAPPED)
        value = tl.load(member_value_ptr + members, mask=in_class, other=0.0)
        feature = _feature(value, member_digits_ptr, member_count, members, in_class, tl.load(label_value_ptr + row),
                           label_digits_ptr + row * DIGITS, FEATURE, DIGITS)  # fmt: skip
        ntl_grad = tl.exp(z - tl.load(class_lse_ptr + row)) * (
            tl.load(alpha_ptr + row) * feature + tl.load(beta_ptr + row)
        )
        member_grad = tl.exp(z - lse) * softmax_weight + tl.where(member_columns == target, target_grad, 0.0) + ntl_grad
        if SCALED or SOFTCAPPED:
            member_grad = _chained(member_grad, z, scale, softcap, SCALED, SOFTCAPPED)
    tl.debug_barrier()
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, num_columns, BLOCK_V):
        columns = start + offsets
        inside = columns < num_columns
        y = tl.load(row_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        if SCALED or SOFTCAPPED:
            y = _transformed(y, scale, softcap, SCALED, SOFTCAPPED)
        grad = tl.exp(y - lse) * softmax_weight + tl.where(columns == target, target_grad, 0.0)
        if SCALED or SOFTCAPPED:
            grad = _chained(grad, y, scale, softcap, SCALED, SOFTCAPPED)
        tl.store(out_ptr + columns, grad.to(grad_ptr.dtype.element_ty), mask=inside)
    if NUMBERS:
        tl.debug_barrier()
        tl.store(out_ptr + member_columns, member_grad.to(grad_ptr.dtype.element_ty), mask=in_class)
