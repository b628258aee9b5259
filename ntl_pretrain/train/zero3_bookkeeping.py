"""What the trainer replaces in ZeRO-3's parameter bookkeeping, so that a step costs its gathers and not DeepSpeed's
Python around them (issue 73; docs/benchmarks.md, "ZeRO-3 bookkeeping"; docs/compatibility.md).

On the CPU toy of bench/step_overhead.py (30 layers, the recipe's defaults) a ZeRO-3 step made ~198k Python calls
against ~20k for a plain step. Each replacement below is set as train/zero_optimizer.py sets its own (the same
`streamline`, on the engine): only where every DeepSpeed function it rests on is the one read in `READ_FROM`
(syntax trees fingerprinted in `READ`), on every rank alike, and said in the run's fast-path line where it is off;
`tests/test_zero3_bookkeeping.py` fails until someone reads a DeepSpeed whose code changed.

- `ranges_off`: every ZeRO-3 function DeepSpeed wraps in `instrument_w_nvtx` (~1,600 calls a step) asks twice
  whether torch is compiling and which accelerator it runs on, to open and close an NVTX range that only Nsight
  Systems shows; DeepSpeed's own switch for it (`deepspeed.utils.nvtx.enable_nvtx`, which its `engine.compile()`
  turns off too) is turned off. Process-wide.
- `lazy_debug_lines`: ZeRO-3's `print_rank_0` (~1,200 calls a step, every one with `force=False`, so none prints)
  asks the process group for this rank's number before it looks at whether it prints at all; the same function
  that looks first. Process-wide: the modules of DeepSpeed's ZeRO-3 that call it.
- `cached_module_parameters`: the parameter coordinator lists a module's parameters (`iter_params`) at every fetch
  and release of the module, walking its submodules with nested generators (~18k calls a step); the list is taken
  once per module and kept on it (ZeRO-3 converted the parameters at start and they stay those objects), the
  parameters a hook registers as external to the module read at each call, as DeepSpeed does. Process-wide.
- `mark_forward_at_once` (each forward): the engine marks every module's parameters as in a forward, and unmarks them
  after it (the ZeRO-3 discovery of external parameters), walking the model's modules with nested generators each
  time (~10k calls a step); the modules are listed once. The engine instance only.
- `release_every_parameter` (at each optimizer step): the coordinator's `release_and_reset_all` partitions each
  parameter through ~120 calls of dispatch and debug formatting; here each available one is freed by DeepSpeed's own
  `free_param` (what its path ends in when the parameter already has its partition), in one loop. The optimizer
  instance only.
- `gather_persistent_at_once` (after each step), `bucket_gradients_directly` and `partition_gradients_at_once`
  (each backward), and at one rank `scatter_alone` (each bucket's reduce-scatter over a group of one): see their
  docstrings. The optimizer instance only.
- `fetch_in_one_pass` and `hooks_without_wrapping` (each module's forward and backward): see their docstrings. The
  coordinator and the parameter offload (ZeRO-3's hook owner) instances only.
- `lean_linear` (each linear layer's forward and backward): ZeRO-3's `F.linear` without the Python around its
  arithmetic (train/zero3_linear.py). Process-wide, where DeepSpeed's is in place.

None of them changes a tensor: the weights, gradients and losses are DeepSpeed's bit for bit.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ntl_pretrain.train import zero_optimizer
from ntl_pretrain.train.source_fingerprint import unwrapped
from ntl_pretrain.train.zero3_functions import apply_zero3_functions_classically
from ntl_pretrain.train.zero3_linear import LINEAR, LINEAR_READS, is_deepspeeds, lean_zero3_linear
from ntl_pretrain.train.zero_optimizer import ZERO_3, FastPath, Replacement, streamline

NVTX = "deepspeed.utils.nvtx"
PARTITIONING = "deepspeed.runtime.zero.partition_parameters"
COORDINATION = "deepspeed.runtime.zero.partitioned_param_coordinator"
OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
COORDINATOR = f"{COORDINATION}.PartitionedParameterCoordinator"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
COALESCED = "deepspeed.runtime.comm.coalesced_collectives"
# The syntax-tree fingerprint (source_fingerprint.py) of each DeepSpeed function a replacement replaces, calls or
# relies on, as read in DeepSpeed READ_FROM (train/zero_optimizer.py).
READ = {
    f"{NVTX}.instrument_w_nvtx": "401f29700d322ecb",
    f"{PARTITIONING}.print_rank_0": "1d2840ec043e8b9e",
    f"{COORDINATION}.iter_params": "7e772ab5a24b26d9",
    f"{COORDINATION}.get_all_parameters": "2045d241a1af48b3",
    f"{ZERO_3}._partition_all_parameters": "c8f361811463f765",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.partition_all_parameters": "e37190917268c738",
    f"{COORDINATOR}.release_and_reset_all": "0a06898651e8c16d",
    f"{COORDINATOR}._PartitionedParameterCoordinator__release_param": "fa26b0098b85ac15",
    f"{PARTITIONING}.Init._partition": "504813b48ba13987",
    f"{PARTITIONING}.Init._partition_param": "c40fe0e8d7dc8a27",
    f"{PARTITIONING}.free_param": "2ef8a4de4d97af40",
    f"{ZERO_3}._post_step": "b05190090457d268",
    f"{PARTITIONING}._no_gather_coalesced": "a3ceb0eab19d9b84",
    f"{PARTITIONING}.Init.get_partition_dp_group": "f789f43a4142c2af",
    f"{PARTITIONING}.Init._convert_to_deepspeed_param": "db169e22c0e5767a",
    f"{ENGINE}._forward_prologue": "7bbd47634759f35f",
    f"{ENGINE}._forward_epilogue": "ea8ba2a4f3fc7b1f",
    f"{OFFLOAD}.ensure_zero_ordered_dict": "145f9c119bbd2d92",
    f"{ZERO_3}.reduce_ready_partitions_and_remove_grads": "029f402570c130f1",
    f"{ZERO_3}.reduce_independent_p_g_buckets_and_remove_grads": "9566458f7d9d9d36",
    f"{ZERO_3}._DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket": "6854bc9f74859ab6",
    f"{ZERO_3}._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads": "160647bf28b12cf1",
    f"{ZERO_3}._apply_autoep_folding_tp_correction": "0af4ca695aef8ac9",
    f"{ZERO_3}._get_param_partition_group": "e6f2547981b456c5",
    f"{ZERO_3}._get_param_partition_rank": "680b312bbd4c405f",
    f"{ZERO_3}.partition_grads": "824b2a56fda02e2c",
    f"{ZERO_3}._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads": "a3e2adb875efc7a9",
    f"{ZERO_3}._gradient_averaging_world_size": "fa6150f82db21ca7",
    f"{COALESCED}.reduce_scatter_coalesced": "dd295c906b5dcc74",
    f"{COORDINATOR}.fetch_sub_module": "27a2320a9bf3a94a",
    f"{COORDINATOR}._fetch_sub_module_impl": "2da3d8e18708e90a",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.pre_sub_module_forward_function": "64299e5877221c63",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.post_sub_module_forward_function": "aa95c5251a194202",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.pre_sub_module_backward_function": "cdd15a50f290b476",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.post_sub_module_backward_function": "7846ceae2e57951b",
    f"{LINEAR}.LinearFunctionForZeroStage3.forward": "2d4a4ca16d55862b",
    f"{LINEAR}.LinearFunctionForZeroStage3.setup_context": "3b553efe8bde5fc2",
    f"{LINEAR}.LinearFunctionForZeroStage3.backward": "5f5864b136d36384",
    f"{LINEAR}.zero3_linear_wrap": "e09afd6e4fc73a54",
    f"{LINEAR}._is_autocast_enabled": "1cf7e7bdb2d2db5b",
    f"{LINEAR}._get_autocast_dtype": "730622036a79135f",
    "deepspeed.runtime.zero.utils.is_zero_param": "1d3088d7f2231566",
}
RANGES_READS = (f"{NVTX}.instrument_w_nvtx",)
DEBUG_LINES_READS = (f"{PARTITIONING}.print_rank_0",)
PARAMETERS_READS = (f"{COORDINATION}.iter_params", f"{COORDINATION}.get_all_parameters")
GATHER_READS = (
    f"{ZERO_3}._post_step",
    f"{PARTITIONING}.Init._convert_to_deepspeed_param",
    f"{PARTITIONING}._no_gather_coalesced",
    f"{PARTITIONING}.Init.get_partition_dp_group",
)
FORWARD_READS = (f"{ENGINE}._forward_prologue", f"{ENGINE}._forward_epilogue", f"{OFFLOAD}.ensure_zero_ordered_dict")
BUCKET_READS = tuple(f"{ZERO_3}.{name}" for name in (
    "reduce_ready_partitions_and_remove_grads", "reduce_independent_p_g_buckets_and_remove_grads",
    "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket", "_apply_autoep_folding_tp_correction",
    "_get_param_partition_group"))  # fmt: skip
PARTITION_READS = tuple(f"{ZERO_3}.{name}" for name in (
    "partition_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
    "_get_param_partition_rank"))  # fmt: skip
SCATTER_READS = (*(f"{ZERO_3}.{name}" for name in ("_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
                                                   "_gradient_averaging_world_size")),
                 f"{COALESCED}.reduce_scatter_coalesced")  # fmt: skip
FETCH_READS = (f"{COORDINATOR}.fetch_sub_module", f"{COORDINATOR}._fetch_sub_module_impl")
HOOK_READS = tuple(f"{OFFLOAD}.DeepSpeedZeRoOffload.{when}_sub_module_{phase}_function"
                   for when in ("pre", "post") for phase in ("forward", "backward"))  # fmt: skip
RELEASE_READS = tuple(path for path in READ if path not in RANGES_READS + DEBUG_LINES_READS + PARAMETERS_READS
                      + GATHER_READS + FORWARD_READS + BUCKET_READS + PARTITION_READS + SCATTER_READS + FETCH_READS
                      + HOOK_READS + LINEAR_READS)  # fmt: skip
# DeepSpeed's module-level functions replaced process-wide: the modules that call each by its global name (each
# imports it with `from ... import *` or by name).
CALLERS = {
    "print_rank_0": (PARTITIONING, COORDINATION, OFFLOAD, "deepspeed.runtime.zero.stage3"),
    "iter_params": (COORDINATION, OFFLOAD),
    "linear": ("torch.nn.functional",),  # ZeRO-3's own in place of torch's: train/zero3_linear.py
}
REPLACED: dict[str, Callable] = {}  # DeepSpeed's own function of each process-wide replacement, once it is replaced
PARAMETERS_KEPT = "_ntl_zero3_parameters"  # where a module keeps its parameter tuples ({recurse: (...)})


def streamline_zero3(engine) -> FastPath:
    """At ZeRO-3 without DeepCompile (which takes the hooks out itself): ZeRO-3's autograd Functions run classically
    (train/zero3_functions.py), and every replacement of `REPLACEMENTS` that all ranks can take is set (a collective:
    every rank calls it at the same point). The fingerprints are read with DeepSpeed's own functions in place, where
    an earlier engine of the process replaced them."""
    if engine.zero_optimization_stage() == 3 and not engine.is_deepcompile_enabled():
        apply_zero3_functions_classically(engine.module)
    with deepspeeds_own_process_wide():
        return streamline(engine, replacements=REPLACEMENTS, read=READ)


def with_zero3(fast_path: FastPath, zero3: FastPath) -> FastPath:
    """The optimizers' fast path (train/zero_optimizer.py) and ZeRO-3's bookkeeping as one, for the run's line."""
    return FastPath(fast_path.on + zero3.on, {**fast_path.unfit, **zero3.unfit}, {**fast_path.changed, **zero3.changed},
                    {**fast_path.differing, **zero3.differing}, fast_path.versions,
                    {**(fast_path.read or zero_optimizer.READ), **(zero3.read or {})})  # fmt: skip


