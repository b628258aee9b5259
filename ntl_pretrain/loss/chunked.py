"""`linear_ce_ntl_loss`: output projection + CE + λ·NTL a chunk of positions at a time, gradients formed in forward.

Legend: N positions, H hidden size, V columns of the output matrix this rank holds (all of them, or a vocabulary
shard), R positions of one chunk.

The fused-linear cross-entropy idea (Liger-Kernel, Apple's Cut Cross-Entropy), extended with NTL and with
vocabulary parallelism: for each chunk, logits_RV = hidden_RH @ weight_VH.T, the per-row loss statistics (fused.py,
two all-reduces per chunk with a group), then d loss / d logits overwrites the logits in place and is folded into
the hidden and weight gradients at once. No [N, V] buffer ever exists; the peak is one [R, V] chunk besides the
weight gradient. Because the gradient is formed in forward, only the combined loss is differentiable.

NTL needs only the number-token logits (hidden @ weight[number rows].T, K << V columns: 1,110 of 128,256 for
Llama-3), so a first pass, the class pass, computes them for all N positions at once (two more all-reduces with a
group): the per-position NTL and the gradient on those K columns, which each chunk then adds to its own. The
number-level kind needs it so (a number's positions may fall in different chunks); every kind gains from it, since
the per-row class work then runs once per call instead of once per chunk, and each chunk is a matmul, its row
statistics (one log-sum-exp and a target logit per row), its gradient and two matmuls. Reweighing alone needs each
chunk's log-sum-exps (the class mass m = exp(class_lse - lse)): a chunk scales the NTL gradient by m.

Backends (backend.py): torch multiplies into an fp32 chunk; triton keeps the chunk in the hidden states' dtype,
applies the transform and the fp32 math inside its kernels (triton_kernels.py) and writes the gradient over the
logits in place, so its chunk costs 2 bytes per element in bf16 against the torch path's 8 (bf16 product, fp32
copy, bf16 gradient): the same memory holds 4x the rows (`CHUNK_ELEMENTS`), and a call is a few chunks.

An architecture's logit post-processing (`LogitTransform`: scaling, soft-capping) is applied to each chunk, and its
derivative is chained into d loss / d logits before the chunk's gradient is folded in. The weight gradient
accumulates over chunks in fp32 and is rounded to the weight's dtype once, as one unchunked matmul would.

The weight gradient's matmul reads and writes the whole [V, H] fp32 accumulator each time it runs (2.1 GB at
V = 128k, H = 4,096), for only 2·R·V·H operations of a chunk of R positions: with R ~ 500 it waits on memory, not on
the tensor cores. So where the bf16 products accumulate into fp32 on tensor cores (`mixed_addmm_works`), several
chunks' logit gradients wait in a bf16 buffer ([G, V], `WEIGHT_GROUP_ELEMENTS`) and one matmul takes G positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.loss.backend import resolve_backend
from ntl_pretrain.loss.ce_ntl import LossOutput, check_loss_arguments, no_number_shard
from ntl_pretrain.loss.fused import (
    ClassStats,
    autocast_dtype,
    ce_partials,
    class_partials,
    class_stats,
    class_sums_from_mean,
    combine,
    compute_dtype,
    number_coefficients,
    number_columns_grad,
    reweigh_slope,
    reweighed_ntl,
    row_chunks,
    softmax_weights,
    without_autocast,
    write_logits_grad,
)
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.loss.number_level import NumberSpans, find_number_spans, gradient_at_first
from ntl_pretrain.loss.targets import Targets, make_targets
from ntl_pretrain.numbers import NumberShard, NumberVocab

if TYPE_CHECKING:  # triton is optional: triton_ops is imported only where its backend runs
    from ntl_pretrain.loss.triton_ops import ClassRows

# A chunk's logits hold about this many elements by default, per backend: enough rows for the matmuls to run at full
# speed and for few chunks (each costs host work and launches), few enough that the chunk stays far below the
# [N, V] logits it replaces. torch: 256 MiB in fp32 (512 MiB with bf16 weights: product, fp32 copy, gradient);
# triton: the same 512 MiB as bf16 logits overwritten by their gradient.
CHUNK_ELEMENTS = {"torch": 1 << 26, "triton": 1 << 28}
# Where grouping pays (module docstring), the logit gradients of this many elements (512 MiB in bf16) go into one
# weight-gradient matmul: at V = 128k, 2,048 positions, 4x fewer passes over the fp32 accumulator than chunk by chunk.
WEIGHT_GROUP_ELEMENTS = 1 << 28
REDUCTIONS = ("sum", "mean")


def linear_ce_ntl_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    nv: NumberVocab | None,
    kind: str | None = "was",
    ntl_weight: float = 0.3,
    reweigh: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    num_tokens: int | torch.Tensor | None = None,
    num_number_tokens: int | torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    float_level: bool = False,
    ntl_labels: torch.Tensor | None = None,
    weight_grad_rows: int | None = None,
    backend: str = "auto",
) -> LossOutput:
    """CE + `ntl_weight`·NTL of the logits `transform(hidden @ weight.T)`, `chunk_size` positions at a time.

    `hidden` [..., H] (aligned with `labels` [...]: shift before calling) and `weight` [V, H] (the output layer;
    with `group`, rows [vocab_start, vocab_start + V) of it, and every rank of the group passes the same hidden
    and labels). Only `loss` is differentiable: d loss / d hidden and d loss / d weight are computed during this
    call and scaled by the upstream gradient in backward, so `ce` and `ntl` come back detached (for logging).
    With `group`, the hidden gradient is this shard's share: sum it over the group.

    reduction "sum": loss = sum CE + ntl_weight * sum NTL. "mean": loss = sum CE / num_tokens + ntl_weight *
    sum NTL / num_number_tokens, the counts being this call's unless given (pass counts summed over the global
    batch to normalise over it). Collectives with `group`: two all-reduces per chunk, plus one to agree on the
    chunk size when `chunk_size` is None, and two for kind "number"'s first pass; none in backward. The returned
    counts are always this call's (with kind "number", `num_number_tokens` counts numbers; `float_level` and
    `ntl_labels` as in `ce_ntl_loss`). `weight_grad_rows`: positions one weight-gradient matmul takes, in whole
    chunks (at least one); None: `WEIGHT_GROUP_ELEMENTS` worth where grouping pays (module docstring), else a chunk.
    `backend`: "torch", "triton" (Triton kernels; CUDA) or "auto" (backend.py).
    """
    rows = linear_ce_ntl_rows(
        hidden, weight, labels, nv, NtlConfig(kind, ntl_weight, reweigh, float_level), reduction=reduction,
        chunk_size=chunk_size, group=group, vocab_start=vocab_start, num_tokens=num_tokens,
        num_number_tokens=num_number_tokens, transform=transform, ntl_labels=ntl_labels,
        weight_grad_rows=weight_grad_rows, ignore_index=ignore_index, backend=backend,
    )  # fmt: skip
    ce, ntl = rows.ce_N.sum() * rows.ce_scale, rows.ntl_N.sum() * rows.ntl_scale
    number_ce = torch.where(rows.is_number_N, rows.ce_N, 0.0).sum() * rows.ntl_scale
    return LossOutput(rows.loss, ce, ntl, rows.valid_N.sum(), rows.ntl_terms_N.sum(), number_ce)


@dataclass
class LinearLossRows:
    """What `linear_ce_ntl_rows` computed: the differentiable loss and detached per-position terms."""

    loss: torch.Tensor
    """Differentiable scalar: ce_scale * sum CE + ntl_weight * ntl_scale * sum NTL."""
    ce_N: torch.Tensor
    """Detached per-position CE (0 where ignored)."""
    ntl_N: torch.Tensor
    """Detached per-position NTL (0 where the label is not a number)."""
    valid_N: torch.Tensor
    """bool: the position has a label."""
    is_number_N: torch.Tensor
    """bool: the position's label is a number token (and NTL is on)."""
    ntl_terms_N: torch.Tensor
    """bool: the position holds an NTL term (number labels; with kind "number", each number's first position)."""
    ce_scale: torch.Tensor
    """The reduction's factor on sum CE (1, or 1 / num_tokens)."""
    ntl_scale: torch.Tensor
    """The reduction's factor on sum NTL (1, or 1 / num_number_tokens)."""


