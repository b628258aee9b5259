"""Fused cross-entropy + Number Token Loss with a closed-form backward, dense or vocabulary-parallel.

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
because every column's gradient depends only on its own logit and those per-row totals. Math runs in fp32 on
row chunks, so at most one [N, V] buffer (the gradient) exists besides the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ntl_pretrain.loss.number_level import NumberSpans, gradient_at_first, number_losses
from ntl_pretrain.numbers import NumberShard

# Rows per chunk are chosen so a chunk holds about this many fp32 logits: on CPU 16 MiB, which stays in cache and
# keeps the fp32 temporaries out of the peak; on a GPU 256 MiB, so that a call is a few large kernels rather than
# hundreds of launches (the temporaries are then one chunk, far below the [N, V] logits).
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
# Reweighing charges mass outside the class slightly more than the worst in-class prediction (as ntloss does).
REWEIGH_MARGIN = 1.01
# Kinds whose loss is an expected distance to the label, sum_j q_j dist(j, t) / s: they share the class partial sums
# and the closed-form backward q_j (dist(j, t) / s - L).
DISTANCE_KINDS = ("was", "digits")


@dataclass(frozen=True)
class Targets:
    """Per-position label facts, all [N]."""

    valid: torch.Tensor  # bool: label is not ignore_index
    is_number: torch.Tensor  # bool: label is a number token (and NTL is on)
    column: torch.Tensor  # int64: label's column in this shard (0 when not owned)
    owned: torch.Tensor  # bool: this shard holds the label's column
    number_class: torch.Tensor  # int64: label's class, -1 when not a number
    value: torch.Tensor  # compute dtype: label's value y (0 when not a number)
    scale: torch.Tensor  # compute dtype: label's scale s (kind digits: its digit count k; 1 when not a number)
    cap: torch.Tensor  # compute dtype: reweigh constant c of the label's class (0 when not a number)
    digits: torch.Tensor  # compute dtype [N, D]: label's digits for kind digits ([N, 0] for the other kinds)

    def select(self, rows: slice) -> Targets:
        return Targets(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass(frozen=True)
class RowStats:
    """Per-position totals over the whole vocabulary ([N], compute dtype) and the number-token logits: what
    backward needs besides the logits."""

    lse: torch.Tensor  # logsumexp over the vocabulary
    class_lse: torch.Tensor  # logsumexp over C(t) (0 where not a number)
    ntl_raw: torch.Tensor  # NTL before reweighing
    expected: torch.Tensor  # sum_j q_j v_j (expectation kinds; 0 for WAS, which does not need it)
    class_mass: torch.Tensor  # m, full-softmax mass on C(t)
    number_slope: torch.Tensor  # kind "number": d(its number's loss)/d(sum_j q_j v_j); 0 for other kinds
    number_logits: torch.Tensor  # [N, K] this shard's number-token logits (1% of the logits: kept, not re-gathered)

    def select(self, rows: slice) -> RowStats:
        return RowStats(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 logits (bf16 cannot represent most values in 0..999); fp64 stays fp64."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def make_targets(
    labels_N: torch.Tensor,
    shard: NumberShard,
    kind: str | None,
    ignore_index: int,
    vocab_start: int,
    num_columns: int,
    dtype: torch.dtype,
    ntl_labels_N: torch.Tensor | None = None,
) -> Targets:
    """CE where `labels_N` is not `ignore_index`; NTL where `ntl_labels_N` (default: `labels_N`) is a number token.
    Where both are set they are the same token (packing.make_batch ignores one or the other, never changes it)."""
    valid = labels_N != ignore_index
    label = torch.where(valid, labels_N, 0)
    column = label - vocab_start
    owned = valid & (column >= 0) & (column < num_columns)
    zeros = torch.zeros(labels_N.shape, dtype=dtype, device=labels_N.device)
    digits = zeros.new_zeros((labels_N.numel(), 0))
    if kind is None:
        number_class, value, scale, cap = torch.full_like(label, -1), zeros, zeros + 1, zeros
    else:
        vocab = shard.vocab
        if ntl_labels_N is not None:
            ntl_valid = ntl_labels_N != ignore_index
            label = torch.where(ntl_valid, ntl_labels_N, 0)
        else:
            ntl_valid = valid
        number_class = torch.where(ntl_valid, vocab.classes[label], -1)
        is_number = number_class >= 0
        value = torch.where(is_number, vocab.values[label].to(dtype), zeros)
        scale = torch.where(is_number, vocab.scales[label].to(dtype), zeros + 1)
        spread = shard.class_spread.to(dtype)[number_class.clamp_min(0)]
        cap = torch.where(is_number, REWEIGH_MARGIN * _loss_of_error(spread, kind), zeros)
        if kind == "digits":  # reweigh is refused with digits, so its cap is never read
            scale = torch.where(is_number, vocab.class_digits[number_class.clamp_min(0)].to(dtype), zeros + 1)
            digits = torch.where(is_number[:, None], vocab.digits[label].to(dtype), 0.0)
    return Targets(
        valid=valid,
        is_number=number_class >= 0,
        column=torch.where(owned, column, 0),
        owned=owned,
        number_class=number_class,
        value=value,
        scale=scale,
        cap=cap,
        digits=digits,
    )


def _loss_of_error(error: torch.Tensor, kind: str) -> torch.Tensor:
    """NTL of a prediction `error` scale units away from the label (WAS and MAE: |e|)."""
    if kind == "mse":
        return error.square()
    if kind == "huber":
        return torch.where(error.abs() < 1, 0.5 * error.square(), error.abs() - 0.5)
    return error.abs()


def _label_distances(t: Targets, shard: NumberShard, kind: str) -> torch.Tensor:
    """[N, K] distance of every number column from each row's label, before the scale: |v_j - y| (WAS), or the
    summed digit differences sum_i |d_j[i] - d_t[i]| (digits; cdist's L1 in one kernel, exact on small integers).
    Columns outside the label's class get a finite distance that the class softmax weighs by 0."""
    if kind == "digits":
        return torch.cdist(t.digits[None], shard.digits.to(t.digits.dtype)[None], p=1.0)[0]
    return (shard.values[None, :] - t.value[:, None]).abs_()


def _error_slope(error: torch.Tensor, kind: str) -> torch.Tensor:
    """d(_loss_of_error)/d(error)."""
    if kind == "mse":
        return 2 * error
    if kind == "huber":
        return error.clamp(-1, 1)
    return error.sign()


def _row_chunks(logits_NV: torch.Tensor) -> list[slice]:
    num_rows, num_columns = logits_NV.shape
    elements = CHUNK_ELEMENTS.get(logits_NV.device.type, CHUNK_ELEMENTS["cpu"])
    rows = max(1, elements // max(1, num_columns))
    return [slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


def _class_logits(z_NK: torch.Tensor, t: Targets, shard: NumberShard) -> torch.Tensor:
    """Number-token logits with the columns outside each row's label class at -inf."""
    return torch.where(shard.classes[None, :] == t.number_class[:, None], z_NK, -math.inf)


def _ce_partials(z_RV: torch.Tensor, t_R: Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's log-sum-exp and target logit (0 where another shard owns the target) per row."""
    lse = torch.logsumexp(z_RV, dim=1)
    return lse, torch.where(t_R.owned, z_RV.gather(1, t_R.column[:, None]).squeeze(1), 0.0)


def _class_partials(z_NK: torch.Tensor, t: Targets, shard: NumberShard, kind: str | None) -> tuple[torch.Tensor, ...]:
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


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _combine(partials: tuple[torch.Tensor, ...], group) -> tuple[torch.Tensor, ...]:
    """Exact global per-row totals from every shard's partials: one MAX and one SUM all-reduce."""
    lse, class_lse, z_target, distance_sum, value_sum = partials
    maxima = _all_reduce(torch.stack([lse, class_lse], dim=1), dist.ReduceOp.MAX, group)
    shift, class_shift = maxima[:, 0], _finite_or_zero(maxima[:, 1])
    class_weight = torch.exp(class_lse - class_shift)  # 0 on shards without members of the class
    sums = torch.stack(
        [torch.exp(lse - shift), z_target, class_weight, class_weight * distance_sum, class_weight * value_sum], dim=1
    )
    sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
    total_lse = shift + sums[:, 0].log()
    class_total = sums[:, 2]
    safe_total = torch.where(class_total > 0, class_total, 1.0)
    return total_lse, class_shift + safe_total.log(), sums[:, 1], sums[:, 3] / safe_total, sums[:, 4] / safe_total


def forward_rows(
    logits_NV: torch.Tensor,
    t: Targets,
    shard: NumberShard,
    kind: str | None,
    reweigh: bool,
    group,
    spans: NumberSpans | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RowStats]:
    """Per-position CE [N] and NTL [N] (zero where they do not apply) and the stats backward needs. Kind "number"
    needs the `spans` of all N positions (its losses sit at each number's first position)."""
    dtype = compute_dtype(logits_NV)
    z_NK = logits_NV.new_empty((logits_NV.shape[0], shard.local_ids.numel()), dtype=dtype)
    chunks = []
    for rows in _row_chunks(logits_NV):
        z_RV = logits_NV[rows].to(dtype)
        chunks.append(_ce_partials(z_RV, t.select(rows)))
        torch.index_select(z_RV, 1, shard.local_ids, out=z_NK[rows])  # while the chunk is in cache
    empty = logits_NV.new_zeros(0, dtype=dtype)
    lse, z_target = (torch.cat(column) for column in zip(*chunks, strict=True)) if chunks else (empty, empty)
    return rows_from_partials(lse, z_target, z_NK, t, shard, kind, reweigh, group, spans)


def rows_from_partials(lse, z_target, z_NK, t, shard, kind, reweigh, group, spans):
    """forward_rows once this shard's log-sum-exps [N] and target logits [N] are known: the class work on the
    number-token logits z_NK [N, K], the two all-reduces, and the per-position losses."""
    class_lse, distance_sum, value_sum = _class_partials(z_NK, t, shard, kind)
    lse, class_lse, z_target, expected_distance, expected = _combine(
        (lse, class_lse, z_target, distance_sum, value_sum), group
    )
    ce = torch.where(t.valid, lse - z_target, 0.0)
    number_slope = torch.zeros_like(lse)
    if kind in DISTANCE_KINDS:
        ntl_raw = expected_distance
    elif kind == "number":
        ntl_raw, number_slope = number_losses(expected, t.value, spans)
    else:
        ntl_raw = _loss_of_error((expected - t.value) / t.scale, kind) if kind else torch.zeros_like(lse)
    class_mass = torch.exp(class_lse - lse)
    ntl = ntl_raw * class_mass + t.cap * (1 - class_mass) if reweigh else ntl_raw
    ntl = torch.where(t.is_number, ntl, 0.0)
    class_lse = torch.where(t.is_number, class_lse, 0.0)
    return ce, ntl, RowStats(lse, class_lse, ntl_raw, expected, class_mass, number_slope, z_NK)


def number_columns_grad(
    t: Targets,
    stats: RowStats,
    grad_ntl_N: torch.Tensor,
    shard: NumberShard,
    kind: str | None,
    reweigh: bool,
) -> torch.Tensor | None:
    """[N, K] gradient on this shard's number-token columns: NTL's own term plus reweighing's +p_j on the class;
    None when there is none (CE only, or a shard without number tokens)."""
    if kind is None or shard.local_ids.numel() == 0:
        return None
    q_NK = _class_logits(stats.number_logits, t, shard).sub_(stats.class_lse[:, None]).exp_()  # 0 off the class
    if kind in DISTANCE_KINDS:  # dL/dz_j = q_j (dist(j, t) / s - L)
        slope_NK = _label_distances(t, shard, kind).sub_((stats.ntl_raw * t.scale)[:, None])
        slope_weight_N = 1 / t.scale
    else:  # dL/dz_j = w · q_j (v_j - E[v]): w = f'(e) / s with e = (E[v] - y) / s, or the number's slope
        slope_NK = shard.values[None, :] - stats.expected[:, None]
        if kind == "number":
            slope_weight_N = stats.number_slope
        else:
            slope_weight_N = _error_slope((stats.expected - t.value) / t.scale, kind) / t.scale
    row_weight_N = torch.where(t.is_number, grad_ntl_N, 0.0)
    if reweigh:
        # m·dL/dz_j + (L - c)·p_j on the class (its -m·p_j part is in the full-vocabulary term), with p_j = m·q_j.
        slope_NK.mul_(slope_weight_N[:, None]).add_((stats.ntl_raw - t.cap)[:, None])
        row_weight_N = row_weight_N * stats.class_mass
    else:
        row_weight_N = row_weight_N * slope_weight_N
    return slope_NK.mul_(q_NK).mul_(row_weight_N[:, None])


def logits_grad_rows(
    z_RV: torch.Tensor,
    out_RV: torch.Tensor,
    t_R: Targets,
    stats_R: RowStats,
    grad_ce_R: torch.Tensor,
    grad_ntl_R: torch.Tensor,
    number_grad_RK: torch.Tensor | None,
    shard: NumberShard,
    reweigh: bool,
) -> None:
    """Write d(sum_i grad_ce_i CE_i + grad_ntl_i NTL_i)/dz for a chunk of rows into `out_RV` (any float dtype),
    given those rows' `number_columns_grad`.

    `out_RV` may be `z_RV` itself (the chunked head overwrites its logits with their gradient)."""
    g_ce = torch.where(t_R.valid, grad_ce_R, 0.0)
    # Full-vocabulary part: softmax times the CE weight, minus reweighing's d m / d z_j = -p_j m on every column.
    if reweigh:
        g_ntl = torch.where(t_R.is_number, grad_ntl_R, 0.0)
        row_weight = g_ce - g_ntl * (stats_R.ntl_raw - t_R.cap) * stats_R.class_mass
    else:
        row_weight = g_ce
    work = out_RV if out_RV.dtype == z_RV.dtype else torch.empty_like(z_RV)
    torch.sub(z_RV, stats_R.lse[:, None], out=work)
    work.exp_().mul_(row_weight[:, None])
    work.scatter_add_(1, t_R.column[:, None], -(g_ce * t_R.owned)[:, None])
    if number_grad_RK is not None:
        work.index_add_(1, shard.local_ids, number_grad_RK)
    if work is not out_RV:
        out_RV.copy_(work)


class FusedCeNtl(torch.autograd.Function):
    """(logits [N, V], targets) -> (CE [N], NTL [N]); backward recomputes softmax from the saved logits."""

    @staticmethod
    def forward(ctx, logits_NV, t: Targets, shard: NumberShard, kind, reweigh, group, spans=None):
        ce, ntl, stats = forward_rows(logits_NV, t, shard, kind, reweigh, group, spans)
        ctx.save_for_backward(logits_NV)
        ctx.extras = (t, stats, shard, kind, reweigh, spans)
        return ce, ntl

    @staticmethod
    def backward(ctx, grad_ce_N, grad_ntl_N):
        (logits_NV,) = ctx.saved_tensors
        t, stats, shard, kind, reweigh, spans = ctx.extras
        dtype = compute_dtype(logits_NV)
        grad_ce_N, grad_ntl_N = grad_ce_N.to(dtype), grad_ntl_N.to(dtype)
        if kind == "number":  # a number's loss sits at its first position and depends on all its positions
            grad_ntl_N = gradient_at_first(grad_ntl_N, spans)
        number_grad_NK = number_columns_grad(t, stats, grad_ntl_N, shard, kind, reweigh)
        grad_NV = torch.empty_like(logits_NV)
        for rows in _row_chunks(logits_NV):
            logits_grad_rows(
                logits_NV[rows].to(dtype),
                grad_NV[rows],
                t.select(rows),
                stats.select(rows),
                grad_ce_N[rows],
                grad_ntl_N[rows],
                None if number_grad_NK is None else number_grad_NK[rows],
                shard,
                reweigh,
            )
        return grad_NV, None, None, None, None, None, None
