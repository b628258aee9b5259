"""AdamW, run the way each placement runs it fastest; the update rule is the same in every case.

- ZeRO offloads the optimizer to the CPU (`offload_optimizer` in the DeepSpeed config,
  `pkg:ntl_pretrain/config/zero3_offload.json`): DeepSpeed's CPU Adam, a vectorised C++ kernel that DeepSpeed
  compiles on first use (a minute or two, then cached) and reports several times faster than torch's AdamW on the
  host (not measured here: it pays off at billions of offloaded parameters, not on the tiny models these machines
  train).
- CUDA: torch's fused AdamW, one kernel per parameter group instead of several per tensor.
- Otherwise (CPU ranks): torch's AdamW with its default implementation.
"""

from __future__ import annotations

import torch

from ntl_pretrain.config.recipe import OptimizerConfig


def offloads_optimizer(ds_config: dict) -> bool:
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme")


def optimizer_kind(ds_config: dict, device_type: str) -> str:
    if offloads_optimizer(ds_config):
        return "deepspeed-cpu-adam"
    return on_device_kind(device_type)


def on_device_kind(device_type: str) -> str:
    """The AdamW for parameters that stay on `device_type` (also those ZeRO does not hold)."""
    return "fused" if device_type == "cuda" else "default"


def build_optimizer(groups: list[dict], cfg: OptimizerConfig, kind: str) -> torch.optim.Optimizer:
    """AdamW of `kind` (`optimizer_kind`) over `groups` (each carries its weight decay) with the recipe's lr, betas
    and eps."""
    settings = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if kind == "deepspeed-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **settings)
    if kind == "fused":
        return torch.optim.AdamW(groups, fused=True, **settings)
    return torch.optim.AdamW(groups, **settings)
