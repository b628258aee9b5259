"""What a transformers causal LM's `*ForCausalLM.forward` computes between its trunk and its loss, read by rule from
the forward's source, for every model type in the installed transformers' causal-LM mapping.

The heads run the forward's trunk and the output layer themselves (the logits are never whole), so every step the
forward takes between them must be one the heads reproduce. The forward's statements (the source parsed with `ast`
and written back with `ast.unparse`, so formatting does not matter) are matched one by one against the forms below;
the first statement no form accepts refuses the type and is quoted as the reason. Accepted forms:
- bookkeeping that leaves the logits alone (`loss = None`, `return_dict`, slicing to `logits_to_keep`, `.float()`);
- one call of a submodule on the hidden states (the output layer; `build_head` checks that it is the linear layer
  `get_output_embeddings()` returns);
- a multiplication or division of the hidden states or the logits by an attribute of the model (Cohere's
  `logit_scale`, Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier`), and tanh soft-capping (Gemma-2 on);
- the standard loss (`self.loss_function`, transformers' shifted cross-entropy) plus, for MoE, the router
  load-balancing loss `coefficient · load_balancing_loss_func(router_logits, ...)`.
A multimodal model (a config with sub-configs) is refused before its forward is read: train its text model type.

A rule is not yet a promise: only the types `architectures.CHECKED` lists, each verified against transformers' own
loss by tests/test_architectures.py, are trained.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import re
import sys
import textwrap
from dataclasses import dataclass

import torch

MULTIMODAL = r"text|vision|audio|image|vq"  # a sub-config of a model that reads more than text
ATTRIBUTE = r"self(?:\.\w+)+(?:\.get_text_config\(\)\.\w+)?"  # `self.config.x`, `self.model.x`, text config's x
HARMLESS = [
    r"(?:loss|aux_loss) = None",
    r"(return_dict|output_attentions|output_hidden_states) = \1 if \1 is not None else self\.config\.\1",
    r"if labels is not None:\n    use_cache = False",
    r"hidden_states = \w+(?:\.last_hidden_state|\[0\])",
    r"hidden_states = slice_logits_to_keep\((?:hidden_states|\w+\.last_hidden_state), logits_to_keep\)",
    # transformers < 5.2x slices inline: the slice is applied in the projection (`hidden_states[:, slice_indices, :]`)
    r"slice_indices = slice\(-logits_to_keep, None\) if isinstance\(logits_to_keep, int\) else logits_to_keep",
    r"if hidden_states\.shape\[1\] == \(input_ids if input_ids is not None else inputs_embeds\)\.shape\[1\]:\n"
    r"    hidden_states = slice_logits_to_keep\(hidden_states, logits_to_keep\)",
    r"if not return_dict:\n(?:    .*\n)*    return .*",
]
ROUTER_LOGITS = (r"output_router_logits = \(?output_router_logits if output_router_logits is not None else "
                 r"self\.config\.output_router_logits\)?(?: and self\.config\.is_moe)?")  # fmt: skip
PROJECTION = (r"(?:lm_)?logits = self\.(\w+)\(hidden_states(?:\[:, slice_indices, :\])?"
              r"(?:\.to\((?:dtype=)?self\.\w+\.weight\.dtype\))?\)"
              r"(?:\.float\(\)|\.contiguous\(\))?(?: (?P<op>[*/]) (?P<factor>" + ATTRIBUTE + "))?")  # fmt: skip
SCALE = r"(?:logits = logits|hidden_states = hidden_states) (?P<op>[*/]) (?P<factor>" + ATTRIBUTE + ")"
SOFTCAP = (r"if \(?(?:\w+ := )?(?P<cap>" + ATTRIBUTE + r")\)? is not None:\n    logits = logits(?:\.float\(\))? / \S+\n"
           r"    logits = torch\.tanh\(logits\)\n    logits = logits \* \S+")  # fmt: skip
ALIAS = r"(?P<name>\w+) = (?P<value>" + ATTRIBUTE + ")"
ALIASED_SOFTCAP = r"logits = (?:nn\.functional\.|torch\.)tanh\(logits / (?P<name>\w+)\) \* (?P=name)"
LOSS = (r"if labels is not None:\n    loss = self\.loss_function\((?:logits=)?(?:lm_)?logits, (?:labels=)?labels, "
        r"(?:vocab_size=)?[\w.()\[\]-]+(?:, pad_token_id=self\.config\.pad_token_id)?, \*\*kwargs\)")  # fmt: skip
AUX_LOSS = (r"if output_router_logits:\n    aux_loss = (?P<function>\w+)\(outputs\.router_logits, (?P<arguments>.*), "
            r"attention_mask\)\n    if labels is not None:\n        loss \+= (?P<coefficient>" + ATTRIBUTE +
            r") \* aux_loss\.to\(loss\.device\)")  # fmt: skip
# What the trunk may be given besides the forward's own inputs that default to None: None is `**kwargs`, where the
# attention arguments go; `logits_to_keep` (default 0, all positions) only trims the positions it returns.
TRUNK_ARGUMENTS = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds",
                   "use_cache", "output_attentions", "output_hidden_states", "return_dict", "output_router_logits",
                   "cache_position", "logits_to_keep", None}  # fmt: skip


@dataclass(frozen=True)
class AuxLoss:
    """The router load-balancing term a MoE forward adds to its loss: `coefficient · function(router_logits,
    *arguments, attention_mask)`, each of `arguments` and `coefficient` the source of an expression on the model."""

    function: str
    arguments: tuple[str, ...]
    coefficient: str


@dataclass(frozen=True)
class ForwardRule:
    """One model type's forward as the heads reproduce it; `refused` says why they cannot (the other fields are
    then incomplete). `factors`: (operator, expression) applied to the logits in order, before `softcap`."""

    model_type: str
    class_name: str
    trunk: str | None = None
    output_layer: str | None = None
    factors: tuple[tuple[str, str], ...] = ()
    softcap: str | None = None
    router_logits: bool = False
    aux_loss: AuxLoss | None = None
    refused: str | None = None

    @property
    def transform_summary(self) -> str:
        steps = [f"{'×' if op == '*' else '÷'} {expression}" for op, expression in self.factors]
        steps += [f"soft-cap {self.softcap}"] if self.softcap else []
        return ", ".join(steps) or "identity"


class Refused(Exception):
    """A statement of the forward that no rule accepts, or a model the heads cannot train; the message says why."""


@functools.cache
def forward_rule(model_type: str) -> ForwardRule:
    """The rule for `model_type` of the installed transformers (read once per process)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    try:
        sub_configs = CONFIG_MAPPING[model_type].sub_configs
        if any(re.search(MULTIMODAL, name) for name in sub_configs):
            raise Refused(f"a multimodal model (its config holds {', '.join(sorted(sub_configs))}): train its text "
                          f"model's type")  # fmt: skip
        return read_forward(model_type, class_name, getattr(transformers, class_name))
    except Refused as reason:
        return ForwardRule(model_type, class_name, refused=str(reason))


