"""Check 2: collectives on the training process group: an all-reduce of a device tensor and of a CPU tensor with
the result checked (NCCL moves only CUDA tensors, gloo the CPU ones: `process_group.py`), and all-reduce bandwidth.

Bandwidth follows nccl-tests: algorithm bandwidth = bytes / time, bus bandwidth = algbw * 2(n-1)/n, which is what
a link delivers independent of the rank count."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.report import Check


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_is_correct(device: torch.device) -> tuple[bool, str]:
    """Every rank contributes rank + 1 in 1,000,003 elements (an odd count: no chunk boundary is special)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((1_000_003,), float(rank + 1), device=device)
    dist.all_reduce(tensor)
    expected = world * (world + 1) / 2
    wrong = (tensor != expected).sum().item()
    return wrong == 0, f"sum {expected:g} on {device.type}" + (f": {wrong} elements wrong" if wrong else "")


def bandwidth(device: torch.device, megabytes: int, repeats: int = 3) -> dict[str, float]:
    tensor = torch.ones(megabytes * 2**20 // 4, device=device)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    world = dist.get_world_size()
    algbw = tensor.numel() * 4 / best / 1e9
    return {"megabytes": megabytes, "seconds": best, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world}


def collectives_check(device: torch.device, quick: bool) -> list[Check]:
    places = [device, torch.device("cpu")] if device.type == "cuda" else [device]
    results = [all_reduce_is_correct(place) for place in places]
    checks = [
        Check(f"all-reduce {place.type}", ok, figure) for place, (ok, figure) in zip(places, results, strict=True)
    ]
    if dist.get_world_size() == 1:
        return [*checks, Check("all-reduce bandwidth", None, "1 rank: nothing to measure")]
    measured = bandwidth(device, 32 if quick else 256)
    figure = (
        f"{measured['megabytes']} MiB: busbw {measured['busbw_GBps']:.2f} GB/s ({measured['seconds'] * 1e3:.1f} ms)"
    )
    return [*checks, Check("all-reduce bandwidth", True, figure, measured)]
