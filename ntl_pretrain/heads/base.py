"""The interface every output head implements: the output layer plus CE + λ·NTL, from hidden states to a
`HeadOutput`, and the hooks the trainer calls at fixed points of a step (no-ops for a head whose parameters the
DeepSpeed engine owns).

Shapes: B batch, T sequence, H hidden size.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn


class HeadOutput(NamedTuple):
    """One micro-batch. A NamedTuple because ZeRO-3 hooks autograd only into tuples, lists and dicts of tensors
    that a module returns (a dataclass output breaks its backward bookkeeping).

    loss: differentiable; this rank's share `ΣCE/num_tokens + λ·ΣNTL/num_number_tokens` of the global-batch loss
    when the head was given the global counts, else `ΣCE + λ·ΣNTL`. ce, ntl: sums over this rank's positions (for
    logging); num_tokens, num_number_tokens: this rank's counts; number_ce: summed CE at the number labels (for
    validation). aux_loss: the routers' load-balancing loss of the micro-batch (a MoE whose forward adds one, for
    logging; `CausalLMWithLoss` adds it to `loss`, heads leave it None)."""

    loss: torch.Tensor
    ce: torch.Tensor
    ntl: torch.Tensor
    num_tokens: torch.Tensor
    num_number_tokens: torch.Tensor
    number_ce: torch.Tensor
    aux_loss: torch.Tensor | None = None


class OutputHead(nn.Module):
    """Output layer + loss. `forward(hidden_BTH, labels_BT, num_tokens, num_number_tokens, ntl_labels_BT=None) ->
    HeadOutput`: the global batch's counts normalise `loss`, or None for sums; `ntl_labels_BT` where NTL applies
    when that is not where CE does (`ce_ntl_loss`).

    The trainer calls, in this order, whatever the head:
      `attach(engine)` once the engine exists;
      per step: forward/backward of every micro-batch, `before_engine_step()` after the last backward, the
      engine's step, `after_engine_step(engine)`;
      `save(step_folder)` while a checkpoint is written, `load(step_folder)` on resume.
    A head whose parameters live in the engine needs none of them; one that keeps parameters outside ZeRO-3
    reduces, clips, steps and checkpoints them there.

    Offline, without a head (classmethods, asked of every head kind through `heads.check_resume` and
    `heads.saved_output_matrix`): `check_resume` refuses a checkpoint whose head state this kind cannot continue,
    `saved_output_matrix` reassembles an output matrix its `save` wrote for export. `parameters_outside_model`
    adds to the model's FLOPs the output parameters the LM does not hold."""

    def attach(self, engine) -> None:
        """Join the engine's gradient-norm computation (clipping and the logged norm)."""

    def before_engine_step(self) -> None:
        """Reduce this head's own gradients across ranks (the engine's norm then covers them)."""

    def after_engine_step(self, engine) -> None:
        """Clip and update this head's own parameters when the engine applied its step."""

    def save(self, step_folder: Path) -> None:
        """Write this rank's own head state into a checkpoint step folder (not yet published)."""

    def load(self, step_folder: Path) -> None:
        """Restore what `save` wrote."""

    @classmethod
    def check_resume(cls, step_folder: Path | None, recipe, world_size: int) -> None:
        """Raise `ValueError` (naming the key) when `step_folder` holds head state this kind cannot continue under
        `recipe` on `world_size` ranks; called before the engine starts."""

    @classmethod
    def saved_output_matrix(cls, step_folder: Path) -> torch.Tensor | None:
        """The [V, H] output matrix when this kind saved it outside the engine's shards, else None."""
        return None

    def parameters_outside_model(self) -> int:
        """Output parameters used for every token that are not parameters of the LM (its FLOPs count them)."""
        return 0