def linear_ce_ntl_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    nv: NumberVocab | None,
    ntl: NtlConfig,
    *,
    reduction: str,
    chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    num_tokens: int | torch.Tensor | None = None,
    num_number_tokens: int | torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    ntl_labels: torch.Tensor | None = None,
    weight_grad_rows: int | None = None,
    ignore_index: int = -100,
    backend: str = "auto",
) -> LinearLossRows:
    """`linear_ce_ntl_loss` before the per-position terms are summed: the heads' entry (the same arguments, the NTL
    settings as one object, the recipe's `loss.ntl` section)."""
    kind, ntl_weight, reweigh, float_level = ntl.kind, ntl.weight, ntl.reweigh, ntl.float_level
    _check_linear_arguments(hidden, weight, labels, reduction, chunk_size, weight_grad_rows)
    # the cast is differentiable: hidden's gradient comes back in hidden's dtype, as through autocast's nn.Linear
    operand_dtype = matmul_dtype(hidden, weight)
    labels_N, hidden_NH = labels.reshape(-1), hidden.reshape(-1, hidden.shape[-1]).to(operand_dtype)
    logits_shape = torch.empty(*labels.shape, weight.shape[0], device="meta", dtype=operand_dtype)
    check_loss_arguments(logits_shape, labels, nv, kind, "none", ignore_index, group, vocab_start, reweigh, ntl_labels)
    backend = resolve_backend(backend, hidden.device, operand_dtype)
    vocab_end = vocab_start + weight.shape[0]
    shard = nv.shard(vocab_start, vocab_end, hidden.device) if kind else no_number_shard(hidden.device)
    dtype = compute_dtype(hidden_NH)
    ntl_labels_N = None if ntl_labels is None else ntl_labels.reshape(-1)
    targets = make_targets(labels_N, shard, kind, ignore_index, vocab_start, weight.shape[0], dtype, ntl_labels_N,
                           sharded=group is not None)  # fmt: skip
    number_labels = labels if ntl_labels is None else ntl_labels
    spans = find_number_spans(number_labels, nv, ignore_index, float_level) if kind == "number" else None
    ntl_terms_N = targets.is_number if spans is None else spans.first
    counts = targets.valid.sum(), ntl_terms_N.sum()
    ce_scale, ntl_scale = _normalisers(reduction, num_tokens, num_number_tokens, counts, dtype, hidden.device)
    grad_ce_N, grad_ntl_N = ce_scale.expand(labels_N.shape), (ntl_weight * ntl_scale).expand(labels_N.shape)
    rows = _chunk_rows(chunk_size, weight.shape[0], group, hidden.device, backend)
    plan = ChunkPlan(rows, _weight_group_rows(weight_grad_rows, rows, hidden_NH, weight.shape[0]), backend)
    loss, ce_N, ntl_N = LinearCeNtl.apply(
        hidden_NH, weight, targets, shard, kind, reweigh, grad_ce_N, grad_ntl_N, plan, group, transform, spans
    )
    return LinearLossRows(loss, ce_N, ntl_N, targets.valid, targets.is_number, ntl_terms_N, ce_scale, ntl_scale)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head multiplies hidden states and weight in, as `nn.Linear` would: under `torch.autocast` for
    their device its dtype (fp64 is never autocast), else their common dtype (like `F.linear`, a pair of two dtypes
    is refused, with both named)."""
    autocast = autocast_dtype(hidden.device)
    if autocast is not None and torch.float64 not in (hidden.dtype, weight.dtype):
        return autocast
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype outside torch.autocast "
            "(as F.linear's operands): cast one of them, or call under torch.autocast"
        )
    return hidden.dtype


def _normalisers(reduction, num_tokens, num_number_tokens, counts, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalars that turn sum CE and sum NTL into the reduced CE and NTL."""
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=device), torch.ones((), dtype=dtype, device=device)
    tokens = counts[0] if num_tokens is None else torch.as_tensor(num_tokens, device=device)
    numbers = counts[1] if num_number_tokens is None else torch.as_tensor(num_number_tokens, device=device)
    return 1 / tokens.clamp_min(1).to(dtype), 1 / numbers.clamp_min(1).to(dtype)


