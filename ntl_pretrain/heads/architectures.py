"""Which model types the heads train, and what each one's `*ForCausalLM.forward` does to `lm_head(hidden)`.

The heads run the decoder trunk and the output layer themselves, so post-processing inside the forward would
otherwise be left out of training and applied at inference. What a forward does is read by rule from the installed
transformers' source (forward_rules.py: identity, a scale, a soft-cap, the MoE balancing loss that router_aux.py
adds, or refused and why); a type is trained only when its rule accepts it and it is in `CHECKED`, the types
tests/test_architectures.py trains as tiny random models against transformers' own loss. A type not checked stays
refused (a newer transformers' forward that the rule reads differently is refused with the reason).
docs/compatibility.md lists every type (`python -m ntl_pretrain.heads.coverage`).
"""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedModel

from ntl_pretrain.heads.forward_rules import ForwardRule, evaluate, forward_rule
from ntl_pretrain.loss.logit_transform import LogitTransform

# Checked on transformers 5.25.0 by tests/test_architectures.py (dense and chunked heads; dense only in OUTPUT_BIAS).
CHECKED = frozenset("""
afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 beam biogpt bitnet bloom codegen cohere cohere2 cohere2_moe
ctrl cwm deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 diffllama doge dots1 dots3_note_text ernie4_5 ernie4_5_moe
exaone exaone4 exaone_moe falcon falcon_h1 falcon_mamba flex_olmo flint gemma gemma2 gemma3_text gemma4_text
gemma4_unified_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa gpt-sw3 gpt2 gpt_bigcode gpt_neo gpt_neox
gpt_neox_japanese gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared
helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax internlm3 iquestcoder jais2 jamba jetmoe
kolibri1 laguna lara_mini lfm2 lfm3 llama llama4_text mamba mamba2 mellum mimo_v2_flash minicpm3 minimax minimax_m2
minimax_m3_vl_text ministral ministral3 mistral mixtral mpt nanochat nemotron nemotron_h olmo olmo2 olmo3
olmo_hybrid olmoe openai-gpt opt persimmon phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_5_moe_text qwen3_5_text
qwen3_moe qwen3_next recurrent_gemma rwkv sarvam_mla sarvam_moe seed_oss smollm3 solar_open stablelm starcoder2
vaultgemma xglm youtu zaya
""".split())  # fmt: skip
# Output layers with a bias among those above: only the dense head (the model's own output layer) applies it.
OUTPUT_BIAS = frozenset({"codegen", "ctrl", "gptj", "phi"})


def checked_rule(config: PretrainedConfig) -> ForwardRule:
    """The rule of `config.model_type`; a `ValueError` saying why when the heads do not train it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_type {model_type!r} has no causal-LM class in transformers")
    rule = forward_rule(model_type)
    if rule.refused is not None:
        raise ValueError(f"{rule.class_name} (model_type {model_type!r}) is not among the architectures whose "
                         f"forward the loss heads reproduce: {rule.refused}")  # fmt: skip
    if model_type not in CHECKED:
        raise ValueError(f"{rule.class_name} (model_type {model_type!r}) is not among the architectures whose "
                         f"forward the loss heads reproduce: its forward reads as one they do "
                         f"({rule.transform_summary}), but no test has trained it against transformers' loss "
                         f"(docs/compatibility.md)")  # fmt: skip
    return rule


def logit_transform(lm: PreTrainedModel) -> LogitTransform:
    """What `lm`'s forward does to its output layer's logits, with the values of the built model."""
    rule = checked_rule(lm.config)
    scale = 1.0
    for op, expression in rule.factors:
        factor = float(evaluate(expression, lm))
        scale = scale * factor if op == "*" else scale / factor
    softcap = evaluate(rule.softcap, lm) if rule.softcap is not None else None
    return LogitTransform(scale=scale, softcap=softcap)


def trunk_path(lm: PreTrainedModel) -> str:
    """The submodule of `lm` its forward calls for the hidden states (`model`, OPT's `model.decoder`; Llama-4's text
    model calls `model` although its `base_model` is the causal LM itself)."""
    return checked_rule(lm.config).trunk


def check_recipe_architecture(recipe) -> None:
    """Before launch: refuse, naming the recipe key, an architecture whose logits the heads do not reproduce.
    Resuming without either key trains the architecture its checkpoint was started with (checked then)."""
    from transformers import AutoConfig

    from ntl_pretrain.config.recipe import RecipeError

    if recipe.init_from is not None:
        key = "init_from"
        try:
            config = AutoConfig.from_pretrained(recipe.init_from)
        except (OSError, ValueError) as error:
            raise RecipeError(f"init_from: cannot read the model config of {recipe.init_from}: {error}") from error
    elif recipe.model.model_type is not None:
        key, config = "model.model_type", AutoConfig.for_model(recipe.model.model_type, **recipe.model.config)
    else:
        return
    try:
        rule = checked_rule(config)
    except ValueError as error:
        raise RecipeError(f"{key}: {error}") from error
    if recipe.loss.router_aux_weight and rule.aux_loss is None:
        raise RecipeError(f"loss.router_aux_weight: {recipe.loss.router_aux_weight:g}, but {rule.class_name} "
                          f"({key} {config.model_type!r}) adds no router load-balancing loss in its forward; leave "
                          "the key null or 0")  # fmt: skip
    if config.model_type in OUTPUT_BIAS and (recipe.loss.head == "chunked" or recipe.loss.vocab_parallel_size > 1):
        raise RecipeError(
            f"loss.head: {rule.class_name}'s output layer has a bias, which only the dense head applies; set "
            "loss.head: dense and loss.vocab_parallel_size: 1"
        )
