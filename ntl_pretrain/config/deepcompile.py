"""`train.compile` at ZeRO-3: DeepSpeed's DeepCompile (issue 73; docs/recipes.md, "ZeRO stage, gathering and compiled
layers"; docs/compatibility.md, "DeepCompile").

At stages 1 and 2 `train.compile` compiles each decoder layer in place (`train/engine.compile_layers`). At ZeRO-3
that cannot work: DeepSpeed gathers and releases each weight in Python hooks around every module, which the compiler
would trace. DeepCompile (`"compile": {"deepcompile": true}` and `engine.compile()`, DeepSpeed >= 0.16.6) removes
those hooks and puts the gathers, releases and gradient reduce-scatters into the compiled graph instead, with
prefetch scheduled from a profile of the first steps. Its runtime is a C++ op that DeepSpeed builds on first use
(`deepspeed/ops/op_builder/dc.py`) and that includes CUDA's and NCCL's headers and calls NCCL directly
(`deepspeed/ops/csrc/includes/deepcompile.h`), and DeepSpeed registers its passes only on a CUDA accelerator
(`deepspeed.compile.util.is_deepcompile_supported`): it does not run on CPU ranks. So `train.compile: true` at ZeRO-3
is refused here, before any process starts, wherever DeepCompile cannot run, each reason in one line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from ntl_pretrain.config.recipe import Recipe, RecipeError

MIN_TORCH = (2, 6)  # deepspeed.compile.util.is_deepcompile_supported: required_torch_version(min_version=2.6)
NO_LEAF_MODULES = {"classes": [], "names": [], "name_suffixes": []}


def deepcompiled(recipe: Recipe, stage: int) -> bool:
    """Whether the run compiles through DeepCompile: `train.compile` at ZeRO-3."""
    return recipe.train.compile and stage == 3


def set_deepcompile(config: dict, recipe: Recipe, path: Path) -> None:
    """The DeepSpeed JSON `config` with DeepCompile on where `train.compile` asks for it at ZeRO-3, after every check
    below; a JSON that turns DeepCompile on by itself is refused (the trainer compiles only on `train.compile`)."""
    section = config.get("compile", {})
    asked_in_json = isinstance(section, dict) and section.get("deepcompile") is True
    if not deepcompiled(recipe, config["zero_optimization"]["stage"]):
        if asked_in_json:
            raise RecipeError(f"{path}: compile.deepcompile: true, but the trainer compiles only where the recipe "
                              f"says so; set train.compile: true (at ZeRO-3 it is DeepCompile) and leave "
                              f"compile.deepcompile out of the JSON")  # fmt: skip
        return
    check_deepcompile_combination(config, recipe, path)
    reason = why_deepcompile_cannot_run(recipe.train.device)
    if reason is not None:
        raise RecipeError(f"train.compile: at ZeRO-3 the trainer compiles through DeepSpeed's DeepCompile, which "
                          f"{reason}; set train.compile: false, or deepspeed.zero_stage: 2 to compile each decoder "
                          f"layer instead")  # fmt: skip
    config["compile"] = {**section, "deepcompile": True}
    # DeepCompile gathers inside the graph; a leaf module's own backward hook would reduce its gradients again.
    config["zero_optimization"]["leaf_module"] = dict(NO_LEAF_MODULES)


def why_deepcompile_cannot_run(device: str) -> str | None:
    """None where DeepCompile runs for ranks on `device` (`train.device`), else why not, as a clause: the installed
    DeepSpeed lacks it (before 0.16.6), torch is older than 2.6, or the ranks run on CPU (its C++ op includes CUDA's
    and NCCL's headers and calls NCCL; on CPU DeepSpeed's build of it stops at `#include <cuda.h>`:
    docs/compatibility.md, "DeepCompile")."""
    import torch

    if not deepspeed_has_deepcompile():
        return f"DeepSpeed {importlib.metadata.version('deepspeed')} does not have (0.16.6 or newer has it)"
    if _release(torch.__version__) < MIN_TORCH:
        return f"needs torch 2.6 or newer, not {torch.__version__}"
    if ranks_on_cpu(device):
        return "runs on CUDA GPUs only (its C++ op is built against CUDA and NCCL), and these ranks run on CPU"
    return None


def deepspeed_has_deepcompile() -> bool:
    """Whether the installed DeepSpeed ships DeepCompile's ZeRO-3 entry (read from its files: importing DeepSpeed
    would choose an accelerator here, in the launcher)."""
    package = importlib.util.find_spec("deepspeed")
    return package is not None and (Path(package.origin).parent / "compile" / "init_z3.py").is_file()


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_deepcompile_combination(config: dict, recipe: Recipe, path: Path) -> None:
    """What DeepCompile and the trainer do not run together: ZeRO-3 leaf modules named in the JSON (their backward
    hooks would reduce gradients that DeepCompile's graph reduces), the vocabulary-parallel head (its collectives
    outside the engine have never run inside a DeepCompile graph: a 2-GPU run must show them first), answers
    generated during training (`eval.every_steps`: `generate` calls the model outside the engine, where DeepCompile
    has taken out the hooks that gather its weights)."""
    named = {key: value for key, value in (config["zero_optimization"].get("leaf_module") or {}).items() if value}
    if named:
        raise RecipeError(f"{path}: zero_optimization.leaf_module: {named} with train.compile at ZeRO-3: DeepCompile "
                          f"gathers each weight inside the compiled graph and a leaf module's backward hook would "
                          f"reduce its gradients a second time; remove leaf_module, or set train.compile: "
                          f"false")  # fmt: skip
    if recipe.loss.vocab_parallel_size > 1:
        raise RecipeError(f"loss.vocab_parallel_size: {recipe.loss.vocab_parallel_size} with train.compile at "
                          f"ZeRO-3 (DeepCompile): the vocabulary-parallel head has not run inside a DeepCompile "
                          f"graph yet; set loss.vocab_parallel_size: 1 or train.compile: false")  # fmt: skip
    if recipe.eval.every_steps is not None:
        raise RecipeError(f"eval.every_steps: {recipe.eval.every_steps} with train.compile at ZeRO-3 (DeepCompile): "
                          f"generating answers calls the model outside the engine, where DeepCompile has taken out "
                          f"the hooks that gather its weights; set eval.every_steps: null (`ntl-pretrain eval` "
                          f"answers them from a checkpoint) or train.compile: false")  # fmt: skip


def ranks_on_cpu(device: str) -> bool:
    """Whether the ranks of a run with `train.device: device` run on CPU (the launcher's rule)."""
    if device == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()