def unfit(engine) -> str | None:
    """Why an engine's ZeRO-3 bookkeeping is not the one every replacement was written for: another stage, DeepCompile,
    an offload of the weights or the optimizer, hpZ's secondary partition, quantized weights, ZenFlow."""
    if engine.zero_optimization_stage() != 3:
        return f"ZeRO stage {engine.zero_optimization_stage()}"
    if engine.is_deepcompile_enabled():
        return "DeepCompile, which takes ZeRO-3's hooks out"
    offloads = {"parameter offload": engine.zero_offload_param(), "optimizer offload": engine.zero_offload_optimizer()}
    for name, offload in offloads.items():
        if offload is not None and offload.device != "none":
            return name
    if engine.zero_hpz_partition_size() > 1:
        return "hpZ"
    if engine.zero_quantized_weights() or engine.zero_quantized_nontrainable_weights():
        return "quantized weights"
    return "ZenFlow" if engine.optimizer.zenflow else None


# ---- NVTX ranges ---------------------------------------------------------------------------------------------------


def ranges_off(engine) -> None:
    """DeepSpeed's NVTX ranges off (its `enable_nvtx` switch, read at every call of a wrapped function)."""
    from deepspeed.utils import nvtx

    nvtx.enable_nvtx = False


# ---- process-wide: debug lines, module parameters -----------------------------------------------------------------


