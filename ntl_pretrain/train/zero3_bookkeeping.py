"""What the trainer replaces in ZeRO-3's parameter bookkeeping, so that a step costs its gathers and not DeepSpeed's
Python around them (issue 73; docs/benchmarks.md, "ZeRO-3 bookkeeping"; docs/compatibility.md).

On the CPU toy of bench/step_overhead.py (30 layers, the recipe's defaults) a ZeRO-3 step made ~198k Python calls
against ~20k for a plain step. Each replacement below is set only where DeepSpeed's code is the code it was written
against (DeepSpeed `READ_FROM`, fingerprinted in `READ`; train/zero_optimizer.py does the same for the optimizers'
per-tensor work): a DeepSpeed that changed any of it keeps its own code (slower, never wrong), the trainer says so
on rank 0, and `tests/test_zero3_bookkeeping.py` fails until someone reads the new code.

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
- `gather_persistent_at_once` (after each step): see its docstring. The optimizer instance only.

None of them changes a tensor: the weights, gradients and losses are DeepSpeed's bit for bit.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ntl_pretrain.train.zero3_functions import apply_zero3_functions_classically
from ntl_pretrain.train.zero_optimizer import ZERO_3, source_fingerprint

READ_FROM = "0.19.8"
NVTX = "deepspeed.utils.nvtx"
PARTITIONING = "deepspeed.runtime.zero.partition_parameters"
COORDINATION = "deepspeed.runtime.zero.partitioned_param_coordinator"
OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
COORDINATOR = f"{COORDINATION}.PartitionedParameterCoordinator"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
# sha256 (first 16 hex digits) of the source of each DeepSpeed function a replacement replaces or relies on, as read
# in DeepSpeed READ_FROM.
READ = {
    f"{NVTX}.instrument_w_nvtx": "c538ccdda7c8ea15",
    f"{PARTITIONING}.print_rank_0": "bdf0d39499da2560",
    f"{COORDINATION}.iter_params": "594f9e285a48be13",
    f"{COORDINATION}.get_all_parameters": "859e0b924ea8fbbc",
    f"{ZERO_3}._partition_all_parameters": "5612df89a66654a6",
    f"{OFFLOAD}.DeepSpeedZeRoOffload.partition_all_parameters": "d916ff2d400331ea",
    f"{COORDINATOR}.release_and_reset_all": "dba16cef435ceb5e",
    f"{COORDINATOR}._PartitionedParameterCoordinator__release_param": "cd752be64275c3b9",
    f"{PARTITIONING}.Init._partition": "16a49ed9fa9f94e6",
    f"{PARTITIONING}.Init._partition_param": "0a3cc348590e1436",
    f"{PARTITIONING}.free_param": "96cebaaa66079050",
    f"{ZERO_3}._post_step": "d993f8fa66f06633",
    f"{PARTITIONING}.Init._convert_to_deepspeed_param": "77281d2526a148fb",
    f"{ENGINE}._forward_prologue": "7f3289ffc96f30e2",
    f"{ENGINE}._forward_epilogue": "2ffc78bd3da0c8c0",
    f"{OFFLOAD}.ensure_zero_ordered_dict": "3fc5a3249cecade4",
}
RANGES_READS = (f"{NVTX}.instrument_w_nvtx",)
DEBUG_LINES_READS = (f"{PARTITIONING}.print_rank_0",)
PARAMETERS_READS = (f"{COORDINATION}.iter_params", f"{COORDINATION}.get_all_parameters")
GATHER_READS = (f"{ZERO_3}._post_step", f"{PARTITIONING}.Init._convert_to_deepspeed_param")
FORWARD_READS = (f"{ENGINE}._forward_prologue", f"{ENGINE}._forward_epilogue", f"{OFFLOAD}.ensure_zero_ordered_dict")
RELEASE_READS = tuple(path for path in READ if path not in
                      RANGES_READS + DEBUG_LINES_READS + PARAMETERS_READS + GATHER_READS + FORWARD_READS)  # fmt: skip
# DeepSpeed's module-level functions replaced process-wide: the modules that call each by its global name (each
# imports it with `from ... import *` or by name).
CALLERS = {
    "print_rank_0": (PARTITIONING, COORDINATION, OFFLOAD, "deepspeed.runtime.zero.stage3"),
    "iter_params": (COORDINATION, OFFLOAD),
}
REPLACED: dict[str, Callable] = {}  # DeepSpeed's own function of each process-wide replacement, once it is replaced
PARAMETERS_KEPT = "_ntl_zero3_parameters"  # where a module keeps its parameter tuples ({recurse: (...)})


def streamline_zero3(engine) -> list[str]:
    """At ZeRO-3 without DeepCompile (which takes the hooks out itself): ZeRO-3's autograd Functions run classically
    (train/zero3_functions.py) and every replacement above that applies is set; the names of those set. Those the
    installed DeepSpeed's code keeps from being set are said on rank 0."""
    if engine.zero_optimization_stage() != 3 or engine.is_deepcompile_enabled():
        return []
    apply_zero3_functions_classically(engine.module)
    replacements = (
        ranges_off,
        lazy_debug_lines,
        cached_module_parameters,
        mark_forward_at_once,
        release_every_parameter,
        gather_persistent_at_once,
    )
    applied = [replace.__name__ for replace in replacements if replace(engine)]
    changed = changed_reads()
    if changed and dist.get_rank() == 0:
        print(f"ntl-pretrain: note: ZeRO-3 runs some of DeepSpeed's own bookkeeping (slower, not wrong): this "
              f"DeepSpeed's {', '.join(changed)} differ from {READ_FROM}'s, which the trainer's replacements were "
              f"written against", file=sys.stderr, flush=True)  # fmt: skip
    return applied


