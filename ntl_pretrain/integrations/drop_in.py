"""`apply_ntl`: one call that makes a transformers causal LM (or the model of a transformers `Trainer`) train on
CE + λ·NTL through the chunked head, and `NtlPatch.undo` that gives transformers' behaviour back exactly."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from transformers import PreTrainedModel, Trainer

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.heads.architectures import OUTPUT_BIAS, checked_rule, logit_transform
from ntl_pretrain.heads.router_aux import router_balancing
from ntl_pretrain.integrations.causal_lm import NtlForward, NtlObjective
from ntl_pretrain.integrations.trainer_hooks import TrainerHooks
from ntl_pretrain.loss.backend import BACKENDS
from ntl_pretrain.loss.ce_ntl import KINDS
from ntl_pretrain.numbers import NumberVocab


@dataclass
class NtlPatch:
    """What `apply_ntl` changed; `undo()` puts back what was there (the model's and the Trainer's own attributes; a
    forward wrapped since by another library stays wrapped, and passes every call to transformers')."""

    model: PreTrainedModel
    forward: NtlForward
    trainer_hooks: TrainerHooks | None = None
    zero3_external: bool = False
    """Whether the output layer's weight was registered with the model as a ZeRO-3 external parameter."""

    def undo(self) -> None:
        if not self.forward.active:
            raise RuntimeError("apply_ntl: this patch was undone already")
        self.forward.active = False
        if self.trainer_hooks is not None:
            self.trainer_hooks.undo()
        if self.zero3_external:
            from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter

            unregister_external_parameter(self.model, self.model.get_output_embeddings().weight)
        if self.model.__dict__.get("forward") is not self.forward:
            return  # wrapped since (accelerate's autocast): it stays in the chain, passing calls to transformers
        if self.forward.replaced is None:
            del self.model.__dict__["forward"]
        else:
            self.model.__dict__["forward"] = self.forward.replaced


def apply_ntl(
    model_or_trainer: PreTrainedModel | Trainer,
    tokenizer,
    kind: str | None = "was",
    ntl_weight: float = 0.3,
    *,
    reweigh: bool = False,
    float_level: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> NtlPatch:
    """Make `model(input_ids=..., labels=...)` return CE + `ntl_weight`·NTL of `kind` (docs/loss.md), computed by
    `linear_ce_ntl_loss` a chunk of positions at a time (the logits are never whole; `output.logits` is None,
    `output.ce` and `output.ntl` hold the two terms). Without labels the model is transformers' own.

    A PEFT model (LoRA and other in-place adapters) is patched through its base model (`language_model`). Given a
    `Trainer` (TRL's `SFTTrainer` too), also its counting and logging (trainer_hooks.py): NTL is normalised by the
    NTL terms of the whole optimizer step, as CE is by `num_items_in_batch`, and the logs gain `ce` and `ntl`. Given
    a model alone, a call with `num_items_in_batch` needs `num_number_tokens=` beside it. `tokenizer`: whose number
    tokens NTL reads (any tokenizer `NumberVocab.from_tokenizer` takes; None with kind None). The model's family must
    be one the heads train (heads/architectures.py: docs/compatibility.md), its output layer without a bias. Under
    DeepSpeed ZeRO-3 the output layer's weight is gathered for the model's forward and backward
    (`gather_output_weight`); under FSDP2 by its unit, or by the head where the output layer is a unit of its own
    (causal_lm.whole). Returns the patch; `patch.undo()` restores the forward (and the Trainer, and ZeRO-3's
    registration).
    """
    trainer = model_or_trainer if isinstance(model_or_trainer, Trainer) else None
    model = language_model(model_or_trainer.model if trainer is not None else model_or_trainer)
    ntl = NtlConfig(kind, ntl_weight, reweigh, float_level)
    _check_arguments(model, ntl, backend)
    rule = checked_rule(model.config)
    weight = model.get_output_embeddings().weight
    vocab_size = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 leaves an empty shard in weight.shape
    number_vocab = None if kind is None else NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
    if number_vocab is not None:
        number_vocab.require_numbers()
    objective = NtlObjective(ntl, number_vocab, logit_transform(model), chunk_size, backend)
    forward = NtlForward(model, objective, rule, router_balancing(model, None))
    hooks = TrainerHooks(trainer, forward) if trainer is not None else None
    model.forward = forward
    return NtlPatch(model, forward, hooks, gather_output_weight(model))


def gather_output_weight(model: PreTrainedModel) -> bool:
    """Under DeepSpeed ZeRO-3 a parameter is gathered only around the forward and backward of the module that owns
    it, and the patched forward multiplies by the output layer's weight without calling that layer. Registered as an
    external parameter of the model (DeepSpeed's documented way, as heads/chunked.py does in our own trainer), it is
    gathered for the model's forward and backward and released after; its gradient reaches ZeRO-3's reduce-scatter
    like any other. True where it was registered (a partitioned weight)."""
    weight = model.get_output_embeddings().weight
    if not hasattr(weight, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    register_external_parameter(model, weight)
    return True


def language_model(model):
    """The transformers causal LM whose forward the patch replaces: `model`, or the base model under a PEFT adapter
    (LoRA and the other tuners that adapt layers in place; PEFT calls the base model as a module, so its patched
    forward runs, with the adapters inside the trunk). Prompt learning is refused: it prepends virtual tokens in
    PEFT's own forward, to inputs and labels alike, which the patched forward never sees."""
    peft = sys.modules.get("peft")  # a PEFT model exists only where peft was imported
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    config = model.active_peft_config
    if config.is_prompt_learning:
        raise ValueError(f"apply_ntl: PEFT {config.peft_type.value} prepends virtual tokens in PEFT's own forward, "
                         "which this drop-in does not follow; adapters such as LoRA are supported")  # fmt: skip
    return model.get_base_model()


def _check_arguments(model, ntl: NtlConfig, backend: str) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"apply_ntl: takes a transformers causal LM or Trainer, got {type(model).__name__}")
    if isinstance(model.__dict__.get("forward"), NtlForward):
        raise ValueError("apply_ntl: this model has NTL applied already; undo that patch first")
    if ntl.kind not in (*KINDS, None):
        raise ValueError(f"apply_ntl: kind must be one of {KINDS} or None, got {ntl.kind!r}")
    if not ntl.weight >= 0:
        raise ValueError(f"apply_ntl: ntl_weight must be >= 0, got {ntl.weight}")
    if backend not in BACKENDS:
        raise ValueError(f"apply_ntl: backend must be one of {BACKENDS}, got {backend!r}")
    try:
        ntl.check()
    except ValueError as error:
        raise ValueError(f"apply_ntl: {error}") from error
    if model.config.model_type in OUTPUT_BIAS:
        raise ValueError(f"apply_ntl: {type(model).__name__}'s output layer has a bias, which the chunked head does "
                         "not apply")  # fmt: skip
    output_layer = model.get_output_embeddings()
    if type(output_layer).__module__.startswith("peft."):
        raise ValueError(f"apply_ntl: the output layer is adapted by PEFT ({type(output_layer).__name__}), which the "
                         "chunked head does not apply; leave it out of target_modules and modules_to_save")  # fmt: skip
