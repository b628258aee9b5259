"""`apply_ntl`: one call that makes a transformers causal LM (or the model of a transformers `Trainer`) train on
CE + λ·NTL through the chunked head, and `NtlPatch.undo` that gives transformers' behaviour back exactly."""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

from transformers import PreTrainedModel, Trainer

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.heads.architectures import OUTPUT_BIAS, checked_rule, logit_transform
from ntl_pretrain.heads.forward_rules import ForwardRule
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
    _check_model(model)
    ntl = _checked_ntl(kind, ntl_weight, reweigh, float_level)
    _check_head(tokenizer, ntl, chunk_size, backend)
    rule = _checked_causal_lm(model)
    weight = model.get_output_embeddings().weight
    vocab_size = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 leaves an empty shard in weight.shape
    number_vocab = None if kind is None else NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
    if number_vocab is not None:
        try:
            number_vocab.require_numbers(way_out="pass kind=None to train on CE alone")
        except ValueError as error:
            raise ValueError(f"apply_ntl: tokenizer: {error}") from None
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


def _check_model(model) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"apply_ntl: takes a transformers causal LM or Trainer, got {type(model).__name__}")
    if isinstance(model.__dict__.get("forward"), NtlForward):
        raise ValueError("apply_ntl: this model has NTL applied already; undo that patch first")


def _checked_ntl(kind, ntl_weight, reweigh, float_level) -> NtlConfig:
    """The NTL term the arguments ask for; a `ValueError` naming the first argument that cannot be."""
    if kind not in (*KINDS, None):
        raise ValueError(f"apply_ntl: kind must be one of {KINDS}, or None for CE alone, got {_described(kind)}")
    if not _number(ntl_weight) or not (math.isfinite(ntl_weight) and ntl_weight >= 0):
        raise ValueError(f"apply_ntl: ntl_weight must be a finite number >= 0 (0 trains on CE alone), got "
                         f"{_described(ntl_weight)}")  # fmt: skip
    for name, flag in (("reweigh", reweigh), ("float_level", float_level)):
        if not isinstance(flag, bool):
            raise ValueError(f"apply_ntl: {name} must be True or False, got {_described(flag)}")
    ntl = NtlConfig(kind, float(ntl_weight), reweigh, float_level)
    try:
        ntl.check(none="None")
    except ValueError as error:
        raise ValueError(f"apply_ntl: {error}") from None
    return ntl


def _check_head(tokenizer, ntl: NtlConfig, chunk_size, backend) -> None:
    if ntl.kind is not None and not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ValueError(f"apply_ntl: tokenizer must be the model's transformers tokenizer (NTL of kind {ntl.kind!r} "
                         f"reads its number tokens), got {_described(tokenizer)}; or pass kind=None for "
                         "CE alone")  # fmt: skip
    if chunk_size is not None and not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
                                       and chunk_size >= 1):  # fmt: skip
        raise ValueError(f"apply_ntl: chunk_size must be a whole number of positions >= 1, or None to size chunks "
                         f"by the vocabulary, got {_described(chunk_size)}")  # fmt: skip
    if backend not in BACKENDS:
        raise ValueError(f"apply_ntl: backend must be one of {BACKENDS}, got {_described(backend)}")


def _number(value) -> bool:
    """A real number, not a bool (`True` is an int to Python, and a mistake as a weight)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _described(value) -> str:
    """A value as a refusal shows it: short values with their type where the type is the mistake ('0.3', True),
    others by their type alone (a whole object's repr is no line)."""
    if isinstance(value, (str, bool)):
        return f"{value!r} (a {type(value).__name__})"
    if value is None or isinstance(value, numbers.Number):
        return repr(value)
    return f"a {type(value).__name__}"


def _checked_causal_lm(model: PreTrainedModel) -> ForwardRule:
    """The forward rule of `model`, a causal LM of a family the heads train with an output layer they can multiply
    by; a `ValueError` naming the model's class and why not."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name, model_type = type(model).__name__, model.config.model_type
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    is_causal = causal is not None and any(cls.__name__ == causal for cls in type(model).__mro__)
    if causal is not None and (not is_causal or model.get_output_embeddings() is None):
        raise ValueError(f"apply_ntl: model: {name} is not a causal LM with an output layer; apply_ntl replaces the "
                         f"loss of one: pass {causal}, the causal LM of model_type {model_type!r} "
                         "(AutoModelForCausalLM)")  # fmt: skip
    if model_type in OUTPUT_BIAS:
        raise ValueError(f"apply_ntl: model: {name}'s output layer has a bias, which the chunked head does not apply")
    try:
        rule = checked_rule(model.config)
    except ValueError as error:
        raise ValueError(f"apply_ntl: model: {name}: {error}") from None
    output_layer = model.get_output_embeddings()
    if type(output_layer).__module__.startswith("peft."):
        raise ValueError(f"apply_ntl: the output layer is adapted by PEFT ({type(output_layer).__name__}), which the "
                         "chunked head does not apply; leave it out of target_modules and modules_to_save")  # fmt: skip
    return rule