def lazy_debug_lines(engine) -> None:
    """ZeRO-3's modules call `print_message_when_asked` for `print_rank_0`: the same line printed in the same cases."""
    _replace_everywhere("print_rank_0", print_message_when_asked)


def print_message_when_asked(message, debug: bool = False, force: bool = False) -> None:
    """DeepSpeed's `print_rank_0`: `message` on rank 0 when `debug` or `force` asks for it; the rank is looked up only
    then."""
    if (debug or force) and dist.get_rank() == 0:
        print(message)


def cached_module_parameters(engine) -> None:
    """The coordinator lists a module's parameters with `parameters_kept_on` instead of `iter_params`."""
    _replace_everywhere("iter_params", parameters_kept_on)


def parameters_kept_on(module, recurse: bool = False) -> tuple:
    """DeepSpeed's `iter_params(module, recurse)`: the module's parameters (`named_parameters(recurse=recurse)`, once,
    then kept on the module), then those registered as external to it."""
    kept = module.__dict__.setdefault(PARAMETERS_KEPT, {})
    parameters = kept.get(recurse)
    if parameters is None:
        parameters = kept[recurse] = tuple(param for _, param in module.named_parameters(recurse=recurse))
    external = module.ds_external_parameters()
    return (*parameters, *(param for _, param in external)) if external else parameters


def _replace_everywhere(name: str, replacement: Callable) -> None:
    """DeepSpeed's function `name` replaced by `replacement` in every module of `CALLERS[name]`."""
    modules = [importlib.import_module(module) for module in CALLERS[name]]
    REPLACED.setdefault(name, vars(modules[0])[name])  # the first time: DeepSpeed's own
    for module in modules:
        if vars(module)[name] is REPLACED[name]:
            setattr(module, name, replacement)


