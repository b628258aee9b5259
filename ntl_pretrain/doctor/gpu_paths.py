"""Check 3b: the numeric paths a GPU run takes that the CPU test suite can only reach with stand-ins.

- bf16 gradient accumulation: a ZeRO-3 engine built from the generated DeepSpeed config (bf16) accumulates 16
  micro-batches and reduces them over the ranks; the accumulated gradient must keep what bf16 sums round away
  (`deepspeed_config.set_bf16_gradient_dtypes`). Runs on every device.
- reduce-scatter fp32 / bf16: what fp32 gradient reduction costs over bf16 on this machine's links (2+ ranks).
- chunked head fp32 accumulation: whether torch's `addmm(..., out_dtype=float32)` runs here and accumulates in
  fp32 (`loss/chunked.mixed_addmm_works`), or the head takes the slower upcast path. Both are correct.
- flash-attention documents (GPU with flash-attn): a tiny Llama with flash-attention 2, two packed rows and the
  trainer's varlen arguments (`document_attention.py`): a document's logits equal its logits alone (sdpa).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.collectives import synchronize
from ntl_pretrain.doctor.report import Check

MICRO_BATCHES = 16
ELEMENTS_PER_RANK = 4
REDUCE_SCATTER_MIB = {"cuda": 256, "cpu": 32}  # of fp32 gradients
FIRST, SECOND = [5, 17, 42, 8, 3, 11, 29], [9, 23, 61, 7, 30, 11, 2, 44, 13]
FLASH_TOLERANCE = 2e-2  # bf16 logits of a 2-layer model, relative to the largest


def first_input(world_size: int) -> float:
    """Rank 0's first micro-batch input, 512 x world: the mean gradient is then about 32 at any world size, where
    bf16's spacing (0.25) rounds away each later micro-batch's 1/16 entirely. (A fixed 256 left 3.25 + 15/16 at 5
    ranks, every sum exact in bf16: a check that could not fail.)"""
    return 512.0 * world_size


def exact_accumulated_gradient(world_size: int) -> float:
    """d(w·x)/dw = x; rank 0's first micro-batch has x = `first_input`, every other 1; DeepSpeed scales each
    micro-batch by 1/16 and averages over ranks."""
    return (first_input(world_size) + MICRO_BATCHES * world_size - 1) / (MICRO_BATCHES * world_size)


def gradient_accumulation_check(device: torch.device) -> Check:
    """A one-row weight of ELEMENTS_PER_RANK x world elements: ZeRO-3 gives every rank its own real elements. (With
    fewer elements than ranks, the ranks past them hold only padding, DeepSpeed gives them no gradient, and an exact
    setup failed there: 4 elements on 5+ ranks.)"""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused here; a 2-minute build on CPU
    from ntl_pretrain.config.deepspeed import build_deepspeed_config
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.doctor.arguments import TINY_RECIPE

    world = dist.get_world_size()
    recipe = load_recipe(TINY_RECIPE, ["train.precision=bf16", "train.micro_batch_size=1",
                                       f"train.global_batch_size={MICRO_BATCHES * world}"])  # fmt: skip
    config = build_deepspeed_config(recipe, world)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition the small weight too
    width = ELEMENTS_PER_RANK * world
    model = torch.nn.Linear(width, 1, bias=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    for micro in range(MICRO_BATCHES):
        big = micro == 0 and dist.get_rank() == 0
        x = torch.full((1, width), first_input(world) if big else 1.0, dtype=torch.bfloat16)
        engine.backward(engine(x.to(engine.device)).sum())
        if micro < MICRO_BATCHES - 1:
            engine.step()
    buffer = engine.optimizer.grad_partitions_flat_buffer
    accumulator = str(buffer.dtype).removeprefix("torch.")
    accumulated = buffer[: model.weight.ds_tensor.numel()].detach().float().cpu().clone()  # the step zeroes it
    engine.step()
    return accumulation_verdict(accumulated, world, accumulator)


def accumulation_verdict(accumulated: torch.Tensor, world: int, accumulator: str) -> Check:
    """This rank's accumulated gradient elements against the exact mean; none at all is a failure too."""
    exact = exact_accumulated_gradient(world)
    error = (accumulated - exact).abs().max().item() / exact if accumulated.numel() else 1.0
    first = f"{accumulated[0].item():.6f}" if accumulated.numel() else "no elements on this rank"
    figure = f"{MICRO_BATCHES} micro-batches x {world} rank(s): {first}, exact {exact:.6f} (relative error " \
        f"{error:.1e} over {accumulated.numel()} elements; {accumulator} accumulator)"  # fmt: skip
    return Check("bf16 gradient accumulation", error < 1e-6, figure, {"relative_error": error})