def read_forward(model_type: str, class_name: str, model_class: type) -> ForwardRule:
    source = textwrap.dedent(inspect.getsource(model_class.forward))
    body = [s for s in ast.parse(source).body[0].body if not _is_docstring(s)]
    trunk_at = next((i for i, s in enumerate(body) if _trunk_call(s) is not None), None)
    if trunk_at is None:
        raise Refused("its forward calls no trunk with `input_ids`")
    trunk = _trunk_attribute(_trunk_call(body[trunk_at]), _parameters_defaulting_to_none(model_class.forward))
    fields = {"trunk": trunk, "factors": [], "softcap": None, "router_logits": False, "aux_loss": None}
    aliases: dict[str, str] = {}
    for statement in body[:trunk_at] + body[trunk_at + 1 :]:
        _read_statement(ast.unparse(statement), fields, aliases)
    if "output_layer" not in fields:
        raise Refused("its forward calls no output layer on the hidden states")
    _check_output_layer(model_class, fields["output_layer"])
    if not fields.pop("loss", False):
        raise Refused("its forward computes no standard loss (`self.loss_function`)")
    return ForwardRule(model_type, class_name, **{**fields, "factors": tuple(fields["factors"])})


def _read_statement(text: str, fields: dict, aliases: dict[str, str]) -> None:
    """Record what one statement does to the logits, or raise `Refused` quoting it."""
    if text.startswith("return ") or any(re.fullmatch(form, text) for form in HARMLESS):
        return
    if re.fullmatch(ROUTER_LOGITS, text):
        fields["router_logits"] = True
    elif match := re.fullmatch(PROJECTION, text):
        fields["output_layer"] = match.group(1)
        _add_factor(fields, match.group("op"), match.group("factor"))
    elif match := re.fullmatch(SCALE, text):
        _add_factor(fields, match.group("op"), match.group("factor"))
    elif match := re.fullmatch(SOFTCAP, text):
        fields["softcap"] = match.group("cap")
    elif match := re.fullmatch(ALIAS, text):
        aliases[match.group("name")] = match.group("value")
    elif (match := re.fullmatch(ALIASED_SOFTCAP, text)) and match.group("name") in aliases:
        fields["softcap"] = aliases[match.group("name")]
    elif re.fullmatch(LOSS, text):
        fields["loss"] = True
    elif match := re.fullmatch(AUX_LOSS, text):
        arguments = tuple(ast.unparse(a) for a in ast.parse(f"f({match.group('arguments')})").body[0].value.args)
        fields["aux_loss"] = AuxLoss(match.group("function"), arguments, match.group("coefficient"))
    else:
        raise Refused(f"its forward does `{_one_line(text)}`, which the heads do not reproduce")


