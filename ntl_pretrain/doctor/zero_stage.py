"""The doctor's `ZeRO stage` row: at which ZeRO stages the recipe's model fits on this machine, and which one to
train at (docs/recipes.md, "ZeRO stage, gathering and compiled layers").

Model states per rank, in bytes per parameter over N ranks (weights, gradients, fp32 master weights and the two Adam
moments; activations come on top): bf16 runs 16/N at stage 3, 2 + 14/N at stage 2 (the weights whole), 4 + 12/N at
stage 1 (the gradients whole too); fp32 runs 16/N, 4 + 12/N and 8 + 8/N. A stage fits when its states take at most
half of a rank's memory, the rest left to activations and buffers. Stage 2 is the advice wherever it fits (no
gathering in forward and backward: the faster step), else stage 3; the row fails when not even stage 3 fits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ntl_pretrain.doctor.report import Check

# precision: {stage: (bytes per parameter every rank holds whole, bytes per parameter partitioned over the ranks)}
STATE_BYTES = {"bf16": {1: (4, 12), 2: (2, 14), 3: (0, 16)}, "fp32": {1: (8, 8), 2: (4, 12), 3: (0, 16)}}
FIT_SHARE = 0.5


def zero_stage_check(device: torch.device, recipe_path: Path, ranks: int, local_ranks: int) -> Check:
    from ntl_pretrain.config.deepspeed import load_run

    recipe, _ = load_run(recipe_path, [], ranks)
    memory = rank_memory_bytes(device, local_ranks)
    return stage_advice(model_parameters(recipe), recipe.train.precision, ranks, memory, recipe.deepspeed.zero_stage)


def stage_advice(parameters: int, precision: str, ranks: int, memory_bytes: float, running: int) -> Check:
    """The row: each stage's model states per rank, the stage to train at, and the stage the recipe runs."""
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
    figure += f"; train at stage {advice} ({why}: deepspeed.zero_stage: {advice}); the recipe runs stage {running}"
    detail = {"states_per_rank_bytes": per_rank, "advice": advice, "recipe_stage": running}
    return Check("ZeRO stage", True, figure, detail)


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