@contextlib.contextmanager
def deepspeeds_own_process_wide() -> Iterator[None]:
    """For the block, DeepSpeed's NVTX ranges and its functions that are replaced process-wide, as DeepSpeed has them
    (to read their code; bench/step_overhead.py times DeepSpeed's own bookkeeping beside ours in one process); what
    is replaced inside the block stays replaced after it."""
    from deepspeed.utils import nvtx

    switched = nvtx.enable_nvtx
    kept = [(module, name, vars(module)[name]) for name in REPLACED
            for module in map(importlib.import_module, CALLERS[name])]  # fmt: skip
    nvtx.enable_nvtx = True
    for module, name, _ in kept:
        setattr(module, name, REPLACED[name])
    try:
        yield
    finally:  # what was replaced inside the block stays so
        nvtx.enable_nvtx = switched and nvtx.enable_nvtx
        for module, name, function in kept:
            if vars(module)[name] is REPLACED[name]:
                setattr(module, name, function)


# ---- the forward's marks -------------------------------------------------------------------------------------------


def mark_forward_at_once(engine) -> None:
    """The engine's `_forward_prologue` and `_forward_epilogue` as DeepSpeed's, their walk over the modules over a
    list taken once (the trainer attaches no module after `deepspeed.initialize`), where none of the engine's
    optional parts runs in them (flops profiler, random-LTD, autotuning, fp16 input casting: `_forward_unfit`)."""
    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    modules = tuple(engine.module.modules())

    def forward_prologue(inputs, kwargs) -> None:
        see_memory_usage("Engine before forward", force=engine.memory_breakdown())
        if engine.training_dataloader is None:
            engine.tput_timer.start()
        engine._start_timers(engine.engine_timers.forward_timers)
        for module in modules:
            if module._parameters.__class__ is not ZeROOrderedDict:
                ensure_zero_ordered_dict(module)
            module._parameters._in_forward = True

    def forward_epilogue() -> None:
        for module in modules:  # the prologue made each a ZeROOrderedDict: `isinstance` only for what replaced one
            parameters = module._parameters
            if parameters.__class__ is ZeROOrderedDict or isinstance(parameters, ZeROOrderedDict):
                parameters._in_forward = False
        engine._stop_timers(engine.engine_timers.forward_timers)
        see_memory_usage("Engine after forward", force=engine.memory_breakdown())

    engine._forward_prologue, engine._forward_epilogue = forward_prologue, forward_epilogue


def _forward_unfit(engine) -> str | None:
    optional = {
        "flops profiler": engine.flops_profiler_enabled(),
        "random-LTD": engine.random_ltd_enabled(),
        "autotuning": engine.autotuning_profile_model_info(),
        "fp16 input casting": engine.fp16_auto_cast(),
    }
    return unfit(engine) or next((name for name, on in optional.items() if on), None)  # fmt: skip


# ---- releasing every parameter -------------------------------------------------------------------------------------


def release_every_parameter(engine) -> None:
    """ZeRO-3's optimizer (`_partition_all_parameters`, at every step) releases every parameter in one loop."""
    optimizer = engine.optimizer
    offload_owner = optimizer.parameter_offload
    deepspeeds_own = optimizer._partition_all_parameters
    # The module's parameters do not change after ZeRO-3 has converted them; those a hook registers later as
    # external to the module (a module that returns a parameter) are read at each call, as DeepSpeed does.
    parameters = tuple(offload_owner.module.parameters())
    free_param = _free_param()

    def partition_all_parameters() -> None:
        if logging.getLogger("DeepSpeed").isEnabledFor(logging.DEBUG):  # DeepSpeed logs each release
            return deepspeeds_own()
        external = [param for _, param in offload_owner.module.ds_external_parameters()]
        _release_all(offload_owner.get_param_coordinator(), [*parameters, *external], free_param)

    optimizer._partition_all_parameters = partition_all_parameters


def _free_param() -> Callable:
    """DeepSpeed's `free_param`; with the NVTX ranges off, without the wrapper that would only call it."""
    from deepspeed.runtime.zero.partition_parameters import free_param
    from deepspeed.utils import nvtx

    return free_param if nvtx.enable_nvtx else unwrapped(free_param)


