"""What the trainer replaces inside DeepSpeed's ZeRO optimizers, so that a step costs its arithmetic and not one
host-side operation per parameter (issues 47 and 56; docs/benchmarks.md, "Step overhead"; docs/compatibility.md).

Each replacement is set on the optimizer instance, only where the DeepSpeed code it replaces or relies on is the code
it was written against (DeepSpeed `READ_FROM`, fingerprinted in `READ`): a DeepSpeed that changed any of it keeps
its own code (slower, never wrong), and `tests/test_zero_optimizer.py` fails until someone reads the new code.

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
  when a parameter no longer sits where it belongs (a buffer moved by DeepSpeed's `offload_states`, say).

A bf16 run at stage 1 with fp32 gradient accumulation (the trainer's default) runs DeepSpeed's `BF16_Optimizer`
instead, which has none of the three (it skips a step on its gradient norm alone) and is left as it is.

Shapes: N a gradient slice's element count.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

import torch
from torch import nn

READ_FROM = "0.19.8"
ZERO_1_AND_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
ZERO_3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
# sha256 (first 16 hex digits) of the source of each DeepSpeed function a replacement replaces or relies on, as read
# in DeepSpeed READ_FROM.
READ = {
    f"{ZERO_1_AND_2}.step": "9520884fd916d178",
    f"{ZERO_1_AND_2}.check_overflow": "623c2e9b3e44961b",
    f"{ZERO_1_AND_2}.scaled_global_norm": "63c6a6fe100c4e49",
    f"{ZERO_1_AND_2}.get_grad_norm_direct": "72af0993ad8cde2c",
    f"{ZERO_1_AND_2}.allreduce_and_copy_with_multiple_ranks": "e826693368e39b53",
    f"{ZERO_1_AND_2}.allreduce_and_scatter": "403393091a4836b5",
    f"{ZERO_1_AND_2}.average_tensor": "6fd000d730e51e62",
    f"{ZERO_1_AND_2}._get_compact_grad_partition_slice": "386a91e4390c1f13",
    f"{ZERO_1_AND_2}._use_compact_grad_partition_buffer": "b4b53eb20083e540",
    f"{ZERO_1_AND_2}.copy_grads_in_partition": "110f723937b99fb9",
    f"{ZERO_1_AND_2}._update_model_bit16_weights": "f6e3c0c53b4a7e06",
    f"{ZERO_3}.get_grad_norm_direct": "5ba2252d5f16b541",
}
NORM_READS = (f"{ZERO_1_AND_2}.get_grad_norm_direct", f"{ZERO_3}.get_grad_norm_direct")
SCAN_READS = (f"{ZERO_1_AND_2}.step", f"{ZERO_1_AND_2}.check_overflow", f"{ZERO_1_AND_2}.scaled_global_norm")
REDUCE_READS = tuple(f"{ZERO_1_AND_2}.{name}" for name in (
    "allreduce_and_copy_with_multiple_ranks", "allreduce_and_scatter", "average_tensor",
    "_get_compact_grad_partition_slice", "_use_compact_grad_partition_buffer", "copy_grads_in_partition"))  # fmt: skip
WEIGHTS_READS = (f"{ZERO_1_AND_2}.step", f"{ZERO_1_AND_2}._update_model_bit16_weights")


def streamline(zero_optimizer) -> list[str]:
    """Every replacement that applies to `zero_optimizer` (an engine's `.optimizer`); the names of those set."""
    applied = []
    for replace in (foreach_gradient_norm, skip_gradient_scan, reduce_into_partition, keep_weights_in_place):
        if replace(zero_optimizer):
            applied.append(replace.__name__)
    return applied


def source_fingerprint(path: str) -> str:
    """The first 16 hex digits of the sha256 of the source of the DeepSpeed function at `path` (module.Class.name);
    a function under DeepSpeed's `instrument_w_nvtx` (or torch's `_disable_dynamo`) is read through it."""
    module_name, class_name, function_name = path.rsplit(".", 2)
    try:
        function = getattr(getattr(importlib.import_module(module_name), class_name), function_name)
        function = inspect.unwrap(function)  # through torch's `_disable_dynamo` (DeepSpeed's `lazy_disable`)
        if function.__name__ == "wrapped_fn":
            function = inspect.getclosurevars(function).nonlocals["func"]
        source = inspect.getsource(function)
    except (ImportError, AttributeError, KeyError, OSError, TypeError):  # moved, renamed, or installed without source
        return "unreadable"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def as_read(paths: tuple[str, ...]) -> bool:
    """Whether the installed DeepSpeed's functions at `paths` are the ones the replacements were written against."""
    return all(source_fingerprint(path) == READ[path] for path in paths)


def _kind(zero_optimizer) -> str:
    return f"{type(zero_optimizer).__module__}.{type(zero_optimizer).__qualname__}"


def _plain_zero_1_or_2(zero_optimizer, reads: tuple[str, ...]) -> bool:
    """A stage-1 or -2 optimizer of the DeepSpeed that was read (at `reads`) as the trainer builds it: no optimizer
    offload, no ZenFlow, no MoE."""
    if _kind(zero_optimizer) != ZERO_1_AND_2 or not as_read(reads):
        return False
    return not (zero_optimizer.cpu_offload or zero_optimizer.zenflow or zero_optimizer.has_moe_layers)


# ---- the gradient norm ---------------------------------------------------------------------------------------------


def foreach_gradient_norm(zero_optimizer) -> bool:
    """Give a ZeRO optimizer (`get_grad_norm_direct`, called once per parameter group at each step) the foreach norm,
    where its own would sum the same: an L2 norm without model, pipeline or expert parallelism (none of which the
    trainer sets up). Any other optimizer is left as it is."""
    kind = _kind(zero_optimizer)
    if kind not in (ZERO_3, ZERO_1_AND_2) or not as_read(NORM_READS):
        return False
    if getattr(zero_optimizer, "model_parallel_group", None) is not None or zero_optimizer.model_parallel_rank:
        return False
    per_parameter = zero_optimizer.get_grad_norm_direct
    stage3 = kind == ZERO_3

    def grad_norm(gradients: list[torch.Tensor], params: list[nn.Parameter], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or any(_parallel_kind(param) for param in params):
            return per_parameter(gradients, params, norm_type)
        if stage3:
            return _stage3_norm(zero_optimizer, gradients, params)
        return _stage1_and_2_norm(zero_optimizer, gradients)

    zero_optimizer.get_grad_norm_direct = grad_norm
    return True


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


def skip_gradient_scan(zero_optimizer) -> bool:
    """bf16 at stage 1 or 2 with DeepSpeed's check on (`bf16.check_grad_overflow`, its default) and a gradient norm
    taken at each step: `step()` sets `overflow` from the norm (`is_invalid_grad_norm`, which a non-finite gradient
    makes -1) whenever the check is on, so the scan before it only repeats that answer."""
    if not (_plain_zero_1_or_2(zero_optimizer, SCAN_READS) and zero_optimizer.dtype == torch.bfloat16):
        return False
    if not (zero_optimizer.check_grad_overflow and zero_optimizer.compute_grad_norm):
        return False

    def check_overflow(partition_gradients: bool = True) -> None:
        zero_optimizer.overflow = False  # the norm decides, a few lines later in step()

    zero_optimizer.check_overflow = check_overflow
    return True


# ---- the gradient reduce -------------------------------------------------------------------------------------------


def reduce_into_partition(zero_optimizer) -> bool:
    """Stages 1 and 2 with every group's gradients accumulated in a flat fp32 partition (`grad_accum_dtype: fp32`
    beside bf16 weights): a bucket's reduced slices added into this rank's partition at once."""
    if not _plain_zero_1_or_2(zero_optimizer, REDUCE_READS):
        return False
    groups = range(len(zero_optimizer.bit16_groups))
    if not all(zero_optimizer._use_compact_grad_partition_buffer(group) for group in groups):
        return False

    def allreduce_and_copy_with_multiple_ranks(small_bucket: list[torch.Tensor], communication_data_type: torch.dtype,
                                               log=None, divide: bool = True, process_group=None, bucket_ranks=None,
                                               output_bucket: list | None = None) -> None:  # fmt: skip
        process_group = zero_optimizer.dp_process_group if process_group is None else process_group
        reduced_N = zero_optimizer.allreduce_bucket(small_bucket, communication_data_type, log=log, divide=divide,
                                                    process_group=process_group)  # fmt: skip
        _keep_for_reduction_stream(zero_optimizer, reduced_N)
        _add_owned_slices(reduced_N, small_bucket, output_bucket or [None] * len(small_bucket))

    zero_optimizer.allreduce_and_copy_with_multiple_ranks = allreduce_and_copy_with_multiple_ranks
    return True


def _keep_for_reduction_stream(zero_optimizer, reduced: torch.Tensor) -> None:
    """As DeepSpeed does: a reduced bucket read on the reduction stream is not freed before that stream is done."""
    from deepspeed.accelerator import get_accelerator

    if zero_optimizer.overlap_comm and not get_accelerator().resolves_data_dependency():
        reduced.record_stream(zero_optimizer.reduction_stream)


def _add_owned_slices(reduced_N: torch.Tensor, bucket: list[torch.Tensor], outputs: list[torch.Tensor | None]) -> None:
    """Each bucket slice's reduced values added into its slice of this rank's gradient partition (`outputs`: None
    for a slice another rank owns). One conversion of the whole bucket, then slices: the same values as converting
    each slice."""
    slices = zip(_offsets(bucket), bucket, outputs, strict=True)
    owned = [(offset, tensor.numel(), output) for offset, tensor, output in slices if output is not None]
    if not owned:
        return
    reduced_N = reduced_N.to(owned[0][2].dtype)
    torch._foreach_add_([output for *_, output in owned],
                        [reduced_N.narrow(0, offset, count) for offset, count, _ in owned])  # fmt: skip


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    offsets, offset = [], 0
    for tensor in tensors:
        offsets.append(offset)
        offset += tensor.numel()
    return offsets


# ---- the weights after the step ------------------------------------------------------------------------------------


def keep_weights_in_place(zero_optimizer) -> bool:
    """Stages 1 and 2: `_update_model_bit16_weights(group)` only where a parameter of the group is not the view of the
    flat buffer it should be (compared by address: one `data_ptr()` a parameter, no tensor op)."""
    if not _plain_zero_1_or_2(zero_optimizer, WEIGHTS_READS):
        return False
    repoint = zero_optimizer._update_model_bit16_weights

    def update_model_bit16_weights(group_index: int) -> None:
        if not _weights_in_place(zero_optimizer, group_index):
            repoint(group_index)

    zero_optimizer._update_model_bit16_weights = update_model_bit16_weights
    return True


def _weights_in_place(zero_optimizer, group_index: int) -> bool:
    flat = zero_optimizer.bit16_groups_flat[group_index]
    base, item = flat.data_ptr(), flat.element_size()
    params = zero_optimizer.round_robin_bit16_groups[group_index]
    offsets = zero_optimizer.round_robin_bit16_offsets[group_index]
    metas = zero_optimizer.round_robin_bit16_meta[group_index]
    return all(param.data_ptr() == base + offset * item and param.shape == meta.shape
               for param, offset, meta in zip(params, offsets, metas, strict=True))  # fmt: skip
