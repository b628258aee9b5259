"""What the trainer replaces inside DeepSpeed's ZeRO optimizers, so that a step costs its arithmetic and not one
host-side operation per parameter (issues 47, 56 and 70; docs/benchmarks.md, "Step overhead"; docs/compatibility.md),
and one DeepSpeed fault it mends.

Each replacement is set on the optimizer instance, only where every DeepSpeed function its equivalence rests on is
the one it was written against (DeepSpeed `READ_FROM`; syntax trees fingerprinted in `READ`, source_fingerprint.py)
on every rank: the ranks agree (`streamline` is a collective), as each replacement changes which collectives a step
calls. A DeepSpeed that changed any of it keeps its own code (slower, never wrong), the run says which function
differs (`FastPath.line`), and `tests/test_zero_optimizer.py` fails until someone reads the new code.

- `foreach_gradient_norm`: the gradient norm, which DeepSpeed takes at every step one parameter at a time (a copy
  to fp64 and a norm each), taken with one `torch._foreach_norm` per parameter group: the same per-tensor fp64
  norms, squared, summed and all-reduced, so the same value bit for bit (stages 1-3).
- `skip_gradient_scan` (bf16, stages 1 and 2): DeepSpeed scans every gradient for inf/NaN before the step (amax,
  amin, isfinite... per tensor and an `.item()`: 10,624 of a 40,463-op step at 272 tensors). The gradient norm,
  taken next, is itself not finite exactly when a gradient is not, and DeepSpeed already skips the step on a
  non-finite norm when the scan is on: with the scan made a no-op (and not switched off, which would also switch
  off that skip), a non-finite step is skipped as before, weights unchanged.
- `reduce_into_partition` (stages 1 and 2, gradients accumulated in fp32 beside bf16 weights, the trainer's bf16
  default): after each bucket's all-reduce, the slices this rank owns are added into its fp32 gradient partition
  with one `torch._foreach_add_`, instead of one add and one copy back into the bucket per parameter (the bucket
  is discarded after: `copy_grads_in_partition` only clears it).
- `keep_weights_in_place` (stages 1 and 2): after each step DeepSpeed points every parameter's `.data` at its slice
  of the flat bf16 buffer again, though the step only writes into that buffer in place; the re-pointing runs only
  when a parameter no longer is the view of the buffer it should be (a buffer moved by DeepSpeed's
  `offload_states`, say).
- `clear_skipped_gradients` (stages 1 and 2 with `offload_optimizer`, gradients accumulated in fp32 beside bf16
  weights): DeepSpeed 0.19.8 skips a non-finite step but keeps its fp32 gradient partition (`averaged_gradients`),
  so the NaN is added into every later step's gradients and every later step is skipped too (the run stops with
  NonFiniteLossError). After a skipped step the partition is dropped, as DeepSpeed drops it after every step it
  takes and after a skip without offload: the next step accumulates into a fresh zeroed one.

A bf16 run at stage 1 with fp32 gradient accumulation (the trainer's default) runs DeepSpeed's `BF16_Optimizer`
instead, which has none of these (it skips a step on its gradient norm alone) and is left as it is.

Shapes: N a gradient slice's element count.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ntl_pretrain.train.source_fingerprint import fingerprint

READ_FROM = "0.19.8"
ZERO_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
ZERO_3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
UTILS = "deepspeed.runtime.utils"
ZERO_UTILS = "deepspeed.runtime.zero.utils"
# The syntax-tree fingerprint (source_fingerprint.py) of each DeepSpeed function a replacement replaces, calls or
# relies on, as read in DeepSpeed READ_FROM.
READ = {
    f"{ZERO_1_AND_2}.step": "cdba9b3c7b7736ab",
    f"{ZERO_1_AND_2}.check_overflow": "909fef82c484c32a",
    f"{ZERO_1_AND_2}.scaled_global_norm": "e78f8fb72d69d7ad",
    f"{ZERO_1_AND_2}.get_grad_norm_direct": "7e1e996197792bc2",
    f"{ZERO_1_AND_2}.allreduce_and_copy_with_multiple_ranks": "0fc8f27db4fe99b4",
    f"{ZERO_1_AND_2}.allreduce_and_scatter": "5c18248bc0214361",
    f"{ZERO_1_AND_2}.allreduce_bucket": "b91bdc9b41393416",
    f"{ZERO_1_AND_2}.average_tensor": "9cf84596f191fe52",
    f"{ZERO_1_AND_2}.reduce_ipg_grads": "11a70fa066cccfdc",
    f"{ZERO_1_AND_2}.copy_grads_in_partition": "c5fb38f64aaaf9cc",
    f"{ZERO_1_AND_2}._add_to_grad_partition_buffer": "6ec40ce27bedeb80",
    f"{ZERO_1_AND_2}._use_compact_grad_partition_buffer": "1d2e4b6637cba873",
    f"{ZERO_1_AND_2}._build_compact_grad_partition_buffer": "610a5b98259740f8",
    f"{ZERO_1_AND_2}._get_compact_grad_partition_buffer": "26a516b3899ec7e1",
    f"{ZERO_1_AND_2}._get_compact_grad_partition_slice": "337a358f82405a63",
    f"{ZERO_1_AND_2}._release_preflattened_grad_buffers": "095bad3160e39698",
    f"{ZERO_1_AND_2}._update_model_bit16_weights": "9f8c983e592fa886",
    f"{ZERO_1_AND_2}.reset_cpu_buffers": "3b4252193cf7cc52",
    f"{ZERO_3}.get_grad_norm_direct": "d04857c191ce8dd6",
    f"{ZERO_3}._get_norm_groups": "a591a0a01bf4429c",
    f"{ZERO_3}._get_param_partition_group": "e6f2547981b456c5",
    f"{ZERO_3}._autoep_expert_parallel_group": "9961435f569decfd",
    f"{UTILS}.combine_grad_norm_groups": "76d7caffee5dbbb1",
    f"{UTILS}.is_invalid_grad_norm": "5f1135461d0db6d7",
    f"{UTILS}.mask_nan_or_inf_with_val_inplace": "4075a71c75499abd",
    f"{UTILS}.all_gather_dp_groups": "2fa8c610840b12f9",
    f"{UTILS}.all_gather_into_tensor_dp_groups": "14d9bd82aaaa8c58",
    f"{ZERO_UTILS}.get_norm_dtype": "972411fb6bc5d703",
}
# What a non-finite step's skip rests on: the norm masked to -1 and the combined norm found invalid.
SKIP_READS = (f"{ZERO_1_AND_2}.step", f"{ZERO_1_AND_2}.scaled_global_norm", f"{UTILS}.combine_grad_norm_groups",
              f"{UTILS}.is_invalid_grad_norm", f"{UTILS}.mask_nan_or_inf_with_val_inplace")  # fmt: skip
NORM_READS = {
    ZERO_1_AND_2: (*SKIP_READS, f"{ZERO_1_AND_2}.get_grad_norm_direct",
                   f"{ZERO_1_AND_2}._build_compact_grad_partition_buffer", f"{ZERO_UTILS}.get_norm_dtype"),
    ZERO_3: tuple(f"{ZERO_3}.{name}" for name in ("get_grad_norm_direct", "_get_norm_groups",
                                                  "_get_param_partition_group", "_autoep_expert_parallel_group"))
    + (f"{UTILS}.combine_grad_norm_groups", f"{UTILS}.is_invalid_grad_norm", f"{ZERO_UTILS}.get_norm_dtype"),
}  # fmt: skip
SCAN_READS = (*SKIP_READS, f"{ZERO_1_AND_2}.check_overflow", f"{ZERO_1_AND_2}.get_grad_norm_direct")
REDUCE_READS = tuple(f"{ZERO_1_AND_2}.{name}" for name in (
    "allreduce_and_copy_with_multiple_ranks", "allreduce_and_scatter", "allreduce_bucket", "average_tensor",
    "reduce_ipg_grads", "copy_grads_in_partition", "_add_to_grad_partition_buffer",
    "_use_compact_grad_partition_buffer", "_get_compact_grad_partition_buffer",
    "_get_compact_grad_partition_slice"))  # fmt: skip
WEIGHTS_READS = (f"{ZERO_1_AND_2}.step", f"{ZERO_1_AND_2}._update_model_bit16_weights",
                 f"{UTILS}.all_gather_dp_groups", f"{UTILS}.all_gather_into_tensor_dp_groups")  # fmt: skip
SKIPPED_GRADIENT_READS = tuple(f"{ZERO_1_AND_2}.{name}" for name in (
    "step", "copy_grads_in_partition", "reset_cpu_buffers", "_use_compact_grad_partition_buffer",
    "_get_compact_grad_partition_buffer", "_build_compact_grad_partition_buffer",
    "_release_preflattened_grad_buffers"))  # fmt: skip


# ---- the decision, agreed by all ranks -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One change to a ZeRO optimizer instance: `install` sets it; `reads` (per optimizer class) names the DeepSpeed
    functions it rests on; `unfit` says why an optimizer of that class does not take it (None: it does)."""

    install: Callable[[object], None]
    reads: dict[str, tuple[str, ...]]
    unfit: Callable[[object], str | None]

    @property
    def name(self) -> str:
        return self.install.__name__


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether one rank's optimizer can take a replacement: `unfit` why not by its configuration, `changed` the
    DeepSpeed functions (path, installed fingerprint) whose code differs from what was read."""

    unfit: str | None = None
    changed: tuple[tuple[str, str], ...] = ()

    @property
    def takes(self) -> bool:
        return self.unfit is None and not self.changed


@dataclasses.dataclass(frozen=True)
class FastPath:
    """The replacements set on every rank (`on`) and why the others are not: `unfit` (replacement -> why) by the run's
    configuration on some rank; `changed` (replacement -> DeepSpeed functions) as the code of those functions differs
    from what was read on some rank, `differing` (function -> {rank: installed fingerprint}) where; `versions` the
    DeepSpeed installed on each rank; `read` the fingerprints read where they are not `READ`'s."""

    on: tuple[str, ...]
    unfit: dict[str, str]
    changed: dict[str, tuple[str, ...]]
    differing: dict[str, dict[int, str]]
    versions: dict[int, str]
    read: dict[str, str] | None = None

    def line(self) -> str:
        """What the run says once: which replacements are on and why the others are off."""
        parts = [f"DeepSpeed fast path: on: {', '.join(self.on) or 'none'}"]
        by_reason: dict[str, list[str]] = {}
        for name, why in self.unfit.items():
            by_reason.setdefault(why, []).append(name)
        if by_reason:
            parts.append(
                "not for this run: " + ", ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items())
            )
        if self.changed:
            functions = ", ".join(_short(path) for path in self.differing)
            parts.append(f"off, as DeepSpeed {self._differing_installs()} differs from the {READ_FROM} these were "
                         f"read in (in {functions}): {', '.join(self.changed)}")  # fmt: skip
        return "; ".join(parts)

    def details(self) -> str:
        """`line()` and, for each function that differs, where and how (for logs/)."""
        lines = [self.line()]
        for path, found in self.differing.items():
            where = ", ".join(f"rank {rank} {fingerprint}" for rank, fingerprint in found.items())
            lines.append(f"{path}: read {(self.read or READ)[path]} in DeepSpeed {READ_FROM}; installed: {where}")
        return "\n".join(lines) + "\n"

    def _differing_installs(self) -> str:
        ranks = sorted({rank for found in self.differing.values() for rank in found})
        installs = sorted({self.versions[rank] for rank in ranks})
        if len(ranks) == len(self.versions):
            return " and ".join(installs)
        return f"{' and '.join(installs)} (on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def streamline(zero_optimizer, group: dist.ProcessGroup | None = None, replacements: tuple = (),
               read: dict[str, str] | None = None) -> FastPath:  # fmt: skip
    """Set every replacement (`REPLACEMENTS` read as `READ`, or those given with their fingerprints: ZeRO-3's
    bookkeeping on the engine, train/zero3_bookkeeping.py) that all ranks of `group` (default: all) can take on
    `zero_optimizer` (an engine's `.optimizer`). A collective where torch.distributed is initialised: every rank calls
    it at the same point."""
    replacements = replacements or REPLACEMENTS
    verdicts = {replacement.name: _verdict(replacement, zero_optimizer, read or READ) for replacement in replacements}
    gathered = _gather((importlib.metadata.version("deepspeed"), verdicts), group)
    on, unfit, changed, differing = [], {}, {}, {}
    for replacement in replacements:
        per_rank = {rank: rank_verdicts[replacement.name] for rank, (_, rank_verdicts) in enumerate(gathered)}
        if all(verdict.takes for verdict in per_rank.values()):
            replacement.install(zero_optimizer)
            on.append(replacement.name)
            continue
        for rank, verdict in per_rank.items():
            for path, found in verdict.changed:
                differing.setdefault(path, {})[rank] = found
        changed_paths = tuple(dict.fromkeys(path for verdict in per_rank.values() for path, _ in verdict.changed))
        if changed_paths:
            changed[replacement.name] = changed_paths
        else:
            unfit[replacement.name] = next(verdict.unfit for verdict in per_rank.values() if verdict.unfit)
    versions = {rank: version for rank, (version, _) in enumerate(gathered)}
    return FastPath(tuple(on), unfit, changed, differing, versions, read)


