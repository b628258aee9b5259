"""Bytes the output layer moves per rank and micro-batch under ZeRO-3, with and without vocabulary parallelism.

    python bench/vocab_parallel_bytes.py [--tokens-per-rank 8192] [--skip-measure]

1. From the real shapes of Llama-3-8B, Qwen2.5-0.5B and SmolLM2-135M (bf16 weights and gradients), per rank and
   micro-batch of `--tokens-per-rank` positions, data-parallel world W = k:
   ZeRO-3:           all-gather the [V, H] matrix (kept from forward to backward, DeepSpeed's default reuse
                     distance) + reduce-scatter its gradient         = 2 · (W-1)/W · V·H·2 bytes
   vocab-parallel k: all-gather hidden states and labels, reduce-scatter the hidden gradient, two loss-statistics
                     all-reduces (7 fp32 per group position)          = (k-1)·N·(2·H·2 + 8) + 2·(k-1)/k · k·N·28
   (the slice's gradient is all-reduced once per optimizer step across vocabulary groups when W > k; none here).
2. Measures both on CPU (gloo, 2 ranks, fp32) with a tiny output layer: DeepSpeed ZeRO-3 over a module that is
   just `lm_head` + `ce_ntl_loss`, and `VocabParallelHead`; every torch.distributed collective is wrapped and its
   per-rank ring traffic summed over one forward + backward + optimizer step, next to the formula's figure.

Per-rank traffic of a ring collective over W ranks: all-gather and reduce-scatter (W-1)/W of the full tensor,
all-reduce twice that, broadcast the tensor.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntl_pretrain.runtime.process_group import free_port

MODELS = (  # name, vocabulary, hidden size, tied input embeddings
    ("Llama-3-8B", 128256, 4096, False),
    ("Qwen2.5-0.5B", 151936, 896, True),
    ("SmolLM2-135M", 49152, 576, True),
)
GROUP_SIZES = (2, 4, 8)
BF16, FP32, INT64 = 2, 4, 8
STATS_PER_POSITION = 2 + 5  # one MAX all-reduce of 2 values, one SUM all-reduce of 5 (fused.py)
TINY = {"vocab": "pkg:ntl_pretrain/corpus/tiny-tokenizer", "hidden": 64, "tokens_per_rank": 256}


def zero3_bytes(vocab: int, hidden: int, world: int, element_bytes: int) -> float:
    """Per-rank bytes for the output layer under ZeRO-3: one gather of the matrix, one reduce-scatter of its grad."""
    return 2 * (world - 1) / world * vocab * hidden * element_bytes


def vocab_parallel_bytes(hidden: int, k: int, tokens: int, element_bytes: int) -> float:
    """Per-rank bytes of VocabParallelHead: gathers of hidden and labels, the gradient's reduce-scatter, stats."""
    gathers = (k - 1) * tokens * (hidden * element_bytes + INT64)
    reduce_scatter = (k - 1) * tokens * hidden * element_bytes
    stats = 2 * (k - 1) / k * k * tokens * STATS_PER_POSITION * FP32
    return gathers + reduce_scatter + stats


def print_real_shapes(tokens: int) -> None:
    print(f"Output layer, bytes per rank per micro-batch of {tokens} positions, bf16, data-parallel world W = k")
    header = ("model", "V", "H", "k", "ZeRO-3", "vocab-par.", "ratio", "break-even N")
    print("{:14s} {:>7s} {:>5s} {:>2s} {:>10s} {:>10s} {:>7s} {:>13s}".format(*header))
    for name, vocab, hidden, tied in MODELS:
        for k in GROUP_SIZES:
            plain, parallel = zero3_bytes(vocab, hidden, k, BF16), vocab_parallel_bytes(hidden, k, tokens, BF16)
            break_even = plain / vocab_parallel_bytes(hidden, k, 1, BF16)
            print(
                f"{name + ('*' if tied else ''):14s} {vocab:7d} {hidden:5d} {k:2d} {plain / 2**20:8.1f}Mi "
                f"{parallel / 2**20:8.1f}Mi {parallel / plain:7.1%} {break_even:13.0f}"
            )
    print("* ties input and output embeddings: vocabulary parallelism needs them untied (VocabParallelHead refuses")
    print("  a tied layer), and the input embedding is then still gathered by ZeRO-3 as before (not counted).")
    print("break-even N: positions per rank and micro-batch above which vocabulary parallelism moves more bytes.")


# ---- measurement -----------------------------------------------------------------------------------------------

WRAPPED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "broadcast", "reduce_scatter")


