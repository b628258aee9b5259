"""What the trainer adds to the recipe's DeepSpeed JSON and to the engine, so that a step costs its arithmetic and
not DeepSpeed's bookkeeping on the host (issue 47; docs/benchmarks.md, "Step overhead").

- `deepspeed.gather: layer` (the default) under ZeRO-3: a decoder layer's parameters are all-gathered at once on
  entering the layer and released on leaving it (DeepSpeed's `zero_optimization.leaf_module`), instead of a
  forward hook, a backward hook, a fetch and a release for each of its ~10 submodules. It holds one layer's
  gathered weights at a time instead of one matrix's (docs/recipes.md, "ZeRO stage", works it out at 8B).
- `train.compile`: each decoder layer compiled in place with torch.compile (stages 1 and 2), its failure one line.
- The ZeRO optimizers' gradient norm, which DeepSpeed 0.19 takes at every step (clipping or not) one parameter at
  a time (a copy to fp64 and a norm each), is taken with one `torch._foreach_norm` per parameter group: the same
  per-tensor fp64 norms, squared, summed and all-reduced as DeepSpeed does, so the same value bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads.architectures import trunk_path


def layer_classes(lm: nn.Module) -> list[str]:
    """The qualified class names of `lm`'s decoder layers: the classes of its `_no_split_modules` (what transformers
    keeps whole when it spreads a model over devices) that the model holds, else, for a family that lists none
    (BioGPT, CTRL, GPT-1), the classes in the trunk's longest module list."""
    by_name = {type(module).__name__: type(module) for module in lm.modules()}
    classes = [by_name[name] for name in sorted(lm._no_split_modules or ()) if name in by_name]
    if not classes:
        stacks = [module for module in lm.get_submodule(trunk_path(lm)).modules() if isinstance(module, nn.ModuleList)]
        classes = list(dict.fromkeys(type(layer) for layer in max(stacks, key=len, default=())))
    return [qualified_name(cls) for cls in classes]


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def engine_config(ds_config: dict, recipe: Recipe, lm: nn.Module) -> dict:
    """`ds_config` for `lm`: under ZeRO-3 with `deepspeed.gather: layer`, its decoder layers join the leaf modules
    (beside those the JSON names, or DeepSpeed's default MoE blocks when it names none)."""
    zero = ds_config["zero_optimization"]
    if zero["stage"] != 3 or recipe.deepspeed.gather != "layer":
        return ds_config
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    config = copy.deepcopy(ds_config)
    leaf = config["zero_optimization"].setdefault("leaf_module", {})
    named = leaf.get("classes", DEFAULT_LEAF_MODULE_CLASSES)
    leaf["classes"] = list(dict.fromkeys([*([named] if isinstance(named, str) else named), *layer_classes(lm)]))
    return config


def foreach_gradient_norm(zero_optimizer) -> None:
    """Give a ZeRO optimizer of DeepSpeed 0.19 (`get_grad_norm_direct`, called once per parameter group at each
    step) the foreach norm, where its own would sum the same: an L2 norm without model, pipeline or expert
    parallelism (none of which the trainer sets up). Any other optimizer is left as it is."""
    kind = type(zero_optimizer).__name__
    if kind not in ("DeepSpeedZeroOptimizer_Stage3", "DeepSpeedZeroOptimizer"):
        return
    if getattr(zero_optimizer, "model_parallel_group", None) is not None or zero_optimizer.model_parallel_rank:
        return
    per_parameter = zero_optimizer.get_grad_norm_direct
    stage3 = kind == "DeepSpeedZeroOptimizer_Stage3"

    def grad_norm(gradients: list[torch.Tensor], params: list[nn.Parameter], norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or any(_parallel_kind(param) for param in params):
            return per_parameter(gradients, params, norm_type)
        if stage3:
            return _stage3_norm(zero_optimizer, gradients, params)
        return _stage1_and_2_norm(zero_optimizer, gradients)

    zero_optimizer.get_grad_norm_direct = grad_norm


def _parallel_kind(param: nn.Parameter) -> bool:
    """A parameter DeepSpeed's norm counts specially: expert-parallel (AutoEP) or replicated by pipeline stages."""
    expert_parallel = getattr(param, "ds_zero_placement_family", "replicated") != "replicated"
    return expert_parallel or hasattr(param, "ds_pipe_replicated")


def _stage3_norm(zero_optimizer, gradients: list[torch.Tensor], params: list[nn.Parameter]) -> torch.Tensor:
    """DeepSpeed 0.19's `DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct`, its L2 case, with foreach norms."""
    from deepspeed import comm
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norms = torch._foreach_norm(gradients, 2, dtype=get_norm_dtype())
    total = torch.sum(torch.pow(torch.stack(norms), 2.0))
    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=zero_optimizer._get_param_partition_group(params[0]))
    total = total ** (1.0 / 2.0)
    invalid = torch.tensor(-1.0, device=zero_optimizer.device, dtype=torch.float)
    return torch.where(total.isnan().logical_or(total.isinf()), invalid, total)


def _stage1_and_2_norm(zero_optimizer, gradients: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed 0.19's `DeepSpeedZeroOptimizer.get_grad_norm_direct` (stages 1 and 2), its L2 case, with foreach
    norms; padding that DeepSpeed appends to the last partition is left out, as there."""
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


def name_data_parallel_layout(module: nn.Module, stage: int) -> None:
    """DeepSpeed's converter to a universal checkpoint (resuming on another world size, `checkpoint/reshard.py`)
    reads a ZeRO-1 or -2 checkpoint's tensor- and pipeline-parallel layout, which the engine saves only when the
    module names one: ours names plain data parallelism (no patterns of split or replicated parameters)."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    if stage != 3:
        data_parallel_only = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        setattr(module, UNIVERSAL_CHECKPOINT_INFO, data_parallel_only)


def compile_layers(lm: nn.Module) -> None:
    """`train.compile`: each decoder layer (the outermost modules of `layer_classes`) compiled in place
    (`nn.Module.compile`: its parameters and state-dict names stay as they are, so checkpoints and export do not
    change)."""
    classes, compiled = set(layer_classes(lm)), []
    for name, module in lm.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in compiled)
        if not inside and qualified_name(type(module)) in classes:
            module.compile()
            compiled.append(name)


@contextlib.contextmanager
def compile_failures_named() -> Iterator[None]:
    """A torch.compile failure, which surfaces in the first forward or backward of a compiled layer, as one line
    naming `train.compile` (the trainer prints an error's first line)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as error:
        cause = getattr(error, "inner_exception", None) or error  # a backend's failure is wrapped: name its own
        reason = next(line.strip() for line in f"{type(cause).__name__}: {cause}".splitlines() if line.strip())
        raise RuntimeError(f"train.compile: torch.compile failed ({reason}); train without it: "
                           "train.compile=false") from error  # fmt: skip
