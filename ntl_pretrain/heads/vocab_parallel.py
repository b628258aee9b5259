"""The vocabulary-parallel output head (`loss.vocab_parallel_size: k` > 1).

Groups of k consecutive data-parallel ranks share the [V, H] output matrix by rows (`VocabParallelHead`,
docs/vocab-parallel.md); the decoder trunk stays in the DeepSpeed ZeRO-3 engine. `VocabParallelOutputHead` is the
`OutputHead` the trainer drives; the slice lives outside ZeRO-3, so its hooks do for it what the engine does for
the trunk:

- the process groups (vocabulary groups, and replica groups joining the ranks that hold the same slice);
- the slice's own AdamW (fused on CUDA, as the trunk's) and learning-rate schedule, with the recipe's
  hyper-parameters (decayed, as a dense output matrix is);
- gradient clipping by the combined norm of trunk and output layer, so that the run equals a dense one: the
  slices' norm joins DeepSpeed's norm groups, DeepSpeed clips the trunk with the combined norm (and reports it as
  the global grad norm), and the same coefficient is applied to the slice;
- per-rank checkpoint files inside the step folder, the check that a resume has the same k and world size,
  reassembling the matrix from a checkpoint for export, and the matrix's share of the model's FLOPs (it is no
  parameter of the LM): the `OutputHead` interface's offline half, which the resume guard, export and the
  trainer's MFU ask.

Shapes: V vocabulary, Vr rows of this rank's slice, H hidden size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads.base import HeadOutput, OutputHead
from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead, assemble_output_matrix
from ntl_pretrain.loss.logit_transform import LogitTransform
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.optim.optimizer import build_optimizer, on_device_kind
from ntl_pretrain.optim.schedule import lr_multiplier

FOLDER = "vocab_parallel"  # inside a checkpoint step folder
LAYOUT = "layout.json"
CLIP_EPS = 1e-6  # DeepSpeed's: coefficient = clip / (norm + 1e-6)
ONE_CHUNK = 1 << 62  # `loss.head: dense`: the slice's logits of all the group's positions in one chunk


@dataclass
class VocabGroups:
    vocab: dist.ProcessGroup
    """The k consecutive ranks that share the output matrix, this rank among them."""
    replica: dist.ProcessGroup | None
    """The ranks holding the same slice as this one (one per vocabulary group); None when there is one group."""


def new_groups(k: int) -> VocabGroups:
    """Every rank creates every group (torch.distributed requires it) and keeps the ones it belongs to."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    vocab = replica = None
    for start in range(0, world_size, k):
        group = dist.new_group(list(range(start, start + k)))
        if start <= rank < start + k:
            vocab = group
    if world_size > k:
        for offset in range(k):
            group = dist.new_group(list(range(offset, world_size, k)))
            if rank % k == offset:
                replica = group
    return VocabGroups(vocab, replica)


