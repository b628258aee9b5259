"""Check 1: what this process runs on: library versions, devices and their memory, bf16, the process group's
backends, and what `model.attention: auto` resolves to here."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch
import torch.distributed as dist

from ntl_pretrain.doctor.report import Check

PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "flash_attn", "ntloss")


def package_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["cuda"] = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                for i in range(torch.cuda.device_count())]  # fmt: skip
    import psutil

    return [f"CPU: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"]


def bf16_works(device: torch.device) -> bool:
    """A bf16 matmul on the device gives the fp32 result to bf16 precision (CUDA: also the driver's own answer)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return False
    a = torch.randn(64, 64, device=device)
    exact = a @ a.T
    return torch.allclose((a.bfloat16() @ a.T.bfloat16()).float(), exact, rtol=0.05, atol=0.5)


def auto_attention(device: torch.device) -> str:
    from transformers import LlamaConfig

    from ntl_pretrain.model.build import attention_backend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return attention_backend("auto", LlamaConfig(), dtype)


def environment_check(device: torch.device) -> list[Check]:
    versions = package_versions()
    backend = str(dist.get_backend())
    bf16 = bf16_works(device)
    attention = auto_attention(device)
    found = devices()
    missing = [name for name in ("torch", "deepspeed", "transformers") if versions[name] == "not installed"]
    figure = (f"torch {versions['torch']}, deepspeed {versions['deepspeed']}, transformers {versions['transformers']}"
              f", cuda {versions['cuda']}; {found[0]} x{len(found)}; backend {backend}; bf16 "
              f"{'ok' if bf16 else 'NO'}; attention auto = {attention}")  # fmt: skip
    if missing:
        figure = f"missing {', '.join(missing)}; " + figure
    detail = {"versions": versions, "devices": found, "backend": backend, "bf16": bf16, "attention_auto": attention}
    # bf16 is what GPU recipes train in: a GPU without it cannot run them.
    ok = not missing and (bf16 or device.type == "cpu")
    return [Check("environment", ok, figure, detail)]
