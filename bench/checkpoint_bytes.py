"""Bytes a checkpoint save moves between ranks and writes, for the state the engine does not hold (every rank's
data-loader state with its shuffle buffer, and its RNG states), against the number of ranks.

    python bench/checkpoint_bytes.py [--ranks 1 2 4 8] [--shuffle-buffer 1000] [--steps 40]

W gloo ranks on this machine each read the tiny recipe's corpus for `--steps` micro-batches (enough to fill the
shuffle buffer), then save their state two ways:
- before (all-gather): `all_gather_object` of every rank's state to every rank, and every rank's model-states
  file holds the whole list (DeepSpeed saves the client state on every rank);
- now (per-rank files): each rank writes `rank_state/rank_<r>.pt`; what crosses the network is rank 0's gather of
  the manifest entries (a few hundred bytes per file).
Every torch.distributed all_gather / gather is wrapped and the bytes each rank receives from the others summed;
bytes written are the sizes of the files. With s the size of one rank's state (the largest, as all_gather_object
pads to it) and e one rank's manifest entries:
    before: moved W·(W-1)·s   written W·W·s
    now:    moved (W-1)·e     written W·s
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.runtime.process_group import free_port

REPO = Path(__file__).resolve().parents[1]


class ReceivedBytes:
    """Wraps the tensor collectives that the object collectives use; counts what this rank receives."""

    def __init__(self):
        self.total = 0
        self.originals = {name: getattr(c10d, name) for name in ("all_gather", "gather")}

    def __enter__(self):
        def all_gather(outputs, tensor, *args, **kwargs):
            self.total += sum(map(nbytes, outputs)) - nbytes(tensor)
            return self.originals["all_gather"](outputs, tensor, *args, **kwargs)

        def gather(tensor, gather_list=None, *args, **kwargs):
            if gather_list:  # the destination rank
                self.total += sum(map(nbytes, gather_list)) - nbytes(tensor)
            return self.originals["gather"](tensor, gather_list, *args, **kwargs)

        c10d.all_gather, c10d.gather = all_gather, gather
        return self

    def __exit__(self, *exc):
        c10d.all_gather, c10d.gather = self.originals["all_gather"], self.originals["gather"]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def rank_state(world_size: int, shuffle_buffer: int, steps: int) -> dict:
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.data import build_dataloader
    from ntl_pretrain.tokenizer import load_tokenizer

    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml", [f"data.shuffle_buffer={shuffle_buffer}"])
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    loader = build_dataloader(recipe.data, tokenizer, micro_batch_size=2, dp_rank=dist.get_rank(),
                              dp_world_size=world_size, seed=0, grad_accum=1)  # fmt: skip
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    return {"data": loader.state_dict(), "rng": checkpoint.rng_state()}


def measure(rank: int, world_size: int, port: int, shuffle_buffer: int, steps: int, folder: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    state = rank_state(world_size, shuffle_buffer, steps)
    with ReceivedBytes() as before:
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, state)
    buffer = io.BytesIO()
    torch.save(per_rank, buffer)
    step = Path(folder)
    checkpoint.write_rank_state(step, state)
    entries = manifest.describe(step, manifest.files_written_by(step, rank))
    gathered = [None] * world_size if rank == 0 else None
    with ReceivedBytes() as now:
        dist.gather_object((None, entries), gathered, dst=0)
    written_now = (step / checkpoint.RANK_STATE / f"rank_{rank:05d}.pt").stat().st_size
    totals = torch.tensor([before.total, buffer.getbuffer().nbytes, now.total, written_now], dtype=torch.float64)
    dist.all_reduce(totals)
    if rank == 0:
        results.put(totals.tolist())
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40, help="micro-batches each rank reads before the save")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.get_context("spawn")
    print(f"tiny recipe, micro-batch 2, {args.steps} micro-batches read, shuffle_buffer {args.shuffle_buffer}")
    print("| ranks | before: moved (B) | before: written (B) | now: moved (B) | now: written (B) |")
    print("|---:|---:|---:|---:|---:|")
    for world_size in args.ranks:
        results = context.Queue()
        with tempfile.TemporaryDirectory() as folder:
            settings = (world_size, free_port(), args.shuffle_buffer, args.steps, folder, results)
            mp.start_processes(measure, args=settings, nprocs=world_size, start_method="spawn")
        moved_before, written_before, moved_now, written_now = results.get()
        cells = [f"{value:,.0f}" for value in (moved_before, written_before, moved_now, written_now)]
        print(f"| {world_size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