def changed_reads() -> list[str]:
    """The DeepSpeed functions in READ whose source is not the one read (DeepSpeed's own, where one is replaced)."""
    with deepspeeds_own_process_wide():
        return sorted(path for path, read in READ.items() if source_fingerprint(path) != read)


def as_read(paths: tuple[str, ...]) -> bool:
    return not set(paths).intersection(changed_reads())


# ---- NVTX ranges ---------------------------------------------------------------------------------------------------


def ranges_off(engine) -> bool:
    """DeepSpeed's NVTX ranges off (its `enable_nvtx` switch, read at every call of a wrapped function)."""
    if not as_read(RANGES_READS):
        return False
    from deepspeed.utils import nvtx

    nvtx.enable_nvtx = False
    return True


# ---- process-wide: debug lines, module parameters -----------------------------------------------------------------


def lazy_debug_lines(engine) -> bool:
    """ZeRO-3's modules call `print_message_when_asked` for `print_rank_0`: the same line printed in the same cases."""
    return as_read(DEBUG_LINES_READS) and _replace_everywhere("print_rank_0", print_message_when_asked)


def print_message_when_asked(message, debug: bool = False, force: bool = False) -> None:
    """DeepSpeed's `print_rank_0`: `message` on rank 0 when `debug` or `force` asks for it; the rank is looked up only
    then."""
    if (debug or force) and dist.get_rank() == 0:
        print(message)


def cached_module_parameters(engine) -> bool:
    """The coordinator lists a module's parameters with `parameters_kept_on` instead of `iter_params`."""
    return as_read(PARAMETERS_READS) and _replace_everywhere("iter_params", parameters_kept_on)


def parameters_kept_on(module, recurse: bool = False) -> tuple:
    """DeepSpeed's `iter_params(module, recurse)`: the module's parameters (`named_parameters(recurse=recurse)`, once,
    then kept on the module), then those registered as external to it."""
    kept = module.__dict__.setdefault(PARAMETERS_KEPT, {})
    parameters = kept.get(recurse)
    if parameters is None:
        parameters = kept[recurse] = tuple(param for _, param in module.named_parameters(recurse=recurse))
    external = module.ds_external_parameters()
    return (*parameters, *(param for _, param in external)) if external else parameters


def _replace_everywhere(name: str, replacement: Callable) -> bool:
    """DeepSpeed's function `name` replaced by `replacement` in every module of `CALLERS[name]`."""
    modules = [importlib.import_module(module) for module in CALLERS[name]]
    REPLACED.setdefault(name, vars(modules[0])[name])  # the first time: DeepSpeed's own
    for module in modules:
        if vars(module)[name] is REPLACED[name]:
            setattr(module, name, replacement)
    return True


@contextlib.contextmanager
def deepspeeds_own_process_wide() -> Iterator[None]:
    """For the block, DeepSpeed's NVTX ranges and its functions that are replaced process-wide, as DeepSpeed has them
    (to read their source; bench/step_overhead.py times DeepSpeed's own bookkeeping beside ours in one process)."""
    from deepspeed.utils import nvtx

    switched = nvtx.enable_nvtx
    kept = [(module, name, vars(module)[name]) for name in REPLACED
            for module in map(importlib.import_module, CALLERS[name])]  # fmt: skip
    nvtx.enable_nvtx = True
    for module, name, _ in kept:
        setattr(module, name, REPLACED[name])
    try:
        yield
    finally:
        nvtx.enable_nvtx = switched
        for module, name, function in kept:
            setattr(module, name, function)


