"""Check 2: collectives on the training process group: an all-reduce of a device tensor and of a CPU tensor with
the result checked (NCCL moves only CUDA tensors, gloo the CPU ones: `runtime/process_group.py`), and all-reduce
bandwidth.

Bandwidth follows nccl-tests: algorithm bandwidth = bytes / time, bus bandwidth = algbw * 2(n-1)/n, which is what
a link delivers independent of the rank count. It fails below `BUSBW_FLOOR` of what the link should deliver: on
one node of NVLink GPUs the figure from `NODE_BUSBW_GBPS`, across nodes what `--expected-busbw` says (the network
differs between clusters); without either it is only measured. Across nodes, NCCL falling back to TCP sockets
(no InfiniBand/RoCE plugin found: a missing driver, a container without the devices) fails the `network` row; NCCL
names the transport it picked in its INFO log, which the doctor asks for (`request_nccl_log`)."""

from __future__ import annotations

import glob
import os
import re
import tempfile
import time

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.report import Check

# (fragment of torch.cuda.get_device_name, expected all-reduce bus bandwidth in GB/s among the GPUs of one node);
# the first match wins, None: no NVLink to expect. nccl-tests' published all-reduce busbw: DGX H100 ~370 GB/s
# (~480 with NVLink SHARP), DGX A100 ~230 GB/s.
NODE_BUSBW_GBPS = (("PCIe", None), ("H100 NVL", None), ("H100", 360.0), ("H200", 360.0), ("GH200", 360.0),
                   ("A100", 230.0))  # fmt: skip
BUSBW_FLOOR = 0.5
NCCL_LOG = "nccl.%h.%p.log"
NETWORK = re.compile(r"Using network (\w+)")


def request_nccl_log() -> None:
    """Before the process group exists, on GPUs: NCCL's INFO lines about its transport into a file of this process's
    own, unless the user already chose how NCCL logs."""
    if torch.cuda.is_available() and "NCCL_DEBUG" not in os.environ:
        folder = tempfile.mkdtemp(prefix="ntl-doctor-nccl-")
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=f"{folder}/{NCCL_LOG}")


def nccl_network() -> str | None:
    """The inter-node transport NCCL picked (`IB`, `Socket`, a plugin's name), from this process's NCCL log."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "").replace("%h", "*").replace("%p", str(os.getpid()))
    for path in glob.glob(pattern) if pattern else []:
        with open(path, errors="replace") as log:
            found = NETWORK.search(log.read())
        if found:
            return found[1]
    return None


def expected_busbw(device: torch.device, nodes: int, given: float | None) -> float | None:
    if given is not None or device.type != "cuda" or nodes > 1:
        return given
    name = torch.cuda.get_device_name(device)
    return next((expected for fragment, expected in NODE_BUSBW_GBPS if fragment in name), None)


def network_check(device: torch.device, nodes: int) -> Check:
    if device.type != "cuda":
        return Check("network", None, "GPU only (NCCL)")
    if nodes == 1:
        return Check("network", None, "one node: NCCL uses NVLink/PCIe, no network")
    network = nccl_network()
    if network is None:
        return Check("network", None, "NCCL did not name its transport (NCCL_DEBUG set by the user?)")
    ok = network != "Socket"
    figure = f"NCCL between nodes: {network}" + ("" if ok else " (TCP sockets: no InfiniBand/RoCE found; slow)")
    return Check("network", ok, figure, {"network": network})


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


def collectives_check(
    device: torch.device, quick: bool, nodes: int = 1, expected_busbw_GBps: float | None = None
) -> list[Check]:
    places = [device, torch.device("cpu")] if device.type == "cuda" else [device]
    results = [all_reduce_is_correct(place) for place in places]
    checks = [
        Check(f"all-reduce {place.type}", ok, figure) for place, (ok, figure) in zip(places, results, strict=True)
    ]
    if dist.get_world_size() == 1:
        return [*checks, Check("all-reduce bandwidth", None, "1 rank: nothing to measure"), network_check(device, 1)]
    measured = bandwidth(device, 32 if quick else 256)
    return [*checks, bandwidth_verdict(measured, expected_busbw(device, nodes, expected_busbw_GBps)),
            network_check(device, nodes)]  # fmt: skip


def bandwidth_verdict(measured: dict[str, float], expected: float | None) -> Check:
    figure = (
        f"{measured['megabytes']} MiB: busbw {measured['busbw_GBps']:.2f} GB/s ({measured['seconds'] * 1e3:.1f} ms)"
    )
    if expected is None:
        return Check("all-reduce bandwidth", True, figure + "; no expected link bandwidth known", measured)
    ok = measured["busbw_GBps"] >= BUSBW_FLOOR * expected
    figure += f"; {'at least' if ok else 'below'} {BUSBW_FLOOR:.0%} of the expected {expected:g} GB/s"
    return Check("all-reduce bandwidth", ok, figure, {**measured, "expected_busbw_GBps": expected})
