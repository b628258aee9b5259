"""Which torch.distributed backend a job's default process group uses.

NCCL moves CUDA tensors only: a CPU tensor in a collective fails with "No backend type associated with device
type cpu". Our own collectives are small CPU tensors by design (per-step metric sums and token counts, the data
loaders' states, lockstep flags, evaluation sums), so a GPU job gets gloo for CPU tensors beside NCCL for CUDA
ones; torch routes each collective by its tensor's device. CPU jobs use gloo.
"""

from __future__ import annotations

import os

import torch

GPU_BACKENDS = "cpu:gloo,cuda:nccl"


def default_backend() -> str:
    return GPU_BACKENDS if torch.cuda.is_available() else "gloo"


def bind_local_device() -> None:
    """On GPUs, make this process's device the current one (LOCAL_RANK), as object collectives
    (`all_gather_object`, `broadcast_object_list`) on NCCL stage their bytes on the current device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
