"""Fused cross-entropy + Number Token Loss with a closed-form backward, dense or vocabulary-parallel: the per-row
math both backends share, and the torch backend's passes over the logits (the reference; backend.py).

Legend: N positions, V columns of the logits this rank holds (the whole vocabulary, or a shard of it),
K number-token columns among them, R rows of one chunk.

Per position with logits z and label t (docs/loss.md, "The objective"):
  CE   = logsumexp(z) - z_t
  q_j  = softmax of z over C(t), the number tokens of t's class;  y = value(t);  s = scale(t)
  WAS  = sum_j q_j |v_j - y| / s;   MSE/MAE/Huber = f((sum_j q_j v_j - y) / s)
  digits = sum_j q_j D(j, t), D(j, t) = (1/k) sum_i |d_j[i] - d_t[i]| over the k digits of t's class: WAS with another
  distance (so the same partial sums, collectives and backward), the class's digit count k in the place of s.
  reweigh: L * m + c * (1 - m), m = full-softmax mass on C(t), c = 1.01 * the largest L of the class.
  number (number_level.py): sum_j q_j v_j per position, assembled into one relative-error loss per whole number,
  held at the number's first position; a segment sum over positions, so no collective of its own.

Everything is a per-position sum over columns, so a sharded vocabulary needs one MAX all-reduce of the local
log-sum-exps (whole row and class) and one SUM all-reduce of five rescaled partial sums; backward needs none,
because every column's gradient depends only on its own logit and those per-row totals:
  d loss / d z_j = w p_j - g_t [j = t] + [j in C(t)] q_j (alpha f_j + beta),
p the softmax, w and g_t the CE weights (`softmax_weights`), f_j the kind's feature of column j (|v_j - y| for WAS,
the digit distance for digits, v_j for the expectation kinds and number) and alpha, beta per row
(`number_coefficients`). The torch backend runs the math in fp32 on row chunks, so at most one [N, V] buffer (the
gradient) exists besides the logits.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ntl_pretrain.loss.number_level import NumberSpans, gradient_at_first, number_losses
from ntl_pretrain.loss.targets import Targets, loss_of_error
from ntl_pretrain.numbers import NumberShard

# Rows per chunk are chosen so a chunk holds about this many fp32 logits: on CPU 16 MiB, which stays in cache and
# keeps the fp32 temporaries out of the peak; on a GPU 256 MiB, so that a call is a few large kernels rather than
# hundreds of launches (the temporaries are then one chunk, far below the [N, V] logits).
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
# Kinds whose loss is an expected distance to the label, sum_j q_j dist(j, t) / s: they share the class partial sums
# and the closed-form backward q_j (dist(j, t) / s - L).
DISTANCE_KINDS = ("was", "digits")


@dataclass(frozen=True)
class ClassStats:
    """Per-position NTL before reweighing, from the label class's logits alone ([N], compute dtype; 0 where the
    label is not a number)."""

    class_lse: torch.Tensor  # logsumexp over C(t)
    ntl_raw: torch.Tensor  # NTL before reweighing
    expected: torch.Tensor  # sum_j q_j v_j (expectation kinds; 0 for the distance kinds, which do not need it)
    number_slope: torch.Tensor  # kind "number": d(its number's loss)/d(sum_j q_j v_j); 0 for other kinds


@dataclass(frozen=True)
class RowStats:
    """Per-position totals over the whole vocabulary ([N], compute dtype): what backward needs besides the
    logits."""

    lse: torch.Tensor  # logsumexp over the vocabulary
    classes: ClassStats | None  # None: CE only
    class_mass: torch.Tensor | None  # m, full-softmax mass on C(t)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype `torch.autocast` casts matmuls to on `device`, None where it is off (or does not exist: meta)."""
    on = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    return torch.get_autocast_dtype(device.type) if on else None