def _verdict(replacement: Replacement, zero_optimizer, read: dict[str, str]) -> Verdict:
    """This rank's answer for one replacement: the optimizer's class, then the code read, then its configuration
    (read last: a DeepSpeed that changed may also have renamed what the configuration checks read)."""
    kind = _kind(zero_optimizer)
    if kind not in replacement.reads:
        return Verdict(unfit=f"DeepSpeed runs {kind.rsplit('.', 1)[-1]}")
    found = {path: fingerprint(path) for path in replacement.reads[kind]}
    changed = tuple((path, installed) for path, installed in found.items() if installed != read[path])
    return Verdict(changed=changed) if changed else Verdict(unfit=replacement.unfit(zero_optimizer))


def _gather(local, group: dist.ProcessGroup | None) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return gathered


def _short(path: str) -> str:
    return ".".join(path.rsplit(".", 2)[-2:])


def _kind(zero_optimizer) -> str:
    return f"{type(zero_optimizer).__module__}.{type(zero_optimizer).__qualname__}"


def _plain_unfit(zero_optimizer) -> str | None:
    """Why a stage-1 or -2 optimizer is not as the trainer builds it for the fast path: optimizer offload, ZenFlow
    or MoE."""
    if zero_optimizer.cpu_offload:
        return "optimizer offload"
    if zero_optimizer.zenflow:
        return "ZenFlow"
    return "MoE layers" if zero_optimizer.has_moe_layers else None


