"""The forward `apply_ntl` gives a transformers causal LM: with labels, CE + λ·NTL through the chunked head, the
[B, T, V] logits never formed; without labels, transformers' own forward, untouched.

With labels it does what the family's `*ForCausalLM.forward` does (heads/forward_rules.py reads it): the trunk
(`model`, OPT's `model.decoder`) for the hidden states, the output layer's weight (tied or not) and the logit
transform (scale, soft-cap) inside `linear_ce_ntl_rows`, labels shifted by one as transformers' `ForCausalLMLoss`
shifts them (or its `shift_labels` taken as they are), -100 ignored, and for a MoE asked for its router logits the
load-balancing term transformers adds (`router_aux_loss_coef · aux`, with the attention mask it passes).

Normalisation (`loss = ce + λ·ntl`; ce = ΣCE / n, ntl = ΣNTL / k):
- no `num_items_in_batch`: n and k are this call's label tokens and NTL terms (number-label tokens; numbers with
  kind "number"): `ce_ntl_loss(reduction="mean")`, transformers' mean CE when λ is 0.
- `num_items_in_batch` (transformers' Trainer passes the label tokens of the whole optimizer step: every
  gradient-accumulation micro-batch, and every process with `average_tokens_across_devices`): n is it, and k the
  NTL terms of the same micro-batches and processes, which the Trainer `apply_ntl` was given counts with the same
  method (trainer_hooks.py), or `num_number_tokens=` passed beside it. The step's micro-batches then add up to
  ΣCE / N + λ·ΣNTL / K over the step, ntl-pretrain's own objective (design.md, "Reduction").

Shapes: B batch, T sequence, H hidden size.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import sys
import typing
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.heads.forward_rules import ForwardRule
from ntl_pretrain.heads.router_aux import RouterBalancing
from ntl_pretrain.loss.chunked import linear_ce_ntl_rows
from ntl_pretrain.loss.logit_transform import LogitTransform
from ntl_pretrain.numbers import NumberVocab

IGNORE_INDEX = -100
LOSS_KEYWORDS = ("num_items_in_batch", "num_number_tokens")
"""Keywords the patched forward takes for the loss alone (transformers' forward would hand them to the trunk)."""
NOT_FOR_THE_TRUNK = {"labels", "shift_labels", "logits_to_keep", "return_dict"}


@dataclass(frozen=True)
class NtlObjective:
    """What the patched forward computes from the hidden states: `ntl` (kind, λ, reweigh, float_level) over
    `number_vocab`, the logits `transform(hidden @ weight.T)` a chunk of `chunk_size` positions at a time."""

    ntl: NtlConfig
    number_vocab: NumberVocab | None
    transform: LogitTransform
    chunk_size: int | None
    backend: str


@dataclass
class LossParts:
    """One call's loss and its detached parts, normalised as the loss is (loss = ce + λ·ntl, plus a MoE's aux)."""

    loss: torch.Tensor
    ce: torch.Tensor
    ntl: torch.Tensor
    num_tokens: torch.Tensor
    num_number_tokens: torch.Tensor


class StepCounts:
    """The NTL terms of the batch whose label tokens a Trainer counted last (trainer_hooks.py records both), so that
    a forward given that count (`num_items_in_batch`) finds its NTL count."""

    def __init__(self) -> None:
        self.num_items: object = None
        self.num_terms: torch.Tensor | int | None = None

    def record(self, num_items, num_terms) -> None:
        self.num_items, self.num_terms = num_items, num_terms

    def terms_for(self, num_items) -> torch.Tensor | int:
        same = num_items is self.num_items or (not torch.is_tensor(num_items) and num_items == self.num_items)
        if self.num_terms is None or not same:
            raise ValueError(
                "num_items_in_batch was given without the count of NTL terms (number labels) of the same batch: "
                "pass the Trainer to apply_ntl (apply_ntl(trainer, tokenizer, ...)) so that it counts them as it "
                "counts label tokens, or pass num_number_tokens= beside num_items_in_batch"
            )
        return self.num_terms


class NtlForward:
    """Set as `lm.forward` (an instance attribute: the class, and every other model of it, keep transformers'
    forward). Holds what undoing needs (`replaced`: the instance's own `forward` before, if it had one). Once
    `active` is False it passes every call to transformers' forward unchanged: what undoing leaves where another
    wrapper has wrapped it since (accelerate wraps `forward` in autocast when a Trainer prepares a bf16 model)."""

    def __init__(
        self,
        lm: PreTrainedModel,
        objective: NtlObjective,
        rule: ForwardRule,
        balancing: RouterBalancing | None,
    ):
        self.lm, self.objective, self.rule, self.balancing = lm, objective, rule, balancing
        self.replaced = lm.__dict__.get("forward")
        self.transformers_forward = lm.forward
        self.signature = self.__signature__ = inspect.signature(self.transformers_forward)  # what Trainer reads
        self.trunk = operator.attrgetter(rule.trunk)
        self.counts = StepCounts()
        self.active = True
        self.on_loss: typing.Callable[[LossParts, object], None] | None = None
        """Called with each call's parts and its num_items_in_batch (trainer_hooks.py logs them)."""

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.transformers_forward(*args, **kwargs)
        ours = {key: kwargs.pop(key) for key in LOSS_KEYWORDS if key in kwargs}
        bound = self.signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        for name, parameter in self.signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        if arguments.get("labels") is None:
            return self.transformers_forward(*args, **kwargs)
        return self.loss_forward(arguments, ours.get("num_items_in_batch"), ours.get("num_number_tokens"))

    def loss_forward(self, arguments: dict, num_items, num_terms):
        labels_BT, shift_labels_BT = arguments["labels"], arguments.get("shift_labels")
        if arguments.get("logits_to_keep"):
            raise ValueError("logits_to_keep: the loss needs every position's hidden state; leave it 0 with labels")
        trunk_arguments = {key: value for key, value in arguments.items() if key not in NOT_FOR_THE_TRUNK}
        if self.rule.router_logits:
            trunk_arguments["output_router_logits"] = self._router_logits_asked(arguments)
        trunk_out = self.trunk(self.lm)(**trunk_arguments)
        if shift_labels_BT is None:  # as transformers' ForCausalLMLoss: position t predicts label t + 1
            shift_labels_BT = torch.nn.functional.pad(labels_BT, (0, 1), value=IGNORE_INDEX)[..., 1:]
        if num_items is not None and num_terms is None:
            num_terms = self.counts.terms_for(num_items)
        parts = self.head_loss(trunk_out[0], shift_labels_BT.to(trunk_out[0].device), num_items, num_terms)
        aux_loss = None
        if trunk_arguments.get("output_router_logits") and self.balancing is not None:
            aux_loss = self.balancing.function(trunk_out.router_logits, *self.balancing.arguments,
                                               arguments.get("attention_mask"))  # fmt: skip
            parts.loss = parts.loss + self.balancing.model_coefficient * aux_loss.to(parts.loss.device)
        if self.on_loss is not None:
            self.on_loss(parts, num_items)
        out = self._output(parts.loss, trunk_out, aux_loss)
        # attributes, not fields: Trainer.evaluate would collect a field as if it were logits
        out.ce, out.ntl = parts.ce, parts.ntl
        out.num_tokens, out.num_number_tokens = parts.num_tokens, parts.num_number_tokens
        return out if arguments.get("return_dict", True) is not False else out.to_tuple()

    def head_loss(self, hidden_BTH: torch.Tensor, labels_BT: torch.Tensor, num_items, num_terms) -> LossParts:
        """CE + λ·NTL of `transform(hidden @ weight.T)` against `labels_BT` (already shifted)."""
        objective = self.objective
        weight_VH = whole(self.lm.get_output_embeddings().weight)
        # under torch.autocast the head multiplies as nn.Linear does (its dtype) and keeps the loss math in fp32
        rows = linear_ce_ntl_rows(
            hidden_BTH, weight_VH, labels_BT, objective.number_vocab, objective.ntl, reduction="mean",
            chunk_size=objective.chunk_size, num_tokens=num_items, num_number_tokens=num_terms,
            transform=objective.transform, ignore_index=IGNORE_INDEX, backend=objective.backend,
        )  # fmt: skip
        ce, ntl = rows.ce_N.sum() * rows.ce_scale, rows.ntl_N.sum() * rows.ntl_scale
        return LossParts(rows.loss, ce, ntl, rows.valid_N.sum(), rows.ntl_terms_N.sum())

    def _router_logits_asked(self, arguments: dict) -> bool:
        """A MoE forward asks its trunk for router logits (and then adds the balancing term) when told to, else when
        its config says so."""
        asked = arguments.get("output_router_logits")
        return bool(self.lm.config.output_router_logits if asked is None else asked)

    def _output(self, loss: torch.Tensor, trunk_out, aux_loss: torch.Tensor | None):
        """The output class transformers' forward returns, with `logits` None and the trunk's fields it shares."""
        output_class = returned_class(type(self.lm))
        names = {field.name for field in dataclasses.fields(output_class)}
        shared = {name: getattr(trunk_out, name) for name in names if name not in ("loss", "logits")
                  and getattr(trunk_out, name, None) is not None}  # fmt: skip
        if aux_loss is not None and "aux_loss" in names:
            shared["aux_loss"] = aux_loss
        return output_class(loss=loss, logits=None, **shared)


def whole(weight: torch.Tensor) -> torch.Tensor:
    """The output layer's weight whole. Under FSDP2 it is already, inside the forward of the unit that holds it (the
    root's, usually). Where the output layer is a unit of its own (a size-based wrap policy makes it one) its hooks
    never run, since the head does not call it, and the weight is still a sharded DTensor: gathered here. Each
    process's gradient of it is its own (`Partial`), so autograd reduce-scatters it to the shards, averaged over
    processes as FSDP2 averages the gradients its hooks reduce (left as a replicated gradient, each shard would keep
    its own process's slice)."""
    if isinstance(weight, DTensor):
        return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    return weight


def returned_class(model_class: type) -> type:
    """The output dataclass `model_class.forward` is annotated to return (`MoeCausalLMOutputWithPast` for a MoE,
    `CausalLMOutputWithPast` for most), resolved in the forward's module; `CausalLMOutputWithPast` when unannotated."""
    annotation = inspect.signature(model_class.forward).return_annotation
    if isinstance(annotation, str):
        annotation = vars(sys.modules[model_class.__module__]).get(annotation)
    return (
        annotation if inspect.isclass(annotation) and dataclasses.is_dataclass(annotation) else CausalLMOutputWithPast
    )