def without_autocast(device: torch.device):
    """A context with autocast off on `device` (nothing to turn off where autocast does not exist)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 logits (bf16 cannot represent most values in 0..999); fp64 stays fp64."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _error_slope(error: torch.Tensor, kind: str) -> torch.Tensor:
    """d(loss_of_error)/d(error)."""
    if kind == "mse":
        return 2 * error
    if kind == "huber":
        return error.clamp(-1, 1)
    return error.sign()


def _label_distances(t: Targets, shard: NumberShard, kind: str) -> torch.Tensor:
    """[N, K] distance of every number column from each row's label, before the scale: |v_j - y| (WAS), or the
    summed digit differences sum_i |d_j[i] - d_t[i]| (digits; cdist's L1 in one kernel, exact on small integers).
    Columns outside the label's class get a finite distance that the class softmax weighs by 0."""
    if kind == "digits":
        return torch.cdist(t.digits[None], shard.digits.to(t.digits.dtype)[None], p=1.0)[0]
    return (shard.values[None, :] - t.value[:, None]).abs_()


def _features(t: Targets, shard: NumberShard, kind: str) -> torch.Tensor:
    """f_j of every number column for each row ([N, K], or [1, K] when it does not depend on the row)."""
    return _label_distances(t, shard, kind) if kind in DISTANCE_KINDS else shard.values[None, :]


def row_chunks(num_rows: int, rows: int) -> list[slice]:
    return [slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


def _dense_chunks(logits_NV: torch.Tensor) -> list[slice]:
    num_rows, num_columns = logits_NV.shape
    elements = CHUNK_ELEMENTS.get(logits_NV.device.type, CHUNK_ELEMENTS["cpu"])
    return row_chunks(num_rows, max(1, elements // max(1, num_columns)))


def _class_logits(z_NK: torch.Tensor, t: Targets, shard: NumberShard) -> torch.Tensor:
    """Number-token logits with the columns outside each row's label class at -inf."""
    return torch.where(shard.classes[None, :] == t.number_class[:, None], z_NK, -math.inf)


def ce_partials(z_RV: torch.Tensor, column_R: torch.Tensor, owned_R: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This shard's log-sum-exp and target logit (0 where another shard owns the target) per row."""
    lse = torch.logsumexp(z_RV, dim=1)
    return lse, torch.where(owned_R, z_RV.gather(1, column_R[:, None]).squeeze(1), 0.0)


def class_partials(z_NK: torch.Tensor, t: Targets, shard: NumberShard, kind: str | None) -> tuple[torch.Tensor, ...]:
    """This shard's per-row class log-sum-exp, sum q|v-y|/s and sum q v (q normalised over the local class).
    All rows at once: the [N, K] work is ~1% of the logits', and a few large kernels beat many small ones."""
    zeros = z_NK.new_zeros(z_NK.shape[0])
    if z_NK.shape[1] == 0:  # CE only, or a shard without number tokens
        return zeros - math.inf, zeros, zeros
    z_NK = _class_logits(z_NK, t, shard)
    class_max = _finite_or_zero(z_NK.amax(dim=1))
    e_NK = z_NK.sub_(class_max[:, None]).exp_()  # 0 outside the class
    class_sum = e_NK.sum(1)
    class_lse = class_max + class_sum.log()  # -inf where this shard holds none of the class
    inverse_sum = torch.where(class_sum > 0, class_sum, 1.0).reciprocal()
    # Row sums by ATen reductions, not BLAS (vecdot, matmul): their results must not depend on the process
    # (a resumed run reproduces the uninterrupted one to the bit).
    if kind in DISTANCE_KINDS:
        distance_NK = _label_distances(t, shard, kind)
        return class_lse, distance_NK.mul_(e_NK).sum(1) * inverse_sum / t.scale, zeros
    return class_lse, zeros, e_NK.mul_(shard.values[None, :]).sum(1) * inverse_sum


def class_sums_from_mean(class_lse, feature_mean, t: Targets, kind) -> tuple[torch.Tensor, ...]:
    """`class_partials`' three columns from a class log-sum-exp and the class mean of the kind's feature f_j (the
    Triton kernels' output)."""
    zeros = torch.zeros_like(feature_mean)
    if kind in DISTANCE_KINDS:
        return class_lse, feature_mean / t.scale, zeros
    return class_lse, zeros, feature_mean


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def combine(ce_parts, class_parts, group) -> tuple[tuple | None, tuple | None]:
    """Exact global per-row totals from every shard's partials, CE's (log-sum-exp, target logit) and the class's
    (log-sum-exp, distance sum, value sum), either of them None: one MAX and one SUM all-reduce (none without a
    group, where the partials are the totals)."""
    if group is None:
        return ce_parts, class_parts
    log_sums = [parts[0] for parts in (ce_parts, class_parts) if parts is not None]
    maxima = _all_reduce(torch.stack(log_sums, dim=1), dist.ReduceOp.MAX, group)
    columns = []
    if ce_parts is not None:
        lse, z_target = ce_parts
        shift = maxima[:, 0]
        columns += [torch.exp(lse - shift), z_target]
    if class_parts is not None:
        class_lse, distance_sum, value_sum = class_parts
        class_shift = _finite_or_zero(maxima[:, -1])
        class_weight = torch.exp(class_lse - class_shift)  # 0 on shards without members of the class
        columns += [class_weight, class_weight * distance_sum, class_weight * value_sum]
    sums = _all_reduce(torch.stack(columns, dim=1), dist.ReduceOp.SUM, group)
    if ce_parts is not None:
        ce_parts = (shift + sums[:, 0].log(), sums[:, 1])
    if class_parts is not None:
        class_total = sums[:, -3]
        safe_total = torch.where(class_total > 0, class_total, 1.0)
        class_parts = (class_shift + safe_total.log(), sums[:, -2] / safe_total, sums[:, -1] / safe_total)
    return ce_parts, class_parts


def class_stats(class_parts, t: Targets, kind: str | None, spans: NumberSpans | None) -> ClassStats:
    """NTL before reweighing from the global class totals (log-sum-exp, distance sum, value sum)."""
    class_lse, distance_sum, value_sum = class_parts
    zeros = torch.zeros_like(class_lse)
    number_slope = zeros
    if kind in DISTANCE_KINDS:
        ntl_raw = distance_sum
    elif kind == "number":
        ntl_raw, number_slope = number_losses(value_sum, t.value, spans)
    else:
        ntl_raw = loss_of_error((value_sum - t.value) / t.scale, kind) if kind else zeros
    return ClassStats(torch.where(t.is_number, class_lse, 0.0), ntl_raw, value_sum, number_slope)


def reweighed_ntl(classes: ClassStats, class_mass: torch.Tensor | None, t: Targets, reweigh: bool) -> torch.Tensor:
    """Per-position NTL, 0 where the label is not a number (the class mass is read only to reweigh)."""
    ntl = classes.ntl_raw * class_mass + t.cap * (1 - class_mass) if reweigh else classes.ntl_raw
    return torch.where(t.is_number, ntl, 0.0)


def rows_from_partials(lse, z_target, class_parts, t, kind, reweigh, group, spans):
    """Per-position CE [N] and NTL [N] and the stats backward needs, from this shard's partials: log-sum-exps [N],
    target logits [N] and `class_partials`' three columns (None: CE only, NTL is 0)."""
    (lse, z_target), class_parts = combine((lse, z_target), class_parts, group)
    ce = torch.where(t.valid, lse - z_target, 0.0)
    if class_parts is None:
        return ce, torch.zeros_like(ce), RowStats(lse, None, None)
    classes = class_stats(class_parts, t, kind, spans)
    class_mass = torch.exp(class_parts[0] - lse)
    return ce, reweighed_ntl(classes, class_mass, t, reweigh), RowStats(lse, classes, class_mass)


def softmax_weights(t: Targets, grad_ce_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CE's per-row weights: of the softmax (w = g_ce) and at the label's column (g_t = -g_ce where owned)."""
    g_ce = torch.where(t.valid, grad_ce_N, 0.0)
    return g_ce, torch.where(t.owned, -g_ce, 0.0)


def reweigh_slope(t: Targets, classes: ClassStats, grad_ntl_N: torch.Tensor) -> torch.Tensor:
    """Reweighing's d m / d z_j = -p_j m on every column enters the softmax weight as -slope·m: slope = g (L - c)."""
    return torch.where(t.is_number, grad_ntl_N, 0.0) * (classes.ntl_raw - t.cap)


def number_coefficients(t, classes: ClassStats, grad_ntl_N, kind, reweigh) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta) [N] with d(g NTL)/d z_j = q_j (alpha f_j + beta) on the label's class (g = `grad_ntl_N`, the
    upstream gradient per position; kind "number": already spread over each number's positions); with reweigh
    these still need a factor m (the class mass, known per chunk in the chunked head):
      distance kinds  dL/dz_j = q_j (dist(j, t) / s - L)
      expectation     dL/dz_j = e' q_j (v_j - E[v]), e' = f'(e) / s with e = (E[v] - y) / s, or the number's slope
      reweigh         m dL/dz_j + (L - c) p_j on the class (its -m p_j part is in `reweigh_slope`), p_j = m q_j."""
    g = torch.where(t.is_number, grad_ntl_N, 0.0)
    if kind in DISTANCE_KINDS:
        alpha, beta = 1 / t.scale, -classes.ntl_raw
    else:
        if kind == "number":
            alpha = classes.number_slope
        else:
            alpha = _error_slope((classes.expected - t.value) / t.scale, kind) / t.scale
        beta = -alpha * classes.expected
    if reweigh:
        beta = beta + (classes.ntl_raw - t.cap)
    return alpha * g, beta * g


def number_columns_grad(z_NK, class_lse, coefficients, t: Targets, shard: NumberShard, kind) -> torch.Tensor:
    """[N, K] d loss / d (number-token logits z_NK): q_j (alpha f_j + beta) on each row's class, 0 elsewhere."""
    alpha, beta = coefficients
    q_NK = _class_logits(z_NK, t, shard).sub_(class_lse[:, None]).exp_()  # 0 off the class
    return q_NK.mul_(_features(t, shard, kind).mul(alpha[:, None]).add_(beta[:, None]))


def write_logits_grad(z_RV, out_RV, lse_R, softmax_weight_R, column_R, target_grad_R, number_grad_RK, local_ids):
    """Write d loss / dz of a chunk of rows into `out_RV` (any float dtype; may be `z_RV` itself, which the chunked
    head overwrites with its gradient): w p_j, g_t at the label's column (0 where another shard owns it), and the
    number columns' gradient [R, K] (None: CE only)."""
    work = out_RV if out_RV.dtype == z_RV.dtype else torch.empty_like(z_RV)
    torch.sub(z_RV, lse_R[:, None], out=work)
    work.exp_().mul_(softmax_weight_R[:, None])
    work.scatter_add_(1, column_R[:, None], target_grad_R[:, None])
    if number_grad_RK is not None:
        work.index_add_(1, local_ids, number_grad_RK)
    if work is not out_RV:
        out_RV.copy_(work)


def _torch_forward(logits_NV, t: Targets, shard: NumberShard, kind):
    """One pass over the logits in row chunks: this shard's log-sum-exps and target logits, and the number-token
    logits [N, K] (gathered while the chunk is in cache), with their class partials."""
    dtype = compute_dtype(logits_NV)
    z_NK = logits_NV.new_empty((logits_NV.shape[0], shard.local_ids.numel()), dtype=dtype)
    chunks = []
    for rows in _dense_chunks(logits_NV):
        z_RV = logits_NV[rows].to(dtype)
        chunks.append(ce_partials(z_RV, t.column[rows], t.owned[rows]))
        if kind is not None:
            torch.index_select(z_RV, 1, shard.local_ids, out=z_NK[rows])  # while the chunk is in cache
    empty = logits_NV.new_zeros(0, dtype=dtype)
    lse, z_target = (torch.cat(column) for column in zip(*chunks, strict=True)) if chunks else (empty, empty)
    return lse, z_target, None if kind is None else class_partials(z_NK, t, shard, kind), z_NK


def _triton_forward(logits_NV, t: Targets, shard: NumberShard, kind):
    """The same from one Triton kernel, reading each row's class members after its log-sum-exp; and the rows' classes
    as the gradient kernel reads them (None for CE only)."""
    from ntl_pretrain.loss import triton_ops

    classes = None
    if kind is not None and shard.local_ids.numel():
        tables = triton_ops.number_tables(shard)
        classes = triton_ops.ClassRows.of(t.number_class, t.value, t.digits, tables, kind, tables.member_columns)
    lse, z_target, class_lse, feature_mean = triton_ops.row_partials(logits_NV, t.target, classes)
    if kind is None:
        return lse, z_target, None, None
    if classes is None:  # a shard without number tokens: its empty partials, for the group's sums
        return lse, z_target, class_partials(lse.new_empty(lse.shape[0], 0), t, shard, kind), None
    return lse, z_target, class_sums_from_mean(class_lse, feature_mean, t, kind), classes


class FusedCeNtl(torch.autograd.Function):
    """(logits [N, V], targets) -> (CE [N], NTL [N]); backward recomputes softmax from the saved logits."""

    @staticmethod
    def forward(ctx, logits_NV, *rest):
        """Autocast is off inside: the loss math runs in fp32 (fp64 for fp64 logits) whatever autocast would pick."""
        with without_autocast(logits_NV.device):
            return FusedCeNtl._forward(ctx, logits_NV, *rest)

    @staticmethod
    def _forward(ctx, logits_NV, t: Targets, shard: NumberShard, kind, reweigh, group, spans=None, backend="torch"):
        # the torch backend's number-token logits [N, K], or the Triton backend's rows' classes: what backward reads
        forward = _triton_forward if backend == "triton" else _torch_forward
        lse, z_target, class_parts, numbers = forward(logits_NV, t, shard, kind)
        ce, ntl, stats = rows_from_partials(lse, z_target, class_parts, t, kind, reweigh, group, spans)
        ctx.save_for_backward(logits_NV)
        ctx.extras = (t, stats, numbers, shard, kind, reweigh, spans, backend)
        return ce, ntl

    @staticmethod
    def backward(ctx, grad_ce_N, grad_ntl_N):
        (logits_NV,) = ctx.saved_tensors
        grad_NV = logits_grad_from_stats(logits_NV, *ctx.extras, grad_ce_N, grad_ntl_N)
        return grad_NV, None, None, None, None, None, None, None


def logits_grad_from_stats(logits_NV, t: Targets, stats: RowStats, numbers, shard, kind, reweigh, spans, backend,
                           grad_ce_N, grad_ntl_N) -> torch.Tensor:  # fmt: skip
    """d (Σ grad_ce·CE + Σ grad_ntl·NTL) / d logits, [N, V] row-major in the logits' dtype, from the rows' stats and
    what the forward kept for the numbers (`FusedCeNtl`)."""
    dtype = compute_dtype(logits_NV)
    grad_ce_N, grad_ntl_N = grad_ce_N.to(dtype), grad_ntl_N.to(dtype)
    if kind == "number":  # a number's loss sits at its first position and depends on all its positions
        grad_ntl_N = gradient_at_first(grad_ntl_N, spans)
    softmax_weight, target_grad = softmax_weights(t, grad_ce_N)
    coefficients = None
    if kind is not None and shard.local_ids.numel():
        coefficients = number_coefficients(t, stats.classes, grad_ntl_N, kind, reweigh)
    if reweigh and kind is not None:
        softmax_weight = softmax_weight - reweigh_slope(t, stats.classes, grad_ntl_N) * stats.class_mass
        if coefficients is not None:
            coefficients = tuple(c * stats.class_mass for c in coefficients)
    # row-major whatever the logits' strides (the Triton kernel writes rows of contiguous columns)
    grad_NV = torch.empty(logits_NV.shape, dtype=logits_NV.dtype, device=logits_NV.device)
    if backend == "triton":
        from ntl_pretrain.loss import triton_ops

        grad_rows = None
        if coefficients is not None:
            grad_rows = triton_ops.NumberGradRows(numbers, stats.classes.class_lse, *coefficients)
        triton_ops.logits_grad(logits_NV, grad_NV, stats.lse, softmax_weight, t.target, target_grad, grad_rows)
        return grad_NV
    number_grad_NK = None
    if coefficients is not None:
        number_grad_NK = number_columns_grad(numbers, stats.classes.class_lse, coefficients, t, shard, kind)
    for rows in _dense_chunks(logits_NV):
        write_logits_grad(
            logits_NV[rows].to(dtype),
            grad_NV[rows],
            stats.lse[rows],
            softmax_weight[rows],
            t.column[rows],
            target_grad[rows],
            None if number_grad_NK is None else number_grad_NK[rows],
            shard.local_ids,
        )
    return grad_NV


class TritonCeNtlLoss(torch.autograd.Function):
    """(logits [N, V], targets, per-row weights g_ce, g_ntl [N]) -> (loss = Σ g_ce·CE + Σ g_ntl·NTL, CE [N], NTL [N])
    on the Triton backend, d loss / d logits formed in forward (as Liger-Kernel's cross-entropy does): the logits are
    not kept for backward, their gradient is (one [N, V] buffer in their dtype), and backward scales it by loss's
    upstream gradient in place, which reads nothing of it when that is 1. Only `loss` is differentiable. Without
    reweighing one kernel reads each row for its log-sum-exp and writes its gradient, after a pass over the label
    classes' members alone; reweighing needs every row's log-sum-exp first (the class mass): a pass, then the
    gradient's."""

    @staticmethod
    def forward(ctx, logits_NV, t: Targets, shard: NumberShard, kind, reweigh, spans, g_ce_N, g_ntl_N):
        with without_autocast(logits_NV.device):
            if reweigh:
                lse, z_target, class_parts, numbers = _triton_forward(logits_NV, t, shard, kind)
                ce, ntl, stats = rows_from_partials(lse, z_target, class_parts, t, kind, reweigh, None, spans)
                extras = (t, stats, numbers, shard, kind, reweigh, spans, "triton")
                grad_NV = logits_grad_from_stats(logits_NV, *extras, g_ce_N, g_ntl_N)
            else:
                ce, ntl, grad_NV = _triton_loss_and_grad(logits_NV, t, shard, kind, spans, g_ce_N, g_ntl_N)
        ctx.grad_NV = grad_NV  # held, not saved: backward scales it in place and hands it on (one backward pass)
        ctx.mark_non_differentiable(ce, ntl)
        return (g_ce_N * ce).sum() + (g_ntl_N * ntl).sum(), ce, ntl

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce_N, _grad_ntl_N):
        from ntl_pretrain.loss import triton_ops

        if ctx.grad_NV is None:
            raise RuntimeError("the loss's logit gradient was formed for one backward pass; it ran twice")
        grad_NV, ctx.grad_NV = ctx.grad_NV, None
        triton_ops.scale_unless_one(grad_NV, grad_loss.float().reshape(1))
        return grad_NV, None, None, None, None, None, None, None


def _triton_loss_and_grad(logits_NV, t: Targets, shard: NumberShard, kind, spans, g_ce_N, g_ntl_N):
    """Per-row CE and NTL and d (Σ g_ce·CE + Σ g_ntl·NTL) / d logits without reweighing: the class members' pass
    gives the NTL and its gradient's coefficients, then one kernel per row its log-sum-exp and its gradient."""
    from ntl_pretrain.loss import triton_ops

    grad_rows, ntl = None, torch.zeros_like(g_ce_N)
    if kind is not None and shard.local_ids.numel():
        tables = triton_ops.number_tables(shard)
        classes = triton_ops.ClassRows.of(t.number_class, t.value, t.digits, tables, kind, tables.member_columns)
        _, _, class_lse, feature_mean = triton_ops.row_partials(logits_NV, None, classes)
        stats = class_stats(class_sums_from_mean(class_lse, feature_mean, t, kind), t, kind, spans)
        ntl = reweighed_ntl(stats, None, t, False)
        g_ntl_N = gradient_at_first(g_ntl_N, spans) if kind == "number" else g_ntl_N
        coefficients = number_coefficients(t, stats, g_ntl_N, kind, False)
        grad_rows = triton_ops.NumberGradRows(classes, stats.class_lse, *coefficients)
    softmax_weight, target_grad = softmax_weights(t, g_ce_N)
    grad_NV = torch.empty(logits_NV.shape, dtype=logits_NV.dtype, device=logits_NV.device)
    lse, z_target = triton_ops.stats_and_grad(logits_NV, grad_NV, softmax_weight, t.target, target_grad, grad_rows)
    return torch.where(t.valid, lse - z_target, 0.0), ntl, grad_NV