def _chunk_rows(chunk_size: int | None, num_columns: int, group, device, backend: str) -> int:
    """Positions per chunk; with a group every rank must use the same (each chunk's all-reduces pair up)."""
    if chunk_size is not None:
        return chunk_size
    rows = default_chunk_rows(num_columns, backend)
    if group is None:
        return rows
    rows_1 = torch.tensor([rows], device=device)
    dist.all_reduce(rows_1, op=dist.ReduceOp.MIN, group=group)
    return int(rows_1)


def _weight_group_rows(weight_grad_rows: int | None, rows: int, hidden: torch.Tensor, num_columns: int) -> int:
    """Positions per weight-gradient matmul: whole chunks, at least one (`linear_ce_ntl_loss`'s weight_grad_rows)."""
    if weight_grad_rows is None:
        low = compute_dtype(hidden) != hidden.dtype
        pays = low and mixed_addmm_works(hidden.device, hidden.dtype, torch.float32)
        weight_grad_rows = WEIGHT_GROUP_ELEMENTS // num_columns if pays else rows
    return max(1, weight_grad_rows // rows) * rows


def default_chunk_rows(num_columns: int, backend: str = "torch") -> int:
    """Positions per chunk when none is given: logits of about `CHUNK_ELEMENTS[backend]` elements."""
    return max(1, CHUNK_ELEMENTS[backend] // num_columns)


def _check_linear_arguments(hidden, weight, labels, reduction, chunk_size, weight_grad_rows) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS} (only the combined loss is differentiable)")
    if not (torch.is_floating_point(hidden) and torch.is_floating_point(weight)):
        raise TypeError(f"hidden and weight must be floating-point tensors, got {hidden.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {weight.shape}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
    if weight_grad_rows is not None and weight_grad_rows < 1:
        raise ValueError(f"weight_grad_rows must be a positive number of positions, got {weight_grad_rows}")


@dataclass(frozen=True)
class ChunkPlan:
    rows: int
    """Positions per chunk."""
    group_rows: int
    """Positions per weight-gradient matmul (whole chunks)."""
    backend: str
    """"torch" or "triton" (backend.py)."""


class LinearCeNtl(torch.autograd.Function):
    """(hidden [N, H], weight [V, H]) -> (loss, CE [N], NTL [N]); saves the gradients, not the activations."""

    @staticmethod
    def forward(ctx, hidden_NH, parameter_VH, *rest):
        """`hidden_NH` in the dtype to multiply in (`matmul_dtype`), `parameter_VH` in its own: the weight is
        multiplied in hidden's dtype and its gradient comes back in its own. Autocast is off inside: the matmuls'
        operands are already in its dtype, and the loss math stays in fp32."""
        with without_autocast(hidden_NH.device):
            return LinearCeNtl._forward(ctx, hidden_NH, parameter_VH, *rest)

    @staticmethod
    def _forward(
        ctx,
        hidden_NH,
        parameter_VH,
        t: Targets,
        shard: NumberShard,
        kind,
        reweigh,
        g_ce_N,
        g_ntl_N,
        plan: ChunkPlan,
        group,
        transform: LogitTransform,
        spans: NumberSpans | None,
    ):
        weight_VH = parameter_VH.to(hidden_NH.dtype)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        dtype = compute_dtype(hidden_NH)
        grad_hidden_NH = torch.empty_like(hidden_NH) if want_hidden else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=dtype) if want_weight else None
        weight_grad = WeightGradient(grad_weight_VH, hidden_NH, plan.rows, plan.group_rows) if want_weight else None
        numbers = None
        if kind is not None:
            numbers = NumberTerm.of(hidden_NH, weight_VH, t, shard, kind, reweigh, g_ntl_N, group, transform, spans,
                                    plan.backend, want_hidden or want_weight)  # fmt: skip
        softmax_weight_N, target_grad_N = softmax_weights(t, g_ce_N)
        target_N = t.target if plan.backend == "triton" else t.column
        # Without a group or reweighing a chunk's gradient needs none of its own statistics: one kernel forms both
        fused = plan.backend == "triton" and group is None and not reweigh and (want_hidden or want_weight)
        ce_parts, ntl_parts = [], []
        for chunk in row_chunks(hidden_NH.shape[0], plan.rows):
            z_RV = hidden_NH[chunk] @ weight_VH.T
            if plan.backend == "torch":
                z_RV = transform.apply_(z_RV.to(dtype))
            if fused:
                number_grad = None if numbers is None else numbers.chunk_grad(chunk, None, t, plan.backend)
                lse_R, z_target_R = _fused_chunk(z_RV, softmax_weight_N[chunk], target_N[chunk], target_grad_N[chunk],
                                                 number_grad, transform)  # fmt: skip
                grad_RV = z_RV
            else:
                lse_R, z_target_R = _chunk_ce_partials(z_RV, target_N[chunk], t.owned[chunk], group, transform,
                                                       plan.backend)  # fmt: skip
            ce_parts.append(torch.where(t.valid[chunk], lse_R - z_target_R, 0.0))
            softmax_weight_R, mass_R = softmax_weight_N[chunk], None
            if numbers is not None and reweigh:
                mass_R = torch.exp(numbers.classes.class_lse[chunk] - lse_R)
                ntl_parts.append(numbers.reweighed_ntl(chunk, mass_R, t))
                if numbers.slope is not None:
                    softmax_weight_R = softmax_weight_R - numbers.slope[chunk] * mass_R
            if (want_hidden or want_weight) and not fused:
                number_grad = None if numbers is None else numbers.chunk_grad(chunk, mass_R, t, plan.backend)
                grad_RV = _raw_logits_grad(z_RV, lse_R, softmax_weight_R, target_N[chunk], target_grad_N[chunk],
                                           number_grad, shard, transform, plan.backend)  # fmt: skip
            if want_hidden or want_weight:
                low_grad_RV = grad_RV.to(hidden_NH.dtype)
                if want_hidden:
                    torch.mm(low_grad_RV, weight_VH, out=grad_hidden_NH[chunk])
                if want_weight:
                    weight_grad.add(chunk.start, grad_RV, low_grad_RV)
        if want_weight:
            weight_grad.flush()
        ce_N = _concat(ce_parts, hidden_NH, dtype)
        if numbers is None:
            ntl_N = torch.zeros_like(ce_N)
        else:
            ntl_N = _concat(ntl_parts, hidden_NH, dtype) if reweigh else reweighed_ntl(numbers.classes, None, t, False)
        loss = (g_ce_N * ce_N).sum() + (g_ntl_N * ntl_N).sum()
        # Held on ctx rather than saved: backward scales them in place (a second [V, H] copy would double the
        # weight gradient's memory) and hands them on, so the graph can be backpropagated once.
        ctx.grads = (grad_hidden_NH, None if grad_weight_VH is None else grad_weight_VH.to(parameter_VH.dtype))
        ctx.mark_non_differentiable(ce_N, ntl_N)
        return loss, ce_N, ntl_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce_N, _grad_ntl_N):
        if ctx.grads is None:
            raise RuntimeError("linear_ce_ntl_loss gradients were formed for one backward pass; it ran twice")
        grads, ctx.grads = ctx.grads, None
        scaled = [None if grad is None else grad.mul_(grad_loss.to(grad.dtype)) for grad in grads]
        return *scaled, *([None] * 10)