class VocabParallelOutputHead(OutputHead):
    """This rank's slice with its optimizer, schedule, clipping and checkpoint files, stepped in lockstep with the
    engine. The slice is referenced, not registered: ZeRO-3 would turn every parameter of the module it wraps into
    one partitioned tensor replicated across ranks, while each rank's slice is different."""

    def __init__(self, head: VocabParallelHead, groups: VocabGroups, recipe: Recipe, world_size: int):
        super().__init__()
        _hold_outside_zero(self, "head", head)
        self.groups, self.world_size = groups, world_size
        self.vocab_parallel_size = recipe.loss.vocab_parallel_size
        settings = recipe.optimizer
        self.grad_clip = settings.grad_clip
        # The slice stays on the device even when ZeRO offloads the trunk's optimizer, so it never takes CPU Adam.
        self.optimizer = build_optimizer(
            [{"params": list(head.parameters()), "weight_decay": settings.weight_decay}],
            settings,
            on_device_kind(head.weight.device.type),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier(recipe.schedule, recipe.train.max_steps)
        )

    @classmethod
    def from_model(
        cls, lm: PreTrainedModel, number_vocab: NumberVocab | None, recipe: Recipe, transform: LogitTransform
    ) -> VocabParallelOutputHead:
        """Create the groups (collective), take this rank's rows of `lm`'s output layer (refused, with the reason,
        when it is tied to the input embedding or has a bias) in fp32, its own optimizer's master copy, and leave
        `lm` a parameterless stand-in for generation."""
        if getattr(lm.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("loss.vocab_parallel_size: the output layer has a bias, which the slices do not hold")
        loss = recipe.loss
        groups = new_groups(loss.vocab_parallel_size)
        ntl, chunk_size = loss.ntl, loss.chunk_size if loss.head == "chunked" else ONE_CHUNK
        head = VocabParallelHead.from_output_layer(
            lm, groups.vocab, number_vocab=number_vocab, kind=ntl.kind, ntl_weight=ntl.weight, reweigh=ntl.reweigh,
            chunk_size=chunk_size, transform=transform, float_level=ntl.float_level, backend=loss.backend,
        ).float()  # fmt: skip
        lm.set_output_embeddings(VocabParallelOutputLayer(head))
        return cls(head, groups, recipe, dist.get_world_size())

    def forward(self, hidden_BTH, labels_BT, num_tokens=None, num_number_tokens=None, ntl_labels_BT=None) -> HeadOutput:
        out = self.head(hidden_BTH, labels_BT, num_tokens, num_number_tokens, ntl_labels_BT)
        return HeadOutput(out.loss, out.ce, out.ntl, out.num_tokens, out.num_number_tokens, out.number_ce)

    def attach(self, engine) -> None:
        """Make the engine's gradient norm (its clipping and `get_global_grad_norm`) cover the slices too, by
        adding their norm to the per-group norms DeepSpeed's ZeRO-3 optimizer combines (DeepSpeed 0.19)."""
        zero = engine.optimizer
        if not hasattr(zero, "_get_norm_groups"):
            raise RuntimeError(
                f"loss.vocab_parallel_size: cannot include the output-layer slices in {type(zero).__name__}'s "
                "gradient norm (written for DeepSpeed 0.19's ZeRO-3 optimizer)"
            )
        trunk_norm_groups = zero._get_norm_groups

        def with_slices() -> list[torch.Tensor]:
            norms = trunk_norm_groups()
            # DeepSpeed's norms are of loss-scaled gradients (scale 1 in fp32 and bf16).
            return [*norms, (self.grad_norm() * zero.loss_scale).to(norms[0].device)]

        zero._get_norm_groups = with_slices

    def grad_norm(self) -> torch.Tensor:
        """Norm of the whole output layer's gradient: the slices of one vocabulary group (collective there)."""
        grad_VrH = self.head.weight.grad
        squared = torch.zeros((), dtype=torch.float32, device=self.head.weight.device)
        if grad_VrH is not None:
            squared = grad_VrH.float().pow(2).sum()
        dist.all_reduce(squared, group=self.groups.vocab)
        return squared.sqrt()

    def before_engine_step(self) -> None:
        """After the last micro-batch's backward and before the engine's step (whose norm includes the slices)."""
        self.head.average_gradients(self.world_size, self.groups.replica)

    def after_engine_step(self, engine) -> None:
        """After the engine's step: update the slice when the engine updated the trunk, clipped alike."""
        if engine.was_step_applied():
            self._clip(float(engine.get_global_grad_norm()))
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _clip(self, total_norm: float) -> None:
        if self.grad_clip > 0 and self.head.weight.grad is not None:
            self.head.weight.grad.div_(max((total_norm + CLIP_EPS) / self.grad_clip, 1.0))

    # ---- offline: what the guard, export and MFU ask of this head kind ------------------------------------

    @classmethod
    def check_resume(cls, step_folder: Path | None, recipe: Recipe, world_size: int) -> None:
        """Refuse, before the engine starts, a checkpoint saved with another k (slices into a dense head, or a
        dense output layer into slices), or with k > 1 on another world size (the slices and their optimizer
        states would have to be re-cut; the trunk alone could be)."""
        if step_folder is None:
            return
        vocab_parallel_size = recipe.loss.vocab_parallel_size
        layout = saved_layout(step_folder)
        saved_k = 1 if layout is None else layout["vocab_parallel_size"]
        if saved_k != vocab_parallel_size:
            raise ValueError(
                f"train.resume: {step_folder} was trained with loss.vocab_parallel_size={saved_k}; resume it with "
                f"the same value (got {vocab_parallel_size}), or export it and start a new run with init_from"
            )
        if layout is not None and layout["world_size"] != world_size:
            raise ValueError(
                f"train.resume: {step_folder} was saved by {layout['world_size']} ranks with "
                f"loss.vocab_parallel_size={saved_k}; resuming output-layer slices on {world_size} ranks is not "
                "supported: resume on the same number of ranks, or export it and start a new run with init_from"
            )

    @classmethod
    def saved_output_matrix(cls, step_folder: Path) -> torch.Tensor | None:
        """The [V, H] output matrix reassembled from the slices of the first vocabulary group (ranks 0..k-1; the
        other groups hold copies); None for a checkpoint without slices."""
        layout = saved_layout(step_folder)
        if layout is None:
            return None
        slices = {}
        for rank in range(layout["vocab_parallel_size"]):
            state = torch.load(_rank_file(step_folder, rank), map_location="cpu", weights_only=True)
            slices[state["vocab_start"]] = state["weight"]
        return assemble_output_matrix(slices, layout["vocab_size"])

    def parameters_outside_model(self) -> int:
        """The whole [V, H] matrix: the group computes all of it for every token, and the LM holds none of it."""
        return self.head.vocab_size * self.head.weight.shape[1]

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save(self, step_folder: Path) -> None:
        """Every rank writes its slice and optimizer state into the (not yet published) step folder."""
        folder = step_folder / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        state = {
            "vocab_start": self.head.vocab_start,
            "weight": self.head.weight.detach(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        torch.save(state, _rank_file(step_folder, rank))
        if rank == 0:
            layout = {
                "vocab_parallel_size": self.vocab_parallel_size,
                "world_size": self.world_size,
                "vocab_size": self.head.vocab_size,
            }
            (folder / LAYOUT).write_text(json.dumps(layout))

    def load(self, step_folder: Path) -> None:
        state = torch.load(
            _rank_file(step_folder, dist.get_rank()), map_location=self.head.weight.device, weights_only=True
        )
        if state["vocab_start"] != self.head.vocab_start:
            raise ValueError(
                f"train.resume: {step_folder} holds rows from {state['vocab_start']} for this rank, which now holds "
                f"rows from {self.head.vocab_start}"
            )
        with torch.no_grad():
            self.head.weight.copy_(state["weight"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def saved_layout(step_folder: Path) -> dict | None:
    """{vocab_parallel_size, world_size, vocab_size} of a checkpoint with slices; None for a dense one."""
    path = step_folder / FOLDER / LAYOUT
    return json.loads(path.read_text()) if path.is_file() else None


def _rank_file(step_folder: Path, rank: int) -> Path:
    return step_folder / FOLDER / f"rank_{rank:05d}.pt"


class VocabParallelOutputLayer(nn.Module):
    """Stands in for the LM's output layer when the matrix is sharded by vocabulary, so that the HF model still
    generates (the trainer's generation metrics): each call reassembles the [V, H] matrix from the group's slices
    (a collective; ZeRO-3 gathers a dense output layer on every call too). Training never calls it."""

    def __init__(self, head: VocabParallelHead):
        super().__init__()
        _hold_outside_zero(self, "head", head)

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden_BTH, self.head.full_weight().to(hidden_BTH.dtype))


def _hold_outside_zero(owner: nn.Module, name: str, head: VocabParallelHead) -> None:
    """Reference the slice without registering it as a submodule (see `VocabParallelOutputHead`)."""
    object.__setattr__(owner, name, head)
