"""The routers' load-balancing loss of a mixture of experts, trained as its authors train it:
`CE + λ·NTL + router_aux_weight · load_balancing_loss`.

A MoE `*ForCausalLM.forward` in transformers (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, Granite-MoE, JetMoE, ...) adds
`router_aux_loss_coef · load_balancing_loss_func(outputs.router_logits, num_experts, top_k, attention_mask)` to its
loss when `output_router_logits` is on. The heads run only the trunk, so the trunk is asked for the router logits
and the term is computed here by the family's own function with the arguments its forward passes (read by
forward_rules.py), never re-implemented. The trainer gives the trunk no attention mask (packed rows; documents are
kept apart by position ids), so the function gets none either: every position of the micro-batch counts, as in
transformers' forward on the same inputs.

Normalisation: transformers' term is one value per forward (a mean over its positions, nonlinear in the routing
fractions, so not a per-token sum that global counts could divide as they divide CE and NTL). A step averages it
over the global batch's micro-batches (gradient accumulation × data-parallel ranks), each weighted alike, so that
neither the accumulation nor the world size changes the term's weight: each micro-batch adds `aux / micro_batches`.

A MoE whose forward adds no balancing loss (DeepSeek-V3's routing bias instead, which transformers keeps fixed)
trains as transformers trains it, on CE + λ·NTL; the run's start line says which of the two a model is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ntl_pretrain.heads.architectures import checked_rule
from ntl_pretrain.heads.forward_rules import aux_loss_function, evaluate


@dataclass(frozen=True)
class RouterBalancing:
    """The balancing term of one built model: `function(router_logits, *arguments, None)` is transformers' value for
    a forward; `weight` multiplies it in the objective (`loss.router_aux_weight`, by default `model_coefficient`)."""

    function: Callable[..., torch.Tensor]
    arguments: tuple
    coefficient_name: str
    model_coefficient: float
    weight: float

    def loss(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The term of one micro-batch, before the weight (fp32 scalar, differentiable through the routers)."""
        return self.function(router_logits, *self.arguments, None).float()


def router_class(model_class: type) -> type | None:
    """The module class whose output transformers records as `router_logits` (`_can_record_outputs`): the routers
    of a mixture-of-experts family; None for a dense family."""
    recorded = (getattr(model_class, "_can_record_outputs", None) or {}).get("router_logits")
    return getattr(recorded, "target_class", recorded)


def router_modules(lm: PreTrainedModel) -> list[nn.Module]:
    """`lm`'s routers: none in a dense model, nor in a MoE family built without expert layers (Doge with
    `is_moe: false`)."""
    routers = router_class(type(lm))
    return [] if routers is None else [module for module in lm.modules() if isinstance(module, routers)]


def router_balancing(lm: PreTrainedModel, weight: float | None) -> RouterBalancing | None:
    """The balancing term `lm`'s forward adds, weighted by `weight` (None: the model's own coefficient); None for a
    model whose forward adds none. A `ValueError` naming the key when a weight > 0 is asked of such a model."""
    rule = checked_rule(lm.config)
    if rule.aux_loss is None or not router_modules(lm):
        if weight:
            why = ("adds no router load-balancing loss in its forward" if rule.aux_loss is None else
                   "is built without expert layers here (its config), so it has no routers to balance")  # fmt: skip
            raise ValueError(f"loss.router_aux_weight: {weight:g}, but {rule.class_name} (model_type "
                             f"{rule.model_type!r}) {why}; leave the key null or 0")  # fmt: skip
        return None
    coefficient = float(evaluate(rule.aux_loss.coefficient, lm))
    return RouterBalancing(
        function=aux_loss_function(lm, rule.aux_loss),
        arguments=tuple(evaluate(argument, lm) for argument in rule.aux_loss.arguments),
        coefficient_name=rule.aux_loss.coefficient.rsplit(".", 1)[-1],
        model_coefficient=coefficient,
        weight=coefficient if weight is None else weight,
    )


def balancing_line(lm: PreTrainedModel, balancing: RouterBalancing | None) -> str | None:
    """The start-up line on the routers' balancing of a MoE; None for a dense model."""
    if balancing is not None:
        coefficient = f"the model's {balancing.coefficient_name}"
        if balancing.weight == 0:
            return (f"mixture of experts trained without its routers' load-balancing loss (loss.router_aux_weight 0; "
                    f"{coefficient} is {balancing.model_coefficient:g}): aux_loss is logged, not trained")  # fmt: skip
        if balancing.weight != balancing.model_coefficient:
            coefficient += f" is {balancing.model_coefficient:g}"
        return (f"mixture of experts: loss = ce + λ·ntl + {balancing.weight:g} × aux_loss, the routers' "
                f"load-balancing loss as transformers computes it (loss.router_aux_weight {balancing.weight:g}, "
                f"{coefficient})")  # fmt: skip
    if router_modules(lm):
        return ("mixture of experts whose forward adds no load-balancing loss (DeepSeek-V3-style: a routing bias, "
                "which transformers keeps fixed): trained as transformers trains it, loss = ce + λ·ntl")  # fmt: skip
    return None
