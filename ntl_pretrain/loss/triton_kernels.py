"""Triton kernels of CE + NTL: one program per row of logits, fp32 math whatever the logits' dtype.

Legend: V columns of the logits (a row's vocabulary, or this rank's shard of it), M number-token columns sorted by
class (a class is a contiguous range [lo, hi) of them), D digit columns of the digit tables.

`row_partials_kernel` (forward): per row, this shard's log-sum-exp (online, Liger-Kernel style), the target logit,
and over the label's class: its log-sum-exp and the softmax-weighted mean of the kind's feature f_j.
`logits_grad_kernel` (backward, or in place over the logits in the chunked head, which may have it compute the
row's log-sum-exp first): per column
    d loss / d z_j = w·p_j + g_t·[j = t] + [j ∈ C(t)]·q_j·(alpha·f_j + beta),
p the softmax over the row, q over the label's class, w, g_t, alpha and beta per-row coefficients (fused.py), then
the logit transform's chain rule. The loop over the row is plain softmax, w·p_j, in whole 16-byte vectors at any
vocabulary width (`_row_split`); the label's column, then its class members get their whole gradient after it, so
the NTL work is the class's columns of the number rows only, and the loop keeps to what Liger-Kernel's
cross-entropy holds in registers (no spills at any width, bf16 or fp32: tests/test_triton_resources.py). The
feature f_j of a number column: its value v_j (mse, mae, huber, number), its distance |v_j − y| from the label's
value (was), or its summed digit differences Σ_i |d_j[i] − d_t[i]| (digits).

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
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
"""exp(x) = exp2(x·log2(e)): the exponentials run as exp2, log2(e) folded into the multiply-add before them."""


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
def _row_split(row_start, num_columns, VECTOR: tl.constexpr):
    """How a row is read in whole 16-byte vectors of VECTOR elements, `row_start` its first element's offset from the
    tensor's (16-byte aligned wherever Triton's launch finds it so): (head, body_end), int32, with columns [0, head)
    before the row's first 16-byte boundary, [head, body_end) whole vectors, [body_end, num_columns) the ragged
    tail. row_start + head and body_end - head are multiples of VECTOR (the alignment the loops claim, true also
    for a row too short for a vector, whose body is empty); head and tail are shorter than a vector."""
    head = ((VECTOR - row_start % VECTOR) % VECTOR).to(tl.int32)
    return head, head + tl.maximum(num_columns - head, 0) // VECTOR * VECTOR


@triton.jit
def _edge_columns(head, body_end, num_columns, VECTOR: tl.constexpr):
    """The columns outside the whole vectors as one block of 2·VECTOR lanes (the head's, then the tail's), and which
    lanes hold one."""
    lanes = tl.arange(0, 2 * VECTOR)
    in_tail = lanes >= VECTOR
    columns = tl.where(in_tail, body_end - VECTOR + lanes, lanes)
    return columns, (columns < num_columns) & (in_tail | (lanes < head))


@triton.jit
def _logits(pointers, mask, scale, softcap, SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr):
    """The (transformed) logits at `pointers` in fp32, 0 where masked."""
    z = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    if SCALED or SOFTCAPPED:
        z = _transformed(z, scale, softcap, SCALED, SOFTCAPPED)
    return z


@triton.jit
def _lse_step(running_max, running_sum, z):
    """A block of logits (-inf where masked) into an online log-sum-exp, in exp2 with log2(e) folded into one
    multiply-add per element."""
    new_max = tl.maximum(running_max, tl.max(z, 0))
    shift = _finite_shift(new_max) * LOG2E
    running_sum = running_sum * tl.exp2(running_max * LOG2E - shift) + tl.sum(tl.exp2(z * LOG2E - shift), 0)
    return new_max, running_sum


@triton.jit
def _row_lse(logits_ptr, row_start, head, body_end, num_columns, scale, softcap, SCALED: tl.constexpr,
             SOFTCAPPED: tl.constexpr, BLOCK_V: tl.constexpr, VECTOR: tl.constexpr):  # fmt: skip
    """Log-sum-exp of the row's (transformed) logits, online (Liger-Kernel style): its ragged edges, then its whole
    vectors in blocks of BLOCK_V columns."""
    edge_columns, edge_inside = _edge_columns(head, body_end, num_columns, VECTOR)
    edges = _logits(logits_ptr + row_start + edge_columns, edge_inside, scale, softcap, SCALED, SOFTCAPPED)
    edges = tl.where(edge_inside, edges, float("-inf"))
    running_max = tl.max(edges, 0)
    running_sum = tl.sum(tl.exp2(edges * LOG2E - _finite_shift(running_max) * LOG2E), 0)
    body_ptr = logits_ptr + tl.multiple_of(row_start + head, VECTOR)
    body_columns = tl.multiple_of(body_end - head, VECTOR)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, body_columns, BLOCK_V):
        columns = start + offsets
        inside = columns < body_columns
        z = _logits(body_ptr + columns, inside, scale, softcap, SCALED, SOFTCAPPED)
        running_max, running_sum = _lse_step(running_max, running_sum, tl.where(inside, z, float("-inf")))
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
    VECTOR: tl.constexpr,
):  # fmt: skip
    """CE: log-sum-exp of the row and its logit at column target (-1: this shard does not hold it; 0 is written).
    CLASSES: over members [class_lo, class_hi) (member_column_ptr maps them to columns), in blocks of BLOCK_M: the
    class log-sum-exp (-inf when empty) and Σ_j q_j f_j (0 when empty)."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * logits_stride
    row_ptr = logits_ptr + row_start
    if CE:
        head, body_end = _row_split(row_start, num_columns, VECTOR)
        lse = _row_lse(logits_ptr, row_start, head, body_end, num_columns, scale, softcap, SCALED, SOFTCAPPED,
                       BLOCK_V, VECTOR)  # fmt: skip
        tl.store(lse_ptr + row, lse)
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
            z = tl.where(inside, _logits(row_ptr + columns, inside, scale, softcap, SCALED, SOFTCAPPED), float("-inf"))
            value = tl.load(member_value_ptr + members, mask=inside, other=0.0)
            feature = _feature(value, member_digits_ptr, member_count, members, inside, label_value, label_digits_ptr,
                               FEATURE, DIGITS)  # fmt: skip
            new_max = tl.maximum(class_max, tl.max(z, 0))
            shift = _finite_shift(new_max)
            rescale = tl.exp2((class_max - shift) * LOG2E)
            weights = tl.exp2(z * LOG2E - shift * LOG2E)
            class_sum = class_sum * rescale + tl.sum(weights, 0)
            feature_sum = feature_sum * rescale + tl.sum(tl.where(inside, weights * feature, 0.0), 0)
            class_max = new_max
        # a class with members sums to at least 1 (its largest term is exp(0)); an empty one has log-sum-exp -inf
        tl.store(
            class_lse_ptr + row, tl.where(class_sum > 0, class_max + tl.log(tl.maximum(class_sum, 1.0)), class_max)
        )
        tl.store(feature_mean_ptr + row, tl.where(class_sum > 0, feature_sum / tl.maximum(class_sum, 1e-38), 0.0))


