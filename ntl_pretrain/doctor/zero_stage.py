"""The doctor's `ZeRO stage` row: at which ZeRO stages the recipe's model fits on this machine, and which one to
train at (docs/recipes.md, "ZeRO stage, gathering and compiled layers").

Model states per rank, in bytes per parameter over N ranks (weights, gradients, fp32 master weights and the two Adam
moments; activations come on top): bf16 runs 16/N at stage 3, 2 + 14/N at stage 2 (the weights whole), 4 + 12/N at
stage 1 (the gradients whole too); fp32 runs 16/N, 4 + 12/N and 8 + 8/N. A stage fits when its states take at most
half of a rank's memory, the rest left to activations and buffers. Stage 2 is the advice wherever it fits (no
gathering in forward and backward: the faster step), else stage 3; the row fails when not even stage 3 fits.

With the stage, the engine (`engine_advice`): on GPUs `train.compile: true`, which at stage 2 compiles each decoder
layer and at stage 3 is DeepSpeed's DeepCompile where it runs here (config/deepcompile.py says why not, else);
eager on CPU ranks, where DeepCompile does not run and compiling takes minutes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ntl_pretrain.doctor.report import Check

# precision: {stage: (bytes per parameter every rank holds whole, bytes per parameter partitioned over the ranks)}
STATE_BYTES = {"bf16": {1: (4, 12), 2: (2, 14), 3: (0, 16)}, "fp32": {1: (8, 8), 2: (4, 12), 3: (0, 16)}}
FIT_SHARE = 0.5


def zero_stage_check(device: torch.device, recipe_path: Path, ranks: int, local_ranks: int) -> Check:
    from ntl_pretrain.config.deepcompile import why_deepcompile_cannot_run
    from ntl_pretrain.config.deepspeed import load_run

    recipe, _ = load_run(recipe_path, [], ranks)
    memory = rank_memory_bytes(device, local_ranks)
    refusal = why_deepcompile_cannot_run(device.type)
    return stage_advice(model_parameters(recipe), recipe.train.precision, ranks, memory, recipe.deepspeed.zero_stage,
                        device.type == "cuda", refusal)  # fmt: skip


def stage_advice(parameters: int, precision: str, ranks: int, memory_bytes: float, running: int,
                 on_gpu: bool = False, deepcompile_refusal: str | None = None) -> Check:  # fmt: skip
    """The row: each stage's model states per rank, the stage and engine to train with, and the stage the recipe
    runs."""
    per_rank = {stage: (whole + partitioned / ranks) * parameters
                for stage, (whole, partitioned) in STATE_BYTES[precision].items()}  # fmt: skip
    fits = [stage for stage in (2, 3) if per_rank[stage] <= FIT_SHARE * memory_bytes]
    states = ", ".join(f"stage {stage} {per_rank[stage] / 1e9:.1f} GB" for stage in sorted(per_rank))
    figure = (f"{parameters / 1e6:,.1f}M parameters, {precision}, {ranks} rank(s) of {memory_bytes / 1e9:.0f} GB: "
              f"model states per rank {states}")  # fmt: skip
    if not fits:
        return Check("ZeRO stage", False, f"{figure}; not even stage 3 fits in half a rank's memory: more ranks, or "
                                          "offload (pkg:ntl_pretrain/config/zero3_offload.json)")  # fmt: skip
    advice = fits[0]
    why = "the weights fit whole: no gathering, the faster step" if advice == 2 else "only stage 3 fits"
    engine = engine_advice(advice, on_gpu, deepcompile_refusal)
    figure += (f"; train at stage {advice} ({why}: deepspeed.zero_stage: {advice}), {engine}; the recipe runs stage "
               f"{running}")  # fmt: skip
    detail = {"states_per_rank_bytes": per_rank, "advice": advice, "engine": engine, "recipe_stage": running}
    return Check("ZeRO stage", True, figure, detail)


def engine_advice(stage: int, on_gpu: bool, deepcompile_refusal: str | None) -> str:
    """How to run the advised stage: compiled on GPUs (each decoder layer at stage 2; DeepCompile at stage 3 where it
    runs), else eager."""
    if not on_gpu:
        return "eager (train.compile: false: on CPU ranks compiling takes minutes and DeepCompile does not run)"
    if stage != 3:
        return "each decoder layer compiled (train.compile: true)"
    if deepcompile_refusal is None:
        return "compiled by DeepSpeed's DeepCompile (train.compile: true)"
    return f"eager (train.compile: false: DeepCompile {deepcompile_refusal})"


def model_parameters(recipe) -> int:
    """The recipe's model's parameters, counted on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.model.build import hf_config
    from ntl_pretrain.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(recipe.tokenizer.path or recipe.init_from)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(hf_config(recipe, tokenizer))
    return sum(param.numel() for param in lm.parameters())


def rank_memory_bytes(device: torch.device, local_ranks: int) -> float:
    """A GPU's memory, or on CPU ranks the host's memory shared by the node's ranks."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return psutil.virtual_memory().total / local_ranks
