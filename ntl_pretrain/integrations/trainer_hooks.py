"""What `apply_ntl` changes on a transformers `Trainer` (instance attributes only; `TrainerHooks.undo` removes them):

1. Counting. Where the Trainer counts a batch's label tokens for `num_items_in_batch` (`_get_num_items_in_batch`:
   once per optimizer step over all its gradient-accumulation micro-batches, and once per evaluation batch), the same
   method counts the NTL terms of the same batches (number-label tokens; numbers with kind "number"), so that K
   gets N's shift, sum over processes and division by tensor/context/sequence-parallel size exactly (causal_lm.py).
2. Logging. Each training log that holds `loss` also holds `ce` and `ntl` of the same steps and processes, taken as
   the Trainer takes `loss` (each process's sum times the factor `compute_loss` applies, averaged over processes,
   divided by the steps since the last log): loss = ce + λ·ntl (plus w·aux for a MoE whose router logits are on).

Refused, each with the argument that causes it: a Trainer that computes the loss from logits itself (label
smoothing, `compute_loss_func`), that does not pass `num_items_in_batch` to the model, or that runs DataParallel
replicas (`n_gpu` > 1: one process, several GPUs).
"""

from __future__ import annotations

import torch

from ntl_pretrain.integrations.causal_lm import IGNORE_INDEX, LossParts, NtlForward, NtlObjective
from ntl_pretrain.loss.number_level import find_number_spans

PATCHED = ("_get_num_items_in_batch", "log")


def check_trainer(trainer) -> None:
    """Raise `ValueError` naming the setting when `trainer` would not train through the patched forward's loss."""
    if trainer.label_smoother is not None:
        raise ValueError("label_smoothing_factor: the Trainer then computes the loss from logits, without NTL; set 0")
    if trainer.compute_loss_func is not None:
        raise ValueError("compute_loss_func: the Trainer then computes the loss from logits, without NTL; leave None")
    if not trainer.model_accepts_loss_kwargs:
        raise ValueError("the Trainer does not pass num_items_in_batch to this model (model_accepts_loss_kwargs is "
                         "False: sequence parallelism?), so NTL could not be normalised over the step")  # fmt: skip
    if trainer.args.n_gpu > 1:
        raise ValueError(f"n_gpu {trainer.args.n_gpu}: DataParallel replicas are not supported; launch one process "
                         f"per GPU (torchrun, accelerate launch)")  # fmt: skip


def ntl_terms(labels_BT: torch.Tensor, objective: NtlObjective) -> torch.Tensor:
    """bool, like `labels_BT` (already shifted): where an NTL term sits (a number label, or a number's first
    position with kind "number")."""
    nv, ntl = objective.number_vocab, objective.ntl
    if ntl.kind is None:
        return torch.zeros_like(labels_BT, dtype=torch.bool)
    if ntl.kind == "number":
        return find_number_spans(labels_BT, nv, IGNORE_INDEX, ntl.float_level).first.view(labels_BT.shape)
    classes = nv.to(labels_BT.device).classes
    return (labels_BT != IGNORE_INDEX) & (classes[labels_BT.clamp_min(0)] >= 0)


def terms_batch(batch: dict, objective: NtlObjective) -> dict:
    """`batch`'s labels with every label that is not an NTL term set to -100, in the frame the Trainer counts: its
    `shift_labels` when it has them, else `labels` whose first column no loss reads (-100 here)."""
    if "shift_labels" in batch:
        shifted = batch["shift_labels"]
        return {"labels": batch["labels"], "shift_labels": shifted.where(ntl_terms(shifted, objective), IGNORE_INDEX)}
    labels = batch["labels"]
    shifted = labels[..., 1:]
    terms = shifted.where(ntl_terms(shifted, objective), IGNORE_INDEX)
    return {"labels": torch.cat([torch.full_like(labels[..., :1], IGNORE_INDEX), terms], dim=-1)}


class LossLog:
    """ce and ntl of the training calls since the last log, as sums of their normalised parts per process."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.steps = 0
        self.last_items: object = None

    def add(self, parts: LossParts, num_items) -> None:
        if num_items is not self.last_items:  # the Trainer counts once per optimizer step: a new count, a new step
            self.steps, self.last_items = self.steps + 1, num_items
        pair = torch.stack([parts.ce, parts.ntl]).detach().double()
        self.sums = pair if self.sums is None else self.sums + pair

    def take(self, trainer) -> dict[str, float]:
        """The means since the last log, as the Trainer logs `loss` (Trainer._maybe_log_save_evaluate)."""
        if self.sums is None:
            return {}
        scale = trainer.accelerator.num_processes // trainer.get_tp_size()
        scale = scale if trainer.args.average_tokens_across_devices else 1  # what compute_loss multiplies by
        means = trainer.accelerator.gather((self.sums * scale)[None]).mean(0) / self.steps
        self.sums, self.steps = None, 0
        ce, ntl = means.tolist()
        return {"ce": ce, "ntl": ntl}


class TrainerHooks:
    """The Trainer's counting and logging, extended for `forward` (module docstring); `undo` restores them."""

    def __init__(self, trainer, forward: NtlForward):
        check_trainer(trainer)
        self.trainer, self.forward = trainer, forward
        self.replaced = {name: trainer.__dict__.get(name) for name in PATCHED}
        count_items, log = trainer._get_num_items_in_batch, trainer.log
        loss_log = LossLog()

        def count_with_terms(batch_samples: list, device: torch.device):
            num_items = count_items(batch_samples, device)
            if num_items is not None:
                num_terms = count_items([terms_batch(b, forward.objective) for b in batch_samples], device)
                forward.counts.record(num_items, num_terms)
            return num_items

        def log_with_parts(logs: dict[str, float], *args, **kwargs) -> None:
            if "loss" in logs:
                logs.update(loss_log.take(trainer))
            log(logs, *args, **kwargs)

        trainer._get_num_items_in_batch, trainer.log = count_with_terms, log_with_parts
        forward.on_loss = loss_log.add

    def undo(self) -> None:
        for name, replaced in self.replaced.items():
            if replaced is None:
                del self.trainer.__dict__[name]
            else:
                self.trainer.__dict__[name] = replaced
        self.forward.on_loss = None