def _compact_gradients(zero_optimizer) -> bool:
    """Every group accumulates its gradients in a flat fp32 partition (`grad_accum_dtype: fp32` beside bf16
    weights, the trainer's bf16 default)."""
    groups = range(len(zero_optimizer.bit16_groups))
    return all(zero_optimizer._use_compact_grad_partition_buffer(group) for group in groups)


# ---- the gradient norm ---------------------------------------------------------------------------------------------


def foreach_gradient_norm(zero_optimizer) -> None:
    """Give a ZeRO optimizer (`get_grad_norm_direct`, called once per parameter group at each step) the foreach norm,
    where its own would sum the same: an L2 norm without model, pipeline or expert parallelism (none of which the
    trainer sets up)."""
    per_parameter = zero_optimizer.get_grad_norm_direct
    stage3 = _kind(zero_optimizer) == ZERO_3

    def grad_norm(gradients: list[torch.Tensor], params: list[nn.Parameter], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or any(_parallel_kind(param) for param in params):
            return per_parameter(gradients, params, norm_type)
        if stage3:
            return _stage3_norm(zero_optimizer, gradients, params)
        return _stage1_and_2_norm(zero_optimizer, gradients)

    zero_optimizer.get_grad_norm_direct = grad_norm


def _norm_unfit(zero_optimizer) -> str | None:
    if getattr(zero_optimizer, "model_parallel_group", None) is not None or zero_optimizer.model_parallel_rank:
        return "model parallelism"
    offloaded = zero_optimizer.offload_optimizer if _kind(zero_optimizer) == ZERO_3 else zero_optimizer.cpu_offload
    if offloaded:
        return "optimizer offload, which norms the gradients as it offloads them"
    return None


def _parallel_kind(param: nn.Parameter) -> bool:
    """A parameter DeepSpeed's norm counts specially: expert-parallel (AutoEP) or replicated by pipeline stages."""
    expert_parallel = getattr(param, "ds_zero_placement_family", "replicated") != "replicated"
    return expert_parallel or hasattr(param, "ds_pipe_replicated")


def _stage3_norm(zero_optimizer, gradients: list[torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
    """DeepSpeed's `DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct`, its L2 case, with foreach norms."""
    from deepspeed import comm
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norms = torch._foreach_norm(gradients, 2, dtype=get_norm_dtype())
    total = torch.sum(torch.pow(torch.stack(norms), 2.0))
    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=zero_optimizer._get_param_partition_group(params[0]))
    total = total ** (1.0 / 2.0)
    invalid = torch.tensor(-1.0, device=zero_optimizer.device, dtype=torch.float)
    return torch.where(total.isnan().logical_or(total.isinf()), invalid, total)


def _stage1_and_2_norm(zero_optimizer, gradients: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's `DeepSpeedZeroOptimizer.get_grad_norm_direct` (stages 1 and 2), its L2 case, with foreach norms;
    padding that DeepSpeed appends to the last partition is left out, as there."""
    from deepspeed import comm
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    gradients = [grad for grad in gradients if not getattr(grad, "_zero_padding", False)]
    if not gradients:
        total = torch.tensor(0.0, dtype=torch.float32, device=zero_optimizer.device)
    else:
        total = torch.stack(torch._foreach_norm(gradients, 2, dtype=get_norm_dtype())).pow(2.0).sum().float()
    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=zero_optimizer.dp_process_group)
    total = total.pow(1.0 / 2.0)
    mask_nan_or_inf_with_val_inplace(total, device=zero_optimizer.device)
    return total


# ---- the finite scan -----------------------------------------------------------------------------------------------


def skip_gradient_scan(zero_optimizer) -> None:
    """bf16 at stage 1 or 2 with DeepSpeed's check on (`bf16.check_grad_overflow`, its default) and a gradient norm
    taken at each step: `step()` sets `overflow` from the norm (`is_invalid_grad_norm`, which a non-finite gradient
    makes -1) whenever the check is on, so the scan before it only repeats that answer. The scan's all-reduce goes
    with it: one collective fewer a step, which is why all ranks must agree."""

    def check_overflow(partition_gradients: bool = True) -> None:
        zero_optimizer.overflow = False  # the norm decides, a few lines later in step()

    zero_optimizer.check_overflow = check_overflow


def _scan_unfit(zero_optimizer) -> str | None:
    if zero_optimizer.dtype != torch.bfloat16:
        return f"{str(zero_optimizer.dtype).removeprefix('torch.')} weights: DeepSpeed's loss scaler needs the scan"
    if not (zero_optimizer.check_grad_overflow and zero_optimizer.compute_grad_norm):
        return "no scan to skip: bf16.check_grad_overflow or the gradient norm is off"
    return _plain_unfit(zero_optimizer)


# ---- the gradient reduce -------------------------------------------------------------------------------------------


def reduce_into_partition(zero_optimizer) -> None:
    """Stages 1 and 2 with every group's gradients accumulated in a flat fp32 partition (`grad_accum_dtype: fp32`
    beside bf16 weights): a bucket's reduced slices added into this rank's partition at once."""

    def allreduce_and_copy_with_multiple_ranks(small_bucket: list[torch.Tensor], communication_data_type: torch.dtype,
                                               log=None, divide: bool = True, process_group=None, bucket_ranks=None,
                                               output_bucket: list | None = None) -> None:  # fmt: skip
        process_group = zero_optimizer.dp_process_group if process_group is None else process_group
        reduced_N = zero_optimizer.allreduce_bucket(small_bucket, communication_data_type, log=log, divide=divide,
                                                    process_group=process_group)  # fmt: skip
        _keep_for_reduction_stream(zero_optimizer, reduced_N)
        _add_owned_slices(reduced_N, small_bucket, output_bucket or [None] * len(small_bucket))

    zero_optimizer.allreduce_and_copy_with_multiple_ranks = allreduce_and_copy_with_multiple_ranks


def _reduce_unfit(zero_optimizer) -> str | None:
    if not _compact_gradients(zero_optimizer):
        return "gradients not accumulated in fp32 beside bf16 weights"
    return _plain_unfit(zero_optimizer)


def _keep_for_reduction_stream(zero_optimizer, reduced: torch.Tensor) -> None:
    """As DeepSpeed does: a reduced bucket read on the reduction stream is not freed before that stream is done."""
    from deepspeed.accelerator import get_accelerator

    if zero_optimizer.overlap_comm and not get_accelerator().resolves_data_dependency():
        reduced.record_stream(zero_optimizer.reduction_stream)


def _add_owned_slices(reduced_N: torch.Tensor, bucket: list[torch.Tensor], outputs: list[torch.Tensor | None]) -> None:
    """Each bucket slice's reduced values added into its slice of this rank's gradient partition (`outputs`: None
    for a slice another rank owns). Reduced in another dtype (`train.reduce_dtype: bf16`), only the span of the
    bucket that holds this rank's slices is converted, once (a rank owns a contiguous range of each group, so about
    1/world of the bucket), not the whole bucket: the same values as converting each slice."""
    slices = zip(_offsets(bucket), bucket, outputs, strict=True)
    owned = [(offset, tensor.numel(), output) for offset, tensor, output in slices if output is not None]
    if not owned:
        return
    start = min(offset for offset, _, _ in owned)
    span_N = reduced_N.narrow(0, start, max(offset + count for offset, count, _ in owned) - start)
    span_N = span_N.to(owned[0][2].dtype)
    torch._foreach_add_([output for *_, output in owned],
                        [span_N.narrow(0, offset - start, count) for offset, count, _ in owned])  # fmt: skip


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    offsets, offset = [], 0
    for tensor in tensors:
        offsets.append(offset)
        offset += tensor.numel()
    return offsets


# ---- the weights after the step ------------------------------------------------------------------------------------


def keep_weights_in_place(zero_optimizer) -> None:
    """Stages 1 and 2: `_update_model_bit16_weights(group)` only where a parameter of the group is not the view of the
    flat buffer it should be (`_weights_in_place`: a few attribute reads a parameter, no tensor op)."""
    repoint = zero_optimizer._update_model_bit16_weights

    def update_model_bit16_weights(group_index: int) -> None:
        if not _weights_in_place(zero_optimizer, group_index):
            repoint(group_index)

    zero_optimizer._update_model_bit16_weights = update_model_bit16_weights


def _weights_in_place(zero_optimizer, group_index: int) -> bool:
    """Whether each parameter of the group is what DeepSpeed's re-pointing would make it: `flat.narrow(0, offset,
    numel).view(shape)`, a contiguous view of the flat buffer at its offset (address, dtype, shape and strides)."""
    flat = zero_optimizer.bit16_groups_flat[group_index]
    base, item = flat.data_ptr(), flat.element_size()
    params = zero_optimizer.round_robin_bit16_groups[group_index]
    offsets = zero_optimizer.round_robin_bit16_offsets[group_index]
    metas = zero_optimizer.round_robin_bit16_meta[group_index]
    return all(param.data_ptr() == base + offset * item and param.dtype == flat.dtype and param.shape == meta.shape
               and param.stride() == _contiguous_strides(meta.shape)
               for param, offset, meta in zip(params, offsets, metas, strict=True))  # fmt: skip


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# ---- a skipped step under optimizer offload ------------------------------------------------------------------------


def clear_skipped_gradients(zero_optimizer) -> None:
    """Stages 1 and 2 with `offload_optimizer` and fp32 gradient partitions: after a step DeepSpeed skipped (a
    non-finite gradient norm), drop the partitions it left holding that step's gradients."""
    step = zero_optimizer.step

    def step_then_clear(closure=None) -> None:
        step(closure)
        if zero_optimizer.overflow:
            for group in zero_optimizer.averaged_gradients:
                zero_optimizer.averaged_gradients[group] = None

    zero_optimizer.step = step_then_clear


def _skipped_gradients_unfit(zero_optimizer) -> str | None:
    if not zero_optimizer.cpu_offload:
        return "no optimizer offload"
    if not _compact_gradients(zero_optimizer):
        return "gradients not accumulated in fp32 beside bf16 weights"
    return None


REPLACEMENTS = (
    Replacement(foreach_gradient_norm, NORM_READS, _norm_unfit),
    Replacement(skip_gradient_scan, {ZERO_1_AND_2: SCAN_READS}, _scan_unfit),
    Replacement(reduce_into_partition, {ZERO_1_AND_2: REDUCE_READS}, _reduce_unfit),
    Replacement(keep_weights_in_place, {ZERO_1_AND_2: WEIGHTS_READS}, _plain_unfit),
    Replacement(clear_skipped_gradients, {ZERO_1_AND_2: SKIPPED_GRADIENT_READS}, _skipped_gradients_unfit),
)