def _release_all(coordinator, parameters: list, free_param: Callable) -> None:
    """`PartitionedParameterCoordinator.release_and_reset_all(module)` and its check after it, for the module's
    `parameters`: a parameter in flight is waited for, every parameter's active submodules are forgotten, every
    available one is freed (by DeepSpeed's `free_param`)."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    inflight = coordinator._PartitionedParameterCoordinator__inflight_param_registry.data
    available, released = ZeroParamStatus.AVAILABLE, 0
    with torch.no_grad():
        for param in parameters:
            if inflight and param in inflight:
                inflight.pop(param).wait()
            param.ds_active_sub_modules.clear()
            if param.ds_status is available:
                if param.ds_tensor is None:  # never partitioned: DeepSpeed's whole path makes its partition
                    param.partition()
                else:
                    free_param(param)
                released += param.ds_numel
            if param.ds_status is not ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(f"{param.ds_summary()} expected to be released")
    coordinator._PartitionedParameterCoordinator__n_available_params -= released


# ---- gathering the persistent parameters again ---------------------------------------------------------------------


def gather_persistent_at_once(engine) -> None:
    """After each step ZeRO-3's optimizer gathers its persistent parameters (`_post_step`: those under
    `stage3_param_persistence_threshold`, the norms at 135M and every weight of the CPU toy) with one collective and
    one wait per parameter (`Init._all_gather`); here with DeepSpeed's coalesced gather, the one its forward fetches
    use: one collective for all of them, each parameter cut from it, the same bytes. The ranks must agree: it calls
    other collectives. Where every persistent parameter's partition group is this rank alone (one rank, the CPU toy
    and a one-GPU run), that gather ends in `_no_gather_coalesced` after ~20 calls a parameter of checks and group
    lookups (`all_gather_coalesced`); the groups are fixed when the parameters are converted, so that is asked once
    and `_no_gather_coalesced` called directly."""
    from deepspeed.runtime.zero.partition_parameters import _no_gather_coalesced

    optimizer = engine.optimizer
    alone: list[bool] = []  # whether every persistent parameter is partitioned over one rank, asked at the first step

    def post_step(timer_names) -> None:
        if optimizer.persistent_parameters:
            persistent = optimizer.persistent_parameters
            if not alone:
                alone.append(all(dist.get_world_size(group=param.ds_process_group) == 1 for param in persistent))
            gather = _no_gather_coalesced if alone[0] else persistent[0].all_gather_coalesced
            gather(persistent).wait()
        if optimizer.swap_optimizer:
            optimizer.optimizer_swapper.log_timers()
        optimizer.invalidate_secondary_tensor()
        optimizer.timers.log(timer_names)

    optimizer._post_step = post_step


# ---- the gradients' way into the reduce bucket and out of it -------------------------------------------------------


def bucket_gradients_directly(engine) -> None:
    """Each parameter's gradient, when its module's backward is done, goes into the reduce bucket
    (`reduce_ready_partitions_and_remove_grads` -> `reduce_independent_p_g_buckets_and_remove_grads` ->
    `__add_grad_to_ipg_bucket`: ~50 calls a parameter through three methods, a `torch.no_grad` decorator and an NVTX
    wrapper); here the same steps in one function: the bucket reduced first where it is full or holds another
    process group's gradients, then the gradient copied into the bucket's buffer and the parameter's gradient made
    a view of it. DeepSpeed's own where AutoEP's folding correction is on."""
    optimizer = engine.optimizer
    from deepspeed.accelerator import get_accelerator

    deepspeeds_own = optimizer.reduce_ready_partitions_and_remove_grads
    reduce_bucket = optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads
    device = Device(get_accelerator())

    def reduce_ready_partitions_and_remove_grads(param) -> None:
        if optimizer._coalesce_grad_reduction:
            return
        if optimizer.autoep_folding_tp_group is not None:
            return deepspeeds_own(param)
        comm_dtype = optimizer.get_param_comm_dtype(param)
        bucket = optimizer.ipg_buckets[comm_dtype]
        group = getattr(param, "ds_process_group", optimizer.dp_process_group)
        if bucket.params and bucket.process_group != group:
            optimizer.report_ipg_memory_usage("In ipg_remove_grads before cross-group reduce_ipg_grads", param.ds_numel)
            reduce_bucket(comm_dtype)
        if bucket.elements + param.ds_numel > optimizer.reduce_bucket_size and bucket.elements > 0:
            optimizer.report_ipg_memory_usage("In ipg_remove_grads before reduce_ipg_grads", param.ds_numel)
            reduce_bucket(comm_dtype)
        if not getattr(param, "ds_grad_is_ready", True):
            return
        if torch.is_grad_enabled():
            with torch.no_grad():
                return _add_to_bucket(optimizer, device, param, bucket, group)
        _add_to_bucket(optimizer, device, param, bucket, group)

    optimizer.reduce_ready_partitions_and_remove_grads = reduce_ready_partitions_and_remove_grads


class Device:
    """DeepSpeed's accelerator and the answers it gives every time (what DeepSpeed asks it for each gradient)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.orders_itself = accelerator.resolves_data_dependency()  # no stream to wait on
        self.synchronized = accelerator.is_synchronized_device()  # no stream to record a tensor's use on


def _add_to_bucket(optimizer, device: Device, param, bucket, group) -> None:
    """`__add_grad_to_ipg_bucket(param)` (its ZenFlow branch aside, which the replacement is not set for)."""
    accelerator = device.accelerator
    if not device.orders_itself:
        optimizer.reduce_and_partition_stream.wait_stream(accelerator.current_stream())
    grad = param.grad
    numel = grad.numel()
    if optimizer.contiguous_gradients and bucket.elements + numel <= optimizer.reduce_bucket_size:
        with accelerator.stream(optimizer.reduce_and_partition_stream):
            in_bucket = bucket.buffer.narrow(0, bucket.elements, numel).view_as(grad)
            in_bucket.copy_(grad, non_blocking=True)
            if not device.synchronized:
                grad.record_stream(accelerator.current_stream())
            grad.data = in_bucket
    bucket.params.append(param)
    bucket.process_group = group
    bucket.elements += numel


