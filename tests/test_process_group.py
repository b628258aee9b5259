"""The default process group's backend: gloo must serve CPU tensors on GPU jobs too (NCCL alone rejects them); the
launch's MASTER_PORT: one no other socket can be handed meanwhile."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from torch.distributed.distributed_c10d import Backend, BackendConfig

from ntl_pretrain.runtime import process_group
from ntl_pretrain.runtime.process_group import GPU_BACKENDS, default_backend, free_port


def test_cpu_jobs_use_gloo(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"


def test_gpu_jobs_route_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == GPU_BACKENDS
    # torch's own parser of the backend string: which backend each tensor device's collectives go to
    assert BackendConfig(Backend(GPU_BACKENDS)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def ranged(tmp_path: Path, low: int, high: int) -> Path:
    """A stand-in for /proc/sys/net/ipv4/ip_local_port_range."""
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{low}\t{high}\n")
    return path


@pytest.mark.skipif(not process_group.EPHEMERAL_RANGE.is_file(), reason="the kernel's ephemeral range is Linux's")
def test_a_master_port_is_drawn_below_the_kernels_ephemeral_range_and_can_be_bound() -> None:
    ports = {free_port() for _ in range(20)}
    assert all(process_group.LOWEST_DRAWN_PORT <= port < process_group.ephemeral_low() for port in ports)
    assert len(ports) > 1  # drawn, not a fixed port that two concurrent launches would share
    assert process_group.bindable(ports.pop())


def hold_three_ports_and_a_free_fourth(stack: ExitStack) -> int:
    """Bind three consecutive ports below the ephemeral range (held open by `stack`) whose next one is free; return
    the first."""
    for first in range(25000, 32000, 8):
        try:
            for port in range(first, first + 3):
                stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            stack.close()
            continue
        if process_group.bindable(first + 3):
            return first
        stack.close()
    pytest.skip("no four free consecutive ports")


def test_a_port_in_use_is_never_drawn(tmp_path, monkeypatch) -> None:
    with ExitStack() as held:
        first = hold_three_ports_and_a_free_fourth(held)
        monkeypatch.setattr(process_group, "LOWEST_DRAWN_PORT", first)  # the drawable ports: the four
        monkeypatch.setattr(process_group, "EPHEMERAL_RANGE", ranged(tmp_path, first + 4, 60999))
        assert {free_port() for _ in range(8)} == {first + 3}


def test_without_room_below_the_range_the_kernel_picks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(process_group, "EPHEMERAL_RANGE", ranged(tmp_path, 1024, 60999))
    assert 1024 <= free_port() <= 65535
    monkeypatch.setattr(process_group, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert 1024 <= free_port() <= 65535