def ring_bytes(name: str, args: tuple, kwargs: dict, world: int) -> float:
    """Per-rank traffic of one collective call under a ring algorithm."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
        v for v in kwargs.values() if isinstance(v, torch.Tensor)
    ]
    lists = [a for a in args if isinstance(a, list)]
    nbytes = lambda t: t.numel() * t.element_size()
    if name == "all_gather_into_tensor":
        return (world - 1) / world * nbytes(tensors[0])
    if name in ("reduce_scatter_tensor", "reduce_scatter"):
        full = nbytes(tensors[1]) if len(tensors) > 1 else sum(nbytes(t) for t in lists[-1])
        return (world - 1) / world * full
    if name == "all_reduce":
        return 2 * (world - 1) / world * nbytes(tensors[0])
    if name == "all_gather":
        return (world - 1) * nbytes(tensors[0])
    return nbytes(tensors[0])  # broadcast


class TrafficMeter:
    """Wraps torch.distributed's collectives (before DeepSpeed binds them) and sums their per-rank traffic."""

    def __init__(self):
        self.on = False
        self.bytes: Counter = Counter()
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            if self.on:
                self.bytes[name] += ring_bytes(name, args, kwargs, dist.get_world_size())
            return original(*args, **kwargs)

        return call


def tiny_inputs(rank: int):
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.tokenizer import load_tokenizer

    nv = NumberVocab.from_tokenizer(load_tokenizer(TINY["vocab"]))
    generator = torch.Generator().manual_seed(rank)
    hidden = torch.randn(TINY["tokens_per_rank"], TINY["hidden"], generator=generator).requires_grad_(True)
    labels = torch.randint(0, nv.vocab_size, (TINY["tokens_per_rank"],), generator=generator)
    weight = 0.02 * torch.randn(nv.vocab_size, TINY["hidden"], generator=torch.Generator().manual_seed(0))
    return nv, hidden, labels, weight


def deepspeed_gathered(parameter: torch.nn.Parameter):
    import deepspeed

    return deepspeed.zero.GatheredParameters([parameter], modifier_rank=None)


def measure_zero3(meter: TrafficMeter, rank: int) -> tuple[Counter, torch.nn.Module]:
    import deepspeed

    from ntl_pretrain.loss import ce_ntl_loss

    nv, hidden, labels, weight = tiny_inputs(rank)

    class OutputLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            self.lm_head.weight.data.copy_(weight)

        def forward(self, hidden_NH, labels_N):
            return ce_ntl_loss(self.lm_head(hidden_NH), labels_N, nv, reduction="sum").loss

        def get_output_embeddings(self):
            return self.lm_head

        def get_input_embeddings(self):
            return None

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    module = OutputLayer()
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.AdamW(module.parameters()), config=config)
    for step in range(2):  # the first step also sets things up; count the second
        meter.on, meter.bytes = step == 1, Counter()
        engine.backward(engine(hidden, labels))
        engine.step()
    meter.on = False
    return meter.bytes, engine.module


def measure_vocab_parallel(meter: TrafficMeter, rank: int, zero3_module: torch.nn.Module) -> Counter:
    """The head takes its slice from the ZeRO-3 partitioned lm_head (after the Adam step, so compare with it)."""
    from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead

    nv, hidden, labels, _ = tiny_inputs(rank)
    head = VocabParallelHead.from_output_layer(zero3_module, dist.group.WORLD, number_vocab=nv, chunk_size=128)
    with deepspeed_gathered(zero3_module.lm_head.weight):
        assert torch.equal(head.full_weight(), zero3_module.lm_head.weight), "slices must reassemble lm_head"
    optimizer = torch.optim.AdamW(head.parameters())
    meter.on, meter.bytes = True, Counter()
    head(hidden, labels).loss.backward()
    head.average_gradients(dist.get_world_size())
    optimizer.step()
    meter.on = False
    return meter.bytes


def _measure_rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    meter = TrafficMeter()
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a 140 s compile nothing here uses
    deepspeed.init_distributed(dist_backend="gloo")
    zero3, zero3_module = measure_zero3(meter, rank)
    parallel = measure_vocab_parallel(meter, rank, zero3_module)
    if rank == 0:
        results.put((dict(zero3), dict(parallel)))
    dist.barrier()


def print_measured(world: int = 2) -> None:
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.tokenizer import load_tokenizer

    vocab = NumberVocab.from_tokenizer(load_tokenizer(TINY["vocab"])).vocab_size
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_measure_rank, args=(world, free_port(), queue), nprocs=world, join=True)
    zero3, parallel = queue.get()
    hidden, tokens = TINY["hidden"], TINY["tokens_per_rank"]
    print(f"\nMeasured on CPU: V={vocab} H={hidden}, {tokens} positions per rank, fp32, W = k = {world}")
    print(f"  ZeRO-3 (lm_head + ce_ntl_loss)   {sum(zero3.values()):10.0f} B  {_by_name(zero3)}")
    print(f"    formula                        {zero3_bytes(vocab, hidden, world, FP32):10.0f} B")
    print(f"  VocabParallelHead                {sum(parallel.values()):10.0f} B  {_by_name(parallel)}")
    print(f"    formula                        {vocab_parallel_bytes(hidden, world, tokens, FP32):10.0f} B")


def _by_name(traffic: dict) -> str:
    return ", ".join(f"{name} {value:.0f}" for name, value in sorted(traffic.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--skip-measure", action="store_true", help="print the real-shape table only")
    args = parser.parse_args()
    print_real_shapes(args.tokens_per_rank)
    if not args.skip_measure:
        print_measured()


if __name__ == "__main__":
    main()