def partition_gradients_at_once(engine) -> None:
    """A reduced bucket's gradient partitions go into each parameter's slice of the rank's gradient partition
    (`partition_grads`, once per bucket: ~30 calls a parameter, among them the rank looked up through the process
    group for each); here with the rank looked up once, as every parameter of a bucket is in the same group
    (`__reduce_and_partition_ipg_grads` checks it before), the same copies and additions."""
    optimizer = engine.optimizer
    grad_partitions_by_id = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition

    from deepspeed.accelerator import get_accelerator

    device = Device(get_accelerator())

    def partition_grads(params_to_release: list, grad_partitions: list) -> list:
        buffers = []
        rank = optimizer._get_param_partition_rank(params_to_release[0]) if params_to_release else 0
        for param, grad_partition in zip(params_to_release, grad_partitions, strict=False):  # as DeepSpeed's
            if param.partition_numel() * rank >= param.ds_numel:  # this rank's slice of it is padding only
                param.grad = None
                continue
            optimizer._offload_boundary_param_ids.add(param.ds_id)
            grad_buffer = grad_partitions_by_id[param.ds_id].narrow(0, 0, grad_partition.numel())
            buffers.append(grad_buffer)
            _accumulate(optimizer, device.accelerator, grad_buffer, grad_partition)
            if not device.synchronized and param.grad is not None:
                param.grad.record_stream(device.accelerator.current_stream())
            param.grad = None
        return buffers

    optimizer.partition_grads = partition_grads


def _accumulate(optimizer, accelerator, grad_buffer, grad_partition) -> None:
    """A gradient partition into its buffer: copied at a step's first micro-batch, added after it (on the device; a
    buffer off it is added to on the partition's device and copied back), as `partition_grads` does."""
    if optimizer.micro_step_id == 0:
        grad_buffer.copy_(grad_partition, non_blocking=True)
    elif accelerator.on_accelerator(grad_buffer):
        grad_buffer.add_(grad_partition.to(optimizer.gradient_accumulation_dtype).view(grad_buffer.shape))
    else:
        on_device = grad_buffer.to(grad_partition.device, non_blocking=True)
        on_device.add_(grad_partition.to(optimizer.gradient_accumulation_dtype).view(on_device.shape))
        grad_buffer.copy_(on_device, non_blocking=True)


def scatter_alone(engine) -> None:
    """At one rank a bucket's gradients are their own partitions. `__avg_scatter_grads` reduce-scatters them over
    the group of one all the same (`reduce_scatter_coalesced`: each gradient's chunk concatenated into a new buffer,
    divided by the world size, 1, and handed to the collective; ~10 calls a gradient, and a `device_count()` that
    on DeepSpeed's CPU accelerator spawns `numactl --hardware` when LOCAL_SIZE is unset), which leaves every value
    as it was: x / 1 is x in floating point. Here each partition is its gradient, flattened, with DeepSpeed's dtype
    changes and pre- and post-scaling around it as in its code; `partition_grads` reads them as before."""
    optimizer = engine.optimizer
    factor = optimizer.gradient_predivide_factor
    scaled = optimizer.postscale_gradients and factor != 1.0  # then DeepSpeed divides before and multiplies after

    def avg_scatter_grads(params_to_reduce: list, communication_data_type: torch.dtype) -> list:
        grads = [param.grad for param in params_to_reduce]
        if communication_data_type != optimizer.dtype:
            grads = [grad.to(communication_data_type) for grad in grads]
        if scaled:
            grads = [grad.div(factor) for grad in grads]
        partitions = [grad.view(-1) for grad in grads]  # reduced over one rank
        if scaled:
            partitions = [partition.mul(factor) for partition in partitions]
        if communication_data_type != optimizer.gradient_accumulation_dtype:
            partitions = [partition.to(optimizer.gradient_accumulation_dtype) for partition in partitions]
        return partitions

    optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads = avg_scatter_grads


def _scatter_unfit(engine) -> str | None:
    """More than one rank reduces for real (at one, every group it could average over, AutoEP's too, is of one)."""
    return "more than one rank" if dist.get_world_size() > 1 else unfit(engine)


# ---- fetching a module's parameters --------------------------------------------------------------------------------


