"""What an architecture's forward does to the output layer's logits before the loss, and its gradient.

Some Hugging Face causal LMs post-process `lm_head(hidden)` inside `*ForCausalLM.forward` (the loss heads call the
trunk and project the hidden states themselves, so they must do the same):

    y = scale · z                          (Cohere: scale = logit_scale; Granite: scale = 1 / logits_scaling)
    y = cap · tanh(scale · z / cap)        (Gemma-2, Gemma-3: cap = final_logit_softcapping)

The transform is element-wise, so it applies to a chunk of rows or a vocabulary shard alike. The chunked kernels
form d loss / d y in forward and turn it into d loss / d z with `chain_`:
    d y / d z = scale · (1 - tanh²) = scale · (1 - (y / cap)²).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    scale: float = 1.0
    """Multiplies the raw logits (applied first)."""
    softcap: float | None = None
    """cap: the logits become cap · tanh(logits / cap), bounded by ±cap; None for none."""

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"logit scale must be > 0, got {self.scale}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit soft-capping must be > 0 or None, got {self.softcap}")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """Differentiable, in z's dtype, with the operations transformers runs (`/ cap`, `tanh`, `* cap`)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """In place on a chunk of raw logits (no autograd); returns it."""
        if self.scale != 1.0:
            z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def chain_(self, grad_y: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """d loss / d z from d loss / d y (`grad_y`, overwritten) and the transformed logits `y` (overwritten
        when soft-capping); returns `grad_y`."""
        if self.softcap is not None:
            grad_y.mul_(y.div_(self.softcap).square_().neg_().add_(1))
        if self.scale != 1.0:
            grad_y.mul_(self.scale)
        return grad_y


IDENTITY = LogitTransform()