@triton.jit
def _softmax_term(y, lse2, softmax_weight):
    """w·p_j from the (transformed) logits y and the row's log-sum-exp times log2(e): one multiply-add and an exp2."""
    return tl.exp2(y * LOG2E - lse2) * softmax_weight


@triton.jit
def _stash_members(row_ptr, stash_row_ptr, lo, hi, member_column_ptr, scale, softcap, SCALED: tl.constexpr,
                   SOFTCAPPED: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Copy the (transformed) logits of members [lo, hi) to stash_row_ptr[member - lo], in blocks of BLOCK_M."""
    member_offsets = tl.arange(0, BLOCK_M)
    for start in range(lo, hi, BLOCK_M):
        members = start + member_offsets
        in_class = members < hi
        columns = tl.load(member_column_ptr + members, mask=in_class, other=0)
        z = _logits(row_ptr + columns, in_class, scale, softcap, SCALED, SOFTCAPPED)
        tl.store(stash_row_ptr + (members - lo), z, mask=in_class)


@triton.jit
def logits_grad_kernel(
    logits_ptr, logits_stride, grad_ptr, grad_stride, num_columns,
    lse_ptr, target_logit_ptr, softmax_weight_ptr, target_ptr, target_grad_ptr,
    class_lo_ptr, class_hi_ptr, class_lse_ptr, alpha_ptr, beta_ptr, label_value_ptr, label_digits_ptr,
    member_column_ptr, member_value_ptr, member_digits_ptr, member_count, stash_ptr, stash_stride,
    scale, softcap,
    ROW_LSE: tl.constexpr, NUMBERS: tl.constexpr, FEATURE: tl.constexpr, DIGITS: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAPPED: tl.constexpr, IN_PLACE: tl.constexpr, GRAD_ALIGNED: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, VECTOR: tl.constexpr,
):  # fmt: skip
    """d loss / d (raw logits) of one row into grad (its dtype; IN_PLACE: grad is the logits themselves).

    ROW_LSE: first compute the row's log-sum-exp and target logit and store them at lse_ptr and target_logit_ptr
    (a forward that forms the gradient, fused), else read the log-sum-exp at lse_ptr. The pass over the row is
    plain softmax, w·p_j, in whole 16-byte vectors (the ragged edges apart; GRAD_ALIGNED: grad's rows start at the
    logits' offsets modulo a vector, so its stores are whole vectors too). Then the target column is overwritten
    with its whole CE gradient (w·p_t + g_t: no compare in the loop), and NUMBERS overwrites the columns of the
    label's class, members [class_lo, class_hi) in blocks of BLOCK_M, with their whole gradient, the NTL term
    q_j·(alpha·f_j + beta) included; rows without a number label (lo == hi) skip it. The members' logits are read
    after the pass, from the logits or (IN_PLACE, where the pass overwrote them) from the row's stash, filled before
    it. Barriers order the threads of the program: every read of the row before the pass's first write (IN_PLACE),
    the pass's writes before the target's, the target's before the members'."""
    row = tl.program_id(0).to(tl.int64)
    row_start = row * logits_stride
    row_ptr = logits_ptr + row_start
    head, body_end = _row_split(row_start, num_columns, VECTOR)
    target = tl.load(target_ptr + row)
    target_logit = _target_logit(row_ptr, target, scale, softcap, SCALED, SOFTCAPPED)
    if ROW_LSE:
        lse = _row_lse(logits_ptr, row_start, head, body_end, num_columns, scale, softcap, SCALED, SOFTCAPPED,
                       BLOCK_V, VECTOR)  # fmt: skip
        tl.store(lse_ptr + row, lse)
        tl.store(target_logit_ptr + row, target_logit)
    else:
        lse = tl.load(lse_ptr + row)
    lse2 = lse * LOG2E
    softmax_weight = tl.load(softmax_weight_ptr + row)
    if NUMBERS and IN_PLACE:
        _stash_members(
            row_ptr,
            stash_ptr + row * stash_stride,
            tl.load(class_lo_ptr + row),
            tl.load(class_hi_ptr + row),
            member_column_ptr,
            scale,
            softcap,
            SCALED,
            SOFTCAPPED,
            BLOCK_M,
        )
    if IN_PLACE:
        tl.debug_barrier()
    out_ptr = grad_ptr + row * grad_stride
    edge_columns, edge_inside = _edge_columns(head, body_end, num_columns, VECTOR)
    edges = _logits(row_ptr + edge_columns, edge_inside, scale, softcap, SCALED, SOFTCAPPED)
    edge_grad = _softmax_term(edges, lse2, softmax_weight)
    if SCALED or SOFTCAPPED:
        edge_grad = _chained(edge_grad, edges, scale, softcap, SCALED, SOFTCAPPED)
    tl.store(out_ptr + edge_columns, edge_grad.to(grad_ptr.dtype.element_ty), mask=edge_inside)
    body_ptr = logits_ptr + tl.multiple_of(row_start + head, VECTOR)
    if GRAD_ALIGNED:
        out_body_ptr = grad_ptr + tl.multiple_of(row * grad_stride + head, VECTOR)
    else:
        out_body_ptr = out_ptr + head
    body_columns = tl.multiple_of(body_end - head, VECTOR)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, body_columns, BLOCK_V):
        columns = start + offsets
        inside = columns < body_columns
        y = _logits(body_ptr + columns, inside, scale, softcap, SCALED, SOFTCAPPED)
        grad = _softmax_term(y, lse2, softmax_weight)
        if SCALED or SOFTCAPPED:
            grad = _chained(grad, y, scale, softcap, SCALED, SOFTCAPPED)
        tl.store(out_body_ptr + columns, grad.to(grad_ptr.dtype.element_ty), mask=inside)
    tl.debug_barrier()
    # what the pass does not need is loaded after it, not held in registers through it
    target = tl.load(target_ptr + row)
    target_grad = tl.load(target_grad_ptr + row)
    target_column_grad = _softmax_term(target_logit, lse2, softmax_weight) + target_grad
    if SCALED or SOFTCAPPED:
        target_column_grad = _chained(target_column_grad, target_logit, scale, softcap, SCALED, SOFTCAPPED)
    tl.store(out_ptr + tl.maximum(target, 0), target_column_grad.to(grad_ptr.dtype.element_ty), mask=target >= 0)
    if NUMBERS:
        tl.debug_barrier()
        lo, hi = tl.load(class_lo_ptr + row), tl.load(class_hi_ptr + row)
        class_lse2 = tl.load(class_lse_ptr + row) * LOG2E
        alpha, beta = tl.load(alpha_ptr + row), tl.load(beta_ptr + row)
        label_value = tl.load(label_value_ptr + row)
        label_digits_ptr += row * DIGITS
        member_offsets = tl.arange(0, BLOCK_M)
        for start in range(lo, hi, BLOCK_M):
            members = start + member_offsets
            in_class = members < hi
            columns = tl.load(member_column_ptr + members, mask=in_class, other=0)
            if IN_PLACE:
                z = tl.load(stash_ptr + row * stash_stride + (members - lo), mask=in_class, other=0.0)
            else:
                z = _logits(row_ptr + columns, in_class, scale, softcap, SCALED, SOFTCAPPED)
            value = tl.load(member_value_ptr + members, mask=in_class, other=0.0)
            feature = _feature(value, member_digits_ptr, member_count, members, in_class, label_value,
                               label_digits_ptr, FEATURE, DIGITS)  # fmt: skip
            member_grad = _softmax_term(z, lse2, softmax_weight) + tl.where(columns == target, target_grad, 0.0)
            member_grad += tl.exp2(z * LOG2E - class_lse2) * (alpha * feature + beta)
            if SCALED or SOFTCAPPED:
                member_grad = _chained(member_grad, z, scale, softcap, SCALED, SOFTCAPPED)
            tl.store(out_ptr + columns, member_grad.to(grad_ptr.dtype.element_ty), mask=in_class)


@triton.jit
def scale_unless_one_kernel(x_ptr, x_stride, num_columns, factor_ptr, BLOCK_V: tl.constexpr, VECTOR: tl.constexpr):
    """x *= factor over one row, in place, in whole 16-byte vectors; nothing read or written when factor is 1 (the
    upstream gradient of a loss whose logit gradient was formed in forward, in training)."""
    factor = tl.load(factor_ptr)
    if factor != 1.0:
        row = tl.program_id(0).to(tl.int64)
        row_start = row * x_stride
        head, body_end = _row_split(row_start, num_columns, VECTOR)
        edge_columns, edge_inside = _edge_columns(head, body_end, num_columns, VECTOR)
        edges = tl.load(x_ptr + row_start + edge_columns, mask=edge_inside, other=0.0).to(tl.float32)
        tl.store(x_ptr + row_start + edge_columns, (edges * factor).to(x_ptr.dtype.element_ty), mask=edge_inside)
        body_ptr = x_ptr + tl.multiple_of(row_start + head, VECTOR)
        body_columns = tl.multiple_of(body_end - head, VECTOR)
        offsets = tl.arange(0, BLOCK_V)
        for start in range(0, body_columns, BLOCK_V):
            columns = start + offsets
            inside = columns < body_columns
            x = tl.load(body_ptr + columns, mask=inside, other=0.0).to(tl.float32)
            tl.store(body_ptr + columns, (x * factor).to(x_ptr.dtype.element_ty), mask=inside)