def fetch_in_one_pass(engine) -> None:
    """The coordinator's `fetch_sub_module` once the trace of a step is complete (from the third step on): the same
    gathers, waits and prefetches in the same order (`_fetch_in_one_pass`), without the profiler events, debug
    lines and the three decorators around it (~185 calls a module). DeepSpeed's own while it records the trace, with
    DEBUG logging on, and where it shards leaf modules fast or prefetches from NVMe (neither is set by the trainer)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partitioned_param_coordinator

    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()

    deepspeeds_own, device = coordinator.fetch_sub_module, Device(get_accelerator())
    logger = partitioned_param_coordinator.logger

    def fetch_sub_module(current_submodule, forward: bool) -> None:
        if not coordinator.is_complete_trace() or logger.isEnabledFor(logging.DEBUG):
            return deepspeeds_own(current_submodule, forward)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return _fetch_one_at_a_time(coordinator, device, current_submodule, forward)
        _fetch_one_at_a_time(coordinator, device, current_submodule, forward)

    coordinator.fetch_sub_module = fetch_sub_module


def _fetch_unfit(engine) -> str | None:
    from deepspeed.runtime.zero import partitioned_param_coordinator

    if unfit(engine):
        return unfit(engine)
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    if coordinator.fast_sharding_for_leaf_module or coordinator._PartitionedParameterCoordinator__prefetch_nvme:
        return "fast leaf-module sharding or NVMe prefetch"
    return "the coordinator's profiler" if partitioned_param_coordinator.ENABLE_PROFILER else None


def _fetch_one_at_a_time(coordinator, device: Device, module, forward: bool) -> None:
    """`fetch_sub_module`'s guard: in backward, autograd may run a leaf module's hooks from several threads, and only
    the first fetches (the others wait for it); a module fetched in backward joins the active ones."""
    import threading

    from deepspeed.utils import z3_leaf_module

    needs_sync = not forward and z3_leaf_module(module)
    events = coordinator._PartitionedParameterCoordinator__ongoing_fetch_leaf_module_events
    lock = coordinator._PartitionedParameterCoordinator__leaf_module_lock
    if needs_sync:
        with lock:
            running = events.get(module.ds_id)
            if running is None:
                events[module.ds_id] = threading.Event()
        if running is not None:
            running.wait()
            return
    if not forward:
        coordinator._PartitionedParameterCoordinator__active_backward_submodules[module.ds_id] = module
    try:
        _fetch_in_one_pass(coordinator, device, module, forward, z3_leaf_module(module))
    finally:
        if needs_sync:
            with lock:
                done = events.pop(module.ds_id, None)
            if done is not None:
                done.set()


def _fetch_in_one_pass(coordinator, device: Device, module, forward: bool, is_leaf: bool) -> None:
    """`_fetch_sub_module_impl` with a complete trace: gather what is not available, wait for what is in flight, take
    this module's parameters off the prefetch queue, prefetch the next ones up to the bucket size. DeepSpeed's sets
    of parameters are kept here by `id` (what a tensor's hash is, without a Python `Tensor.__hash__` call each)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordination
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gathered, missing = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    params_to_fetch = {id(param): param for param in coordination.iter_params(module, recurse=is_leaf)}
    unavailable = [param for param in params_to_fetch.values() if param.ds_status is missing]
    if unavailable and sum(param.partition_numel() for param in unavailable) > 0:
        coordinator._PartitionedParameterCoordinator__all_gather_params(set(params_to_fetch.values()), forward)
    inflight = coordinator._PartitionedParameterCoordinator__inflight_param_registry.data
    active_backward = coordinator._PartitionedParameterCoordinator__active_backward_submodules
    in_checkpoint_recompute = forward and torch._C._current_graph_task_id() != -1
    for param in params_to_fetch.values():
        param.ds_active_sub_modules.add(module.ds_id)
        if in_checkpoint_recompute and active_backward and not param.requires_grad:
            coordination.update_recompute_parameters(next(reversed(active_backward.values())), param)
        if inflight and param in inflight:
            _wait_for(coordinator, device, inflight.pop(param))
        if param.ds_status is not gathered:
            raise AssertionError(param.ds_summary())
    if not device.orders_itself:
        device.accelerator.current_stream().wait_stream(coordinator._PartitionedParameterCoordinator__allgather_stream)
    _take_off_the_queue(coordinator, module, params_to_fetch)
    _prefetch(coordinator, forward, missing)
    coordinator._PartitionedParameterCoordinator__step_id += 1


def _wait_for(coordinator, device: Device, handle) -> None:
    """A gather in flight waited for, at most `__max_ongoing_fetch_events` of them left queued on the device."""
    ongoing = coordinator._PartitionedParameterCoordinator__ongoing_fetch_events
    with device.accelerator.stream(coordinator._PartitionedParameterCoordinator__allgather_stream):
        while ongoing and ongoing[0].query():
            ongoing.popleft()
        if len(ongoing) > coordinator._PartitionedParameterCoordinator__max_ongoing_fetch_events:
            ongoing.popleft().synchronize()
        handle.wait(handle_dependency=True)
        if not device.accelerator.handles_memory_backpressure():
            event = device.accelerator.Event()
            event.record()
            ongoing.append(event)


def _take_off_the_queue(coordinator, module, params_to_fetch: dict) -> None:
    """This module's parameters (`params_to_fetch`, by id) not yet fetched for this point of the trace, popped off the
    prefetch queue (which must hold exactly them next)."""
    step_id = coordinator._PartitionedParameterCoordinator__step_id
    queue = coordinator._PartitionedParameterCoordinator__param_queue
    last_fetched_for = coordinator._PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for
    not_fetched = {key for key, param in params_to_fetch.items() if last_fetched_for[param] < step_id}
    discarded = {}
    while queue and len(discarded) < len(not_fetched):
        in_trace = queue.popleft()
        last_fetched_for[in_trace.param] = in_trace.step_id_last_used_at
        discarded[id(in_trace.param)] = in_trace.param
    if discarded.keys() != not_fetched:
        expected = tuple(params_to_fetch[key].ds_summary(use_debug_name=True) for key in not_fetched)
        got = tuple(param.ds_summary(use_debug_name=True) for param in discarded.values())
        where = f"module id: {module.ds_id}, training: {module.training}"
        raise RuntimeError(f"tracing error at step {step_id}: \n{where}\nexpected the next {len(not_fetched)} "
                           f"parameters in the parameter fetch queue to be {expected} \nbut got \n {got}.")  # fmt: skip


def _prefetch(coordinator, forward: bool, missing) -> None:
    """The next parameters of the trace gathered ahead, up to the prefetch bucket size and the live-parameter limit."""
    bucket_size = coordinator._PartitionedParameterCoordinator__prefetch_bucket_sz
    if bucket_size <= 0:
        return
    limit = coordinator._PartitionedParameterCoordinator__max_n_available_params
    budget = min(limit - coordinator._PartitionedParameterCoordinator__n_available_params, bucket_size)
    queue = coordinator._PartitionedParameterCoordinator__param_queue
    last_fetched_for = coordinator._PartitionedParameterCoordinator__most_recent_step_id_param_fetched_for
    to_prefetch, numel = {}, 0
    while queue and numel < budget:
        in_trace = queue.popleft()
        param = in_trace.param
        do_prefetch = param.ds_status is missing and id(param) not in to_prefetch
        if in_trace.step_id_last_used_at > last_fetched_for[param]:  # DeepSpeed's max(), stored only where it grows
            last_fetched_for[param] = in_trace.step_id_last_used_at
        if do_prefetch:
            to_prefetch[id(param)] = param
            numel += param.ds_numel
    if numel > 0:
        coordinator._PartitionedParameterCoordinator__all_gather_params(set(to_prefetch.values()), forward)


# ---- the module hooks' work ----------------------------------------------------------------------------------------


def hooks_without_wrapping(engine) -> None:
    """The work ZeRO-3's module hooks call before and after each module's forward and backward
    (`pre_sub_module_forward_function` and its three siblings of `DeepSpeedZeRoOffload`: trace the module, fetch its
    parameters before, release them after), without the `torch.no_grad` decorator (entered only where gradients are
    on) and the two memory reports around each that print only when forced (they never are). DeepSpeed's own with
    ZenFlow (which transposes the weights there)."""
    offload = engine.optimizer.parameter_offload
    from deepspeed.runtime.zero import parameter_offload

    coordinator = offload.get_param_coordinator()

    def fetch(sub_module, forward: bool) -> None:
        if forward:
            parameter_offload.FWD_MODULE_STACK.append(sub_module)
        coordinator.trace_prologue(sub_module)
        if coordinator.is_record_trace():
            coordinator.record_module(sub_module)
        coordinator.fetch_sub_module(sub_module, forward=forward)

    def without_gradients(work, forward: bool):
        def hook_work(sub_module) -> None:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return work(sub_module, forward)
            return work(sub_module, forward)

        return hook_work

    release = lambda sub_module, forward: coordinator.release_sub_module(sub_module, forward=forward)  # noqa: E731
    offload.pre_sub_module_forward_function = without_gradients(fetch, True)
    offload.post_sub_module_forward_function = without_gradients(release, True)
    offload.pre_sub_module_backward_function = without_gradients(fetch, False)
    offload.post_sub_module_backward_function = without_gradients(release, False)


def _replacement(install: Callable[[object], None], reads: tuple[str, ...], why_not=unfit) -> Replacement:
    return Replacement(install, {ENGINE: reads}, why_not)


# ---- the linear layer ----------------------------------------------------------------------------------------------


def lean_linear(engine) -> None:
    """`F.linear` is `lean_zero3_linear` (train/zero3_linear.py) where it is DeepSpeed's ZeRO-3 linear."""
    from deepspeed.accelerator import get_accelerator

    if "linear" in REPLACED or is_deepspeeds(torch.nn.functional.linear):
        _replace_everywhere("linear", lean_zero3_linear(get_accelerator().device_name()))


def _linear_unfit(engine) -> str | None:
    """Whatever else the engine offloads or partitions, its linear layers gather and release their weights the same
    way; only a ZeRO-3 engine without DeepCompile has DeepSpeed's linear in place (unless a recipe turns
    `memory_efficient_linear` off, or quantized weights wrap it)."""
    if engine.zero_optimization_stage() != 3 or engine.is_deepcompile_enabled():
        return unfit(engine)
    if "linear" not in REPLACED and not is_deepspeeds(torch.nn.functional.linear):
        return "F.linear is not DeepSpeed's ZeRO-3 linear"
    return None


REPLACEMENTS = (
    _replacement(ranges_off, RANGES_READS),
    _replacement(lazy_debug_lines, DEBUG_LINES_READS),
    _replacement(cached_module_parameters, PARAMETERS_READS),
    _replacement(mark_forward_at_once, FORWARD_READS, _forward_unfit),
    _replacement(release_every_parameter, RELEASE_READS),
    _replacement(gather_persistent_at_once, GATHER_READS),
    _replacement(bucket_gradients_directly, BUCKET_READS),
    _replacement(partition_gradients_at_once, PARTITION_READS),
    _replacement(scatter_alone, SCATTER_READS, _scatter_unfit),
    _replacement(fetch_in_one_pass, FETCH_READS, _fetch_unfit),
    _replacement(hooks_without_wrapping, HOOK_READS),
    _replacement(lean_linear, LINEAR_READS, _linear_unfit),
)
