"""Which torch.distributed backend a job's default process group uses, and the group that waits for slow work.

NCCL moves CUDA tensors only: a CPU tensor in a collective fails with "No backend type associated with device
type cpu". Our own collectives are small CPU tensors by design (per-step metric sums and token counts, the data
loaders' states, lockstep flags, evaluation sums), so a GPU job gets gloo for CPU tensors beside NCCL for CUDA
ones; torch routes each collective by its tensor's device. CPU jobs use gloo.

`train.dist_timeout_seconds` bounds every collective of the default group, so that a lost peer stops the run in
minutes. A few waits are for work that legitimately takes longer on some ranks than on others: rank 0 converting a
checkpoint to a universal one (hundreds of GB of I/O), verifying a checkpoint's files before the ranks compare
findings, a hub stream's first batch. Those wait in `slow_work_group()`, gloo with `SLOW_WORK_TIMEOUT`; a peer that
dies there still ends the wait at once (the launcher stops the job; gloo reports the closed connection).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

GPU_BACKENDS = "cpu:gloo,cuda:nccl"


SLOW_WORK_TIMEOUT = datetime.timedelta(hours=2)
_slow_work_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def default_backend() -> str:
    return GPU_BACKENDS if torch.cuda.is_available() else "gloo"


def slow_work_group() -> dist.ProcessGroup:
    """All ranks, gloo, `SLOW_WORK_TIMEOUT`; made by every rank's first call (a collective: the same call site)."""
    world = dist.group.WORLD
    if world not in _slow_work_groups:
        _slow_work_groups[world] = dist.new_group(backend="gloo", timeout=SLOW_WORK_TIMEOUT)
    return _slow_work_groups[world]


def bind_local_device() -> None:
    """On GPUs, make this process's device the current one (LOCAL_RANK), as object collectives
    (`all_gather_object`, `broadcast_object_list`) on NCCL stage their bytes on the current device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def exit_without_finalising(code: int) -> None:
    """End the rank once everything it owns is on disk, skipping interpreter finalisation: there, gloo's worker
    threads can still be torn down after their process group is destroyed and abort a run that succeeded
    ("terminate called without an active exception", SIGABRT: 2 of 86 two-rank CPU runs of the tiny recipe here, on
    torch 2.13, pytorch/pytorch#190489 and #179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_DRAWN_PORT = 20000


def free_port() -> int:
    """A TCP port free on this host now (for a launch's MASTER_PORT), drawn at random below the kernel's ephemeral
    range. A port the kernel picked (bind to port 0) is free only until rank 0 binds it, and meanwhile the kernel
    may hand the same number to any socket it numbers itself: gloo's pair connections, another launch's store
    client. The store's client then meets a stranger ("Connection reset by peer"). Ports below the range are never
    handed out that way; the kernel's pick remains where the range is unknown (not Linux) or leaves no room."""
    below_ephemeral = range(LOWEST_DRAWN_PORT, max(ephemeral_low(), LOWEST_DRAWN_PORT))
    # SystemRandom: a run or test that seeded `random` must not make concurrent launches draw the same ports.
    for port in random.SystemRandom().sample(below_ephemeral, min(64, len(below_ephemeral))):
        if bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ephemeral_low() -> int:
    """The lowest port the kernel assigns to sockets on its own (0 where this host does not say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def bindable(port: int) -> bool:
    """Whether `port` can be bound on every interface, as rank 0's store binds it (preflight's check_master_port
    binds the same way)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_failure(error: Exception, timeout_s: int) -> str:
    """One line for a process group that did not form within `train.dist_timeout_seconds`."""
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    rank, world_size = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    return (
        f"rank {rank} of {world_size} on {socket.gethostname()}: the process group did not form within "
        f"train.dist_timeout_seconds={timeout_s} at master {address} ({error}); a node that never joined, a wrong "
        "MASTER_ADDR/--master_addr or port, or a firewall between the nodes"
    )