def reduce_scatter_cost_check(device: torch.device) -> Check:
    world = dist.get_world_size()
    if world == 1:
        return Check("reduce-scatter fp32 / bf16", None, "1 rank: nothing to measure")
    seconds = {}
    for dtype in (torch.bfloat16, torch.float32):
        elements = REDUCE_SCATTER_MIB[device.type] * 2**20 // 4 // world * world
        source, target = torch.ones(elements, dtype=dtype, device=device), torch.empty(elements // world, dtype=dtype,
                                                                                     device=device)  # fmt: skip
        dist.reduce_scatter_tensor(target, source)  # warm-up
        best = float("inf")
        for _ in range(3):
            synchronize(device)
            dist.barrier()
            started = time.perf_counter()
            dist.reduce_scatter_tensor(target, source)
            synchronize(device)
            best = min(best, time.perf_counter() - started)
        seconds[str(dtype).removeprefix("torch.")] = best
    ratio = seconds["float32"] / seconds["bfloat16"]
    figure = f"{elements:,} gradients: fp32 {seconds['float32'] * 1e3:.1f} ms, bf16 " \
        f"{seconds['bfloat16'] * 1e3:.1f} ms ({ratio:.2f}x)"  # fmt: skip
    return Check("reduce-scatter fp32 / bf16", True, figure, {"seconds": seconds, "ratio": ratio})


def mixed_addmm_check(device: torch.device) -> Check:
    from ntl_pretrain.loss.chunked import mixed_addmm_works

    works = mixed_addmm_works(device, torch.bfloat16, torch.float32)
    figure = "addmm with out_dtype=float32 accumulates bf16 products in fp32" if works else \
        "addmm with out_dtype unavailable or rounding here: the weight gradient takes the upcast path"  # fmt: skip
    return Check("chunked head fp32 accumulation", True, figure, {"out_dtype_addmm": works})


def flash_documents_check(device: torch.device) -> Check:
    name = "flash-attention documents"
    if device.type != "cuda":
        return Check(name, None, "GPU only")
    from ntl_pretrain.model import flash_attention

    if (error := flash_attention.import_error()) is not None:
        return Check(name, None if not flash_attention.installed() else False, f"flash-attn: {error}")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ntl_pretrain.model.document_attention import varlen_arguments

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    flash = AutoModelForCausalLM.from_config(config, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    flash = flash.to(device).eval()
    rows = 2
    ids = torch.tensor([FIRST + SECOND] * rows, device=device)
    positions = torch.tensor([list(range(len(FIRST))) + list(range(len(SECOND)))] * rows)
    with torch.no_grad():
        packed = flash(input_ids=ids, position_ids=positions.to(device), **on(varlen_arguments(positions), device))
        alone = flash(input_ids=torch.tensor([SECOND] * rows, device=device)).logits
    error = ((packed.logits[:, len(FIRST) :] - alone).abs().max() / alone.abs().max()).item()
    figure = f"{rows} packed rows, flash_attention_2 with the varlen arguments: the second document's logits " \
        f"within {error:.1e} of it alone (tolerance {FLASH_TOLERANCE:g})"  # fmt: skip
    return Check(name, error <= FLASH_TOLERANCE, figure, {"relative_error": error})


def on(arguments: dict, device: torch.device) -> dict:
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in arguments.items()}


GPU_PATH_CHECKS = {
    "bf16 gradient accumulation": gradient_accumulation_check,
    "reduce-scatter fp32 / bf16": reduce_scatter_cost_check,
    "chunked head fp32 accumulation": mixed_addmm_check,
    "flash-attention documents": flash_documents_check,
}