def _add_factor(fields: dict, op: str | None, factor: str | None) -> None:
    if op is None:
        return
    if fields["softcap"] is not None:
        raise Refused(f"its forward scales the logits by {factor} after soft-capping them")
    fields["factors"].append((op, factor))


def _trunk_call(statement: ast.stmt) -> ast.Call | None:
    """The call in `statement` that passes `input_ids` (the trunk computing the hidden states), if any."""
    if not isinstance(statement, ast.Assign | ast.AnnAssign) or not isinstance(statement.value, ast.Call):
        return None
    call = statement.value
    passes_ids = any(k.arg == "input_ids" for k in call.keywords) or (
        call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == "input_ids"
    )
    return call if passes_ids else None


def _trunk_attribute(call: ast.Call, optional: set[str]) -> str:
    """`self.<path>(...)` -> path (`model`, `model.decoder`); refuses a trunk that is not a submodule, or inputs the
    heads do not give it (`optional`: the forward's own parameters that default to None, passed through as None)."""
    path = ast.unparse(call.func)
    if not re.fullmatch(r"self(\.\w+)+", path):
        raise Refused(f"its trunk is `{path}`, not a submodule of the causal LM")
    passed_through = lambda k: isinstance(k.value, ast.Name) and k.value.id == k.arg and k.arg in optional  # noqa: E731
    extra = sorted(k.arg for k in call.keywords if k.arg not in TRUNK_ARGUMENTS and not passed_through(k))
    if extra:
        raise Refused(f"its trunk `{path}` takes {', '.join(extra)}, which the heads do not pass")
    return path.removeprefix("self.")


def _parameters_defaulting_to_none(function) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.default is None}


def _check_output_layer(model_class: type, name: str) -> None:
    """The module the forward projects with must be the one `get_output_embeddings` returns (the heads multiply by
    its weight): transformers' default returns `self.lm_head`, an override must return `self.<name>` itself."""
    getter = model_class.get_output_embeddings
    if getter.__qualname__.split(".")[0] in ("EmbeddingAccessMixin", "PreTrainedModel"):
        returned = "lm_head"
    else:
        statements = ast.parse(textwrap.dedent(inspect.getsource(getter))).body[0].body
        body = [s for s in statements if not _is_docstring(s)]
        returned = ast.unparse(body[0].value).removeprefix("self.") if isinstance(body[0], ast.Return) else "?"
    if returned != name:
        raise Refused(f"its forward projects with `self.{name}`, and the output layer (`get_output_embeddings`) "
                      f"is `self.{returned}`: a prediction head around it")  # fmt: skip
    built = [ast.unparse(s.value.func) for s in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(
        model_class.__init__)))) if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == f"self.{name}"
        and isinstance(s.value, ast.Call)]  # fmt: skip
    if built != ["nn.Linear"]:
        raise Refused(f"its output layer `self.{name}` is {' or '.join(built) or 'not built in its __init__'}, not "
                      f"an nn.Linear whose weight the heads multiply by")  # fmt: skip


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 240 else line[:237] + "..."


def evaluate(expression: str, lm: torch.nn.Module):
    """The value of a rule's expression (`self.config.logits_scaling`, `math.floor(math.sqrt(self.num_experts))`) on
    the built model, as the forward evaluates it."""
    return eval(expression, {"__builtins__": {}, "math": math}, {"self": lm})  # source read from transformers


def aux_loss_function(lm: torch.nn.Module, aux: AuxLoss):
    """The load-balancing function the forward calls, from the forward's own module."""
    return getattr(sys.modules[type(lm).__module__], aux.function)