# ---- the forward's marks -------------------------------------------------------------------------------------------


def mark_forward_at_once(engine) -> bool:
    """The engine's `_forward_prologue` and `_forward_epilogue` as DeepSpeed's, their walk over the modules over a
    list taken once (the trainer attaches no module after `deepspeed.initialize`), where none of the engine's
    optional parts runs in them (flops profiler, random-LTD, autotuning, fp16 input casting)."""
    if not (engine.zero_optimization_partition_weights() and as_read(FORWARD_READS)):
        return False
    optional = (engine.flops_profiler_enabled(), engine.random_ltd_enabled(), engine.autotuning_profile_model_info(),
                engine.fp16_auto_cast())  # fmt: skip
    if any(optional):
        return False
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
        for module in modules:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False
        engine._stop_timers(engine.engine_timers.forward_timers)
        see_memory_usage("Engine after forward", force=engine.memory_breakdown())

    engine._forward_prologue, engine._forward_epilogue = forward_prologue, forward_epilogue
    return True


# ---- releasing every parameter -------------------------------------------------------------------------------------


def _partitioned_as_the_trainer_does(engine, reads: tuple[str, ...]) -> bool:
    """A ZeRO-3 optimizer of the DeepSpeed that was read (at `reads`) with the weights partitioned as the trainer
    partitions them: on the device, without hpZ's secondary partition, quantized weights, an offload of the weights
    or of the optimizer."""
    optimizer = engine.optimizer
    if f"{type(optimizer).__module__}.{type(optimizer).__qualname__}" != ZERO_3 or not as_read(reads):
        return False
    offloads = [engine.zero_offload_param(), engine.zero_offload_optimizer()]
    if any(offload is not None and offload.device != "none" for offload in offloads):
        return False
    quantized = engine.zero_quantized_weights() or engine.zero_quantized_nontrainable_weights()
    return not quantized and engine.zero_hpz_partition_size() == 1


def release_every_parameter(engine) -> bool:
    """ZeRO-3's optimizer (`_partition_all_parameters`, at every step) releases every parameter in one loop."""
    if not _partitioned_as_the_trainer_does(engine, RELEASE_READS):
        return False
    optimizer = engine.optimizer
    offload_owner = optimizer.parameter_offload
    deepspeeds_own = optimizer._partition_all_parameters
    # The module's parameters do not change after ZeRO-3 has converted them; those a hook registers later as
    # external to the module (a module that returns a parameter) are read at each call, as DeepSpeed does.
    parameters = tuple(offload_owner.module.parameters())

    def partition_all_parameters() -> None:
        if logging.getLogger("DeepSpeed").isEnabledFor(logging.DEBUG):  # DeepSpeed logs each release
            return deepspeeds_own()
        external = [param for _, param in offload_owner.module.ds_external_parameters()]
        _release_all(offload_owner.get_param_coordinator(), [*parameters, *external])

    optimizer._partition_all_parameters = partition_all_parameters
    return True


def _release_all(coordinator, parameters: list) -> None:
    """`PartitionedParameterCoordinator.release_and_reset_all(module)` and its check after it, for the module's
    `parameters`: a parameter in flight is waited for, every parameter's active submodules are forgotten, every
    available one is freed."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

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


def gather_persistent_at_once(engine) -> bool:
    """After each step ZeRO-3's optimizer gathers its persistent parameters (`_post_step`: those under
    `stage3_param_persistence_threshold`, the norms at 135M and every weight of the CPU toy) with one collective and
    one wait per parameter (`Init._all_gather`); here with DeepSpeed's coalesced gather, the one its forward fetches
    use: one collective for all of them, each parameter cut from it, the same bytes."""
    if not _partitioned_as_the_trainer_does(engine, GATHER_READS):
        return False
    optimizer = engine.optimizer

    def post_step(timer_names) -> None:
        if optimizer.persistent_parameters:
            persistent = optimizer.persistent_parameters
            persistent[0].all_gather_coalesced(persistent).wait()
        if optimizer.swap_optimizer:
            optimizer.optimizer_swapper.log_timers()
        optimizer.invalidate_secondary_tensor()
        optimizer.timers.log(timer_names)

    optimizer._post_step = post_step
    return True
