"""What `apply_ntl` changes on a transformers `Trainer` (instance attributes only; `TrainerHooks.undo` removes them):

1. Counting. Where the Trainer counts a batch's label tokens for `num_items_in_batch` (`_get_num_items_in_batch`:
   once per optimizer step over all its gradient-accumulation micro-batches, and once per evaluation batch), the same
   method counts the NTL terms of the same batches (number-label tokens; numbers with kind "number"), so that K
   gets N's shift, sum over processes and division by tensor/context/sequence-parallel size exactly (causal_lm.py).
2. Logging. Each training log that holds `loss` also holds `ce` and `ntl` of the same steps and processes, taken as
   the Trainer takes `loss` (each process's sum times the factor `compute_loss` applies, averaged over processes,
   divided by the steps since the last log): loss = ce + λ·ntl (plus w·aux for a MoE whose router logits are on).
3. Evaluation. `evaluation_loop` (under `evaluate` and `predict`) also returns `<prefix>_ce` and `<prefix>_ntl` beside
   `<prefix>_loss`, over the same rows: a CE+NTL run's `eval_ce` is what compares with a CE run's `eval_loss`.
4. TRL's `SFTTrainer` only: `compute_loss`. TRL's takes the loss from its own fused head (`log_probs`), never from
   the model's loss; the patched one is transformers' `Trainer.compute_loss` (the model's loss, CE + λ·NTL, scaled as
   for any Trainer), with the cache off as TRL sets it. TRL's `entropy` and `mean_token_accuracy`, which come from
   its head, are not logged; `ce` and `ntl` are.

Refused, each with the argument that causes it: a Trainer that computes the loss itself (TRL's trainers but
`SFTTrainer`, its `loss_type` dft, label smoothing, `compute_loss_func`), that does not pass `num_items_in_batch` to
the model, that runs DataParallel replicas (`n_gpu` > 1: one process, several GPUs), or that would call
`compute_metrics` on predictions (the patched model forms no logits: at patch time, and at an evaluation when it was
set after).
"""

from __future__ import annotations

import sys

import torch

from ntl_pretrain.integrations.causal_lm import IGNORE_INDEX, LossParts, NtlForward, NtlObjective
from ntl_pretrain.loss.number_level import find_number_spans

PATCHED = ("_get_num_items_in_batch", "log", "evaluation_loop")
PATCHED_ON_SFT = (*PATCHED, "compute_loss")


def is_sft_trainer(trainer) -> bool:
    sft = sys.modules.get("trl.trainer.sft_trainer")  # an SFTTrainer exists only where its module was imported
    return sft is not None and isinstance(trainer, sft.SFTTrainer)


def check_trainer(trainer) -> None:
    """Raise `ValueError` naming the setting when `trainer` would not train through the patched forward's loss."""
    if is_sft_trainer(trainer):
        check_sft_trainer(trainer)
    elif type(trainer).__module__.startswith("trl."):
        raise ValueError(f"{type(trainer).__name__} (TRL) computes its own objective from TRL's fused head, not the "
                         "model's loss; of TRL's trainers apply_ntl takes SFTTrainer")  # fmt: skip
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
    check_metrics(trainer)


def check_metrics(trainer, prediction_loss_only: bool | None = None) -> None:
    """Refuse a `compute_metrics` the Trainer would call: the patched model forms no logits (the chunked head is
    there so that the [B, T, V] logits never exist, and the Trainer would gather them over the whole evaluation), so
    it would get `predictions=()` and report what that gives. `prediction_loss_only`: an evaluation's own setting,
    which wins over the Trainer's arguments."""
    loss_only = trainer.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    if trainer.compute_metrics is not None and not loss_only:
        raise ValueError("compute_metrics: the patched model returns no logits (its loss head never forms them), so "
                         "the Trainer would call it with predictions=(); leave it None (eval_loss, eval_ce and "
                         "eval_ntl are reported), or evaluate it with the patch undone")  # fmt: skip


def check_sft_trainer(trainer) -> None:
    from trl import SFTTrainer

    if type(trainer).compute_loss is not SFTTrainer.compute_loss:
        raise ValueError(f"{type(trainer).__name__} overrides SFTTrainer.compute_loss, which apply_ntl would replace "
                         "with transformers' (the model's loss); leave compute_loss TRL's")  # fmt: skip
    if trainer.args.loss_type != "nll":
        raise ValueError(f"loss_type {trainer.args.loss_type!r}: TRL weighs each token's CE by its probability from "
                         "its own head, which NTL's head does not form; set loss_type 'nll'")  # fmt: skip
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and (parallelism.sp_enabled or parallelism.cp_enabled):
        raise ValueError("sequence and context parallelism: TRL reduces the loss of its own head across the ranks of "
                         "a sequence, which apply_ntl's loss does not follow")  # fmt: skip


