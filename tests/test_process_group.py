"""The default process group's backend: gloo must serve CPU tensors on GPU jobs too (NCCL alone rejects them)."""

from __future__ import annotations

import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from ntl_pretrain.runtime.process_group import GPU_BACKENDS, default_backend


def test_cpu_jobs_use_gloo(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"


def test_gpu_jobs_route_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == GPU_BACKENDS
    # torch's own parser of the backend string: which backend each tensor device's collectives go to
    assert BackendConfig(Backend(GPU_BACKENDS)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