def _raw_logits_grad(
    z_RV, lse_R, softmax_weight_R, target_R, target_grad_R, number_grad, shard, transform, backend
) -> torch.Tensor:
    """d loss / d (hidden @ weight.T) for a chunk whose logits are z_RV (torch: transformed, in compute dtype;
    triton: raw, in hidden's dtype), given its number-column gradient (`NumberTerm.chunk_grad`). Written over z_RV,
    except by the torch backend with soft-capping, whose derivative needs the logits afterwards (then one more chunk
    buffer); the Triton kernel chains the transform as it writes."""
    if backend == "triton":
        from ntl_pretrain.loss import triton_ops

        triton_ops.logits_grad(z_RV, z_RV, lse_R, softmax_weight_R, target_R, target_grad_R, number_grad, transform)
        return z_RV
    grad_RV = z_RV if transform.softcap is None else torch.empty_like(z_RV)
    write_logits_grad(z_RV, grad_RV, lse_R, softmax_weight_R, target_R, target_grad_R, number_grad, shard.local_ids)
    return transform.chain_(grad_RV, z_RV)


def _fused_chunk(z_RV, softmax_weight_R, target_R, target_grad_R, number_grad, transform):
    """The chunk's log-sum-exps and target logits, its gradient written over z_RV, by one Triton kernel."""
    from ntl_pretrain.loss import triton_ops

    return triton_ops.stats_and_grad(z_RV, z_RV, softmax_weight_R, target_R, target_grad_R, number_grad, transform)