def sft_compute_loss(trainer):
    """`compute_loss` for TRL's SFTTrainer: transformers' `Trainer.compute_loss` (the model's own loss, normalised by
    `num_items_in_batch` and scaled over processes as for any Trainer), the cache off as TRL turns it off."""
    from transformers import Trainer

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs["use_cache"] = False
        return Trainer.compute_loss(trainer, model, inputs, return_outputs, num_items_in_batch)

    return compute_loss


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


def loss_scale(trainer) -> int:
    """What `Trainer.compute_loss` multiplies a process's loss by when it gave the model a step's count of all
    processes (`average_tokens_across_devices`), so that a mean over processes is the step's loss."""
    if not trainer.args.average_tokens_across_devices:
        return 1
    return trainer.accelerator.num_processes // trainer.get_tp_size()


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
        means = trainer.accelerator.gather((self.sums * loss_scale(trainer))[None]).mean(0) / self.steps
        self.sums, self.steps = None, 0
        ce, ntl = means.tolist()
        return {"ce": ce, "ntl": ntl}


class EvalLog:
    """loss, ce and ntl of one evaluation's batches, gathered as `Trainer.evaluation_loop` gathers each batch's loss:
    scaled as `compute_loss` scales it, repeated `eval_batch_size` times, through the loop's own `gather_function`
    (which drops the padding of an uneven last batch), non-finite losses left out as `logging_nan_inf_filter` does.
    So `<prefix>_ce` and `<prefix>_ntl` are means over the rows `<prefix>_loss` is."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.rows: list[torch.Tensor] = []

    def add(self, parts: LossParts) -> None:
        trainer = self.trainer
        triple = torch.stack([parts.loss, parts.ce, parts.ntl]).detach().float() * loss_scale(trainer)
        self.rows.append(trainer.gather_function(triple.repeat(trainer.args.eval_batch_size, 1)).cpu())

    def metrics(self, prefix: str) -> dict[str, float]:
        if not self.rows:
            return {}
        rows = torch.cat(self.rows)
        finite = rows[:, 0].isfinite()
        if self.trainer.args.logging_nan_inf_filter and finite.any():
            rows = rows[finite]
        ce, ntl = rows[:, 1:].double().mean(0).tolist()
        return {f"{prefix}_ce": ce, f"{prefix}_ntl": ntl}


class TrainerHooks:
    """The Trainer's counting and logging, extended for `forward` (module docstring); `undo` restores them."""

    def __init__(self, trainer, forward: NtlForward):
        check_trainer(trainer)
        self.trainer, self.forward = trainer, forward
        sft = is_sft_trainer(trainer)
        self.replaced = {name: trainer.__dict__.get(name) for name in (PATCHED_ON_SFT if sft else PATCHED)}
        count_items, log, evaluation_loop = trainer._get_num_items_in_batch, trainer.log, trainer.evaluation_loop
        loss_log = LossLog()
        eval_log: EvalLog | None = None

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

        def evaluation_loop_with_parts(*args, metric_key_prefix: str = "eval", **kwargs):
            nonlocal eval_log
            check_metrics(trainer, kwargs.get("prediction_loss_only", args[2] if len(args) > 2 else None))
            eval_log = EvalLog(trainer)
            try:
                output = evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
                output.metrics.update(eval_log.metrics(metric_key_prefix))
                return output
            finally:
                eval_log = None

        def on_loss(parts: LossParts, num_items) -> None:
            if eval_log is not None:
                eval_log.add(parts)
            elif forward.lm.training:
                loss_log.add(parts, num_items)

        trainer._get_num_items_in_batch, trainer.log = count_with_terms, log_with_parts
        trainer.evaluation_loop = evaluation_loop_with_parts
        if sft:
            trainer.compute_loss = sft_compute_loss(trainer)
        forward.on_loss = on_loss

    def undo(self) -> None:
        for name, replaced in self.replaced.items():
            if replaced is None:
                del self.trainer.__dict__[name]
            else:
                self.trainer.__dict__[name] = replaced
        self.forward.on_loss = None
