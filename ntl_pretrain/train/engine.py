"""What the trainer adds to the recipe's DeepSpeed JSON and to the engine, so that a step costs its arithmetic and
not DeepSpeed's bookkeeping on the host (issue 47; docs/benchmarks.md, "Step overhead").

- `deepspeed.gather: layer` (the default) under ZeRO-3: a decoder layer's parameters are all-gathered at once on
  entering the layer and released on leaving it (DeepSpeed's `zero_optimization.leaf_module`), instead of a
  forward hook, a backward hook, a fetch and a release for each of its ~10 submodules. It holds one layer's
  gathered weights at a time instead of one matrix's (docs/recipes.md, "ZeRO stage", works it out at 8B).
- ZeRO-3's prefetch sized to a whole decoder layer, where the JSON leaves it to us (`prefetch_bucket_size`).
- `train.compile`: each decoder layer compiled in place with torch.compile (stages 1 and 2), or at ZeRO-3 the whole
  model through DeepSpeed's DeepCompile (`config/deepcompile.py`, CUDA only); a compile failure is one line.
- What the trainer replaces inside DeepSpeed's ZeRO optimizers (the gradient norm, bf16's finite scan, ...) lives in
  train/zero_optimizer.py.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

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
    """`ds_config` for `lm` under ZeRO-3: with `deepspeed.gather: layer` its decoder layers join the leaf modules
    (beside those the JSON names, or DeepSpeed's default MoE blocks when it names none), and where the JSON does not
    set `stage3_prefetch_bucket_size` (or sets "auto") it is sized to prefetch a whole decoder layer. Under DeepCompile
    (which gathers inside the compiled graph) it stays as `config/deepcompile.py` made it."""
    if ds_config["zero_optimization"]["stage"] != 3 or _deepcompile(ds_config):
        return ds_config
    config = copy.deepcopy(ds_config)
    zero = config["zero_optimization"]
    zero.setdefault("stage3_prefetch_bucket_size", prefetch_bucket_size(lm))
    if recipe.deepspeed.gather == "layer":
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

        leaf = zero.setdefault("leaf_module", {})
        named = leaf.get("classes", DEFAULT_LEAF_MODULE_CLASSES)
        leaf["classes"] = list(dict.fromkeys([*([named] if isinstance(named, str) else named), *layer_classes(lm)]))
    return config


def _deepcompile(ds_config: dict) -> bool:
    return (ds_config.get("compile") or {}).get("deepcompile") is True


def prefetch_bucket_size(lm: nn.Module) -> int:
    """Elements ZeRO-3 may gather ahead of the module it runs: the largest decoder layer's, so that the next layer's
    weights arrive while this one computes (DeepSpeed's default, 5e7, holds 0.23 of a Llama-3-8B layer: its MLP
    matrices would be fetched with nothing to overlap; docs/recipes.md works it out), and never less than that
    default (a small model's layers are prefetched several at a time, as before)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    default = int(DeepSpeedZeroConfig.model_fields["prefetch_bucket_size"].default)
    return max(default, max((_numel(layer) for layer in decoder_layers(lm)), default=0))


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The outermost modules of `layer_classes(lm)`."""
    classes, found = set(layer_classes(lm)), []
    for name, module in lm.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer, _ in found)
        if not inside and qualified_name(type(module)) in classes:
            found.append((name, module))
    return [module for _, module in found]


def _numel(module: nn.Module) -> int:
    """A module's parameter count, of the whole parameters where ZeRO-3 holds a partition (`ds_numel`)."""
    return sum(getattr(param, "ds_numel", param.numel()) for param in module.parameters())


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


def compile_model(engine, lm: nn.Module) -> None:
    """`train.compile`: under DeepCompile (ZeRO-3) the engine compiles the whole model with DeepSpeed's backend,
    which takes ZeRO-3's hooks out and its gathers, releases and reductions into the graph; at stages 1 and 2 each
    decoder layer is compiled in place."""
    if not engine.is_deepcompile_enabled():
        return compile_layers(lm)
    try:
        engine.compile()
    except RuntimeError as error:  # its C++ op did not build here (no CUDA headers, no NCCL): the compiler's error
        raise RuntimeError(f"train.compile: DeepSpeed's DeepCompile could not start ({first_error_line(error)}); "
                           "train without it: train.compile=false") from error  # fmt: skip


def first_error_line(error: Exception) -> str:
    """A compiler's first `error:` line where the error holds a build log (DeepSpeed's JIT build passes ninja's whole
    output), else the error's first line."""
    text = f"{type(error).__name__}: {error}"
    compiler = [line.strip() for line in text.splitlines() if "error:" in line]
    return compiler[0] if compiler else text.splitlines()[0]


def compile_layers(lm: nn.Module) -> None:
    """`train.compile`: each decoder layer (the outermost modules of `layer_classes`) compiled in place
    (`nn.Module.compile`: its parameters and state-dict names stay as they are, so checkpoints and export do not
    change)."""
    for layer in decoder_layers(lm):
        layer.compile()


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