def _chunk_ce_partials(z_RV, target_R, owned_R, group, transform, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's global log-sum-exps and target logits (two all-reduces with a group)."""
    if backend == "triton":
        from ntl_pretrain.loss import triton_ops

        lse_R, z_target_R, _, _ = triton_ops.row_partials(z_RV, target_R, None, transform)
    else:
        lse_R, z_target_R = ce_partials(z_RV, target_R, owned_R)
    (lse_R, z_target_R), _ = combine((lse_R, z_target_R), None, group)
    return lse_R, z_target_R


@dataclass
class NumberTerm:
    """The NTL side of the head for all N positions, from their number-token logits alone (`of`): the chunks then
    add only its gradient (reweighing: times the class mass, which needs each chunk's log-sum-exp)."""

    classes: ClassStats
    coefficients: tuple[torch.Tensor, torch.Tensor] | None
    """(alpha, beta) [N] of `number_coefficients`; None without gradients or number tokens in this shard."""
    number_grad_NK: torch.Tensor | None
    """torch backend: the gradient on this shard's number-token columns (before reweighing's factor m)."""
    slope: torch.Tensor | None
    """reweigh: `reweigh_slope` [N]."""
    class_rows: ClassRows | None = None
    """triton backend: the rows' classes read at the logits' columns."""

    @classmethod
    def of(cls, hidden_NH, weight_VH, t, shard, kind, reweigh, g_ntl_N, group, transform, spans, backend, want_grads):
        """The class pass: the number-token logits hidden @ weight[number rows].T (K << V columns), their class
        sums (two all-reduces with a group), the per-position NTL and its gradient's coefficients."""
        dtype = compute_dtype(hidden_NH)
        z_NK = transform.apply_((hidden_NH @ weight_VH[shard.local_ids].T).to(dtype))
        class_rows = None
        if backend == "triton" and z_NK.shape[1]:
            from ntl_pretrain.loss import triton_ops

            tables = triton_ops.number_tables(shard)
            members = triton_ops.ClassRows.of(t.number_class, t.value, t.digits, tables, kind, tables.member_numbers)
            _, _, class_lse, feature_mean = triton_ops.row_partials(z_NK, None, members)
            class_parts = class_sums_from_mean(class_lse, feature_mean, t, kind)
            class_rows = members.reading(tables.member_columns)
        else:
            class_parts = class_partials(z_NK, t, shard, kind)
        _, class_parts = combine(None, class_parts, group)
        classes = class_stats(class_parts, t, kind, spans)
        if not want_grads:
            return cls(classes, None, None, None)
        # a number's loss sits at its first position and depends on all its positions
        g_ntl_N = gradient_at_first(g_ntl_N, spans) if kind == "number" else g_ntl_N
        slope = reweigh_slope(t, classes, g_ntl_N) if reweigh else None
        if not z_NK.shape[1]:
            return cls(classes, None, None, slope)
        coefficients = number_coefficients(t, classes, g_ntl_N, kind, reweigh)
        number_grad_NK = None
        if backend == "torch":
            number_grad_NK = number_columns_grad(z_NK, classes.class_lse, coefficients, t, shard, kind)
        return cls(classes, coefficients, number_grad_NK, slope, class_rows)

    def reweighed_ntl(self, chunk: slice, mass_R: torch.Tensor, t: Targets) -> torch.Tensor:
        """A chunk's NTL under reweighing, L m + c (1 - m), once its log-sum-exps give the class mass m."""
        ntl_R = self.classes.ntl_raw[chunk] * mass_R + t.cap[chunk] * (1 - mass_R)
        return torch.where(t.is_number[chunk], ntl_R, 0.0)

    def chunk_grad(self, chunk: slice, mass_R: torch.Tensor | None, t: Targets, backend: str):
        """The chunk's number-column gradient as its backend takes it (torch: [R, K]; triton: per-row
        coefficients), times the class mass under reweighing; None when this shard has no number tokens."""
        if self.coefficients is None:
            return None
        if backend == "torch":
            grad_RK = self.number_grad_NK[chunk]
            return grad_RK if mass_R is None else grad_RK * mass_R[:, None]
        from ntl_pretrain.loss import triton_ops

        alpha, beta = (c[chunk] if mass_R is None else c[chunk] * mass_R for c in self.coefficients)
        return triton_ops.NumberGradRows(self.class_rows.rows(chunk), self.classes.class_lse[chunk], alpha, beta)


class WeightGradient:
    """total_VH += Σ over chunks of grad_RV.T @ hidden_RH, `group_rows` positions per matmul: with more than one
    chunk's rows, the chunks' logit gradients wait in a [group_rows, V] buffer, in the dtype the matmul takes them
    in (`_accumulate_product`), until the next chunk would not fit. Chunks arrive in position order."""

    def __init__(self, total_VH: torch.Tensor, hidden_NH: torch.Tensor, rows: int, group_rows: int):
        self.total_VH, self.hidden_NH, self.rows, self.group_rows = total_VH, hidden_NH, rows, group_rows
        self.pending_GV: torch.Tensor | None = None
        self.start = self.filled = 0

    def add(self, start: int, grad_RV: torch.Tensor, low_grad_RV: torch.Tensor) -> None:
        """One chunk's d loss / d logits (positions start.., in compute dtype and in hidden's dtype)."""
        hidden_RH = self.hidden_NH[start : start + grad_RV.shape[0]]
        if self.group_rows <= self.rows:
            _accumulate_product(self.total_VH, grad_RV.T, low_grad_RV.T, hidden_RH)
            return
        if self.pending_GV is None:
            operand = self.total_VH.dtype if _upcasts(hidden_RH, self.total_VH) else hidden_RH.dtype
            self.pending_GV = grad_RV.new_empty(self.group_rows, grad_RV.shape[1], dtype=operand)
        if self.filled == 0:
            self.start = start
        self.pending_GV[self.filled : self.filled + grad_RV.shape[0]].copy_(grad_RV)
        self.filled += grad_RV.shape[0]
        if self.filled + self.rows > self.group_rows:
            self.flush()

    def flush(self) -> None:
        """Fold what waits into the total (after the last chunk, and whenever the buffer is full)."""
        if self.filled:
            grad_GV = self.pending_GV[: self.filled]
            hidden_GH = self.hidden_NH[self.start : self.start + self.filled]
            _accumulate_product(self.total_VH, grad_GV.T, grad_GV.T, hidden_GH)
            self.filled = 0


def _upcasts(b_RH: torch.Tensor, total_VH: torch.Tensor) -> bool:
    """Whether `_accumulate_product` multiplies in total's dtype with b upcast (no fp32-accumulating kernel for b's
    dtype): the logit gradient is then needed in total's dtype, not b's."""
    return b_RH.dtype != total_VH.dtype and not mixed_addmm_works(b_RH.device, b_RH.dtype, total_VH.dtype)


def _accumulate_product(total_VH: torch.Tensor, a_VR: torch.Tensor, low_a_VR: torch.Tensor, b_RH: torch.Tensor):
    """total += a @ b without rounding: total (fp32 for bf16/fp16 weights) is rounded once, after the last chunk.
    `a` is in total's dtype (the Triton backend's, already in b's), `low_a` the same values in b's. Where torch
    multiplies low-precision operands with fp32 accumulation into total (`addmm` with `out_dtype`, CUDA builds of
    torch >= 2.8), the tensor cores do, as one unchunked bf16 matmul does; elsewhere the fp32 gradient meets the
    chunk of b upcast (an [R, H] copy)."""
    if b_RH.dtype == total_VH.dtype:
        total_VH.addmm_(a_VR, b_RH)
    elif _upcasts(b_RH, total_VH):
        total_VH.addmm_(a_VR.to(total_VH.dtype), b_RH.to(total_VH.dtype))
    else:
        torch.addmm(total_VH, low_a_VR, b_RH, total_VH.dtype, out=total_VH)


@functools.cache
def mixed_addmm_works(device: torch.device, low: torch.dtype, high: torch.dtype) -> bool:
    """Whether `torch.addmm(high_out, low_a, low_b, high, out=high_out)` runs on `device` and accumulates in
    `high`, probed once per process: the overload is absent before torch 2.8, on CPU, and in some CUDA builds,
    which raise or (a kernel that rounds to `low` first) return a sum that lost what `low` cannot hold."""
    quarter_step = torch.finfo(low).eps / 4  # 1 + quarter_step rounds to 1 in `low`, is exact in `high`
    a = torch.ones(1, 2, dtype=low, device=device)
    b = torch.tensor([[1.0], [quarter_step]], dtype=low, device=device)
    out = torch.ones(1, 1, dtype=high, device=device)
    try:
        torch.addmm(out, a, b, high, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == high and out.item() == 2 + quarter_step


def _concat(parts: list[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros(0, dtype=dtype)
