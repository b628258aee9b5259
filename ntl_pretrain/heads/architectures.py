"""What each supported architecture's `*ForCausalLM.forward` does to `lm_head(hidden)` before the loss.

The heads run the decoder trunk (`lm.base_model`) and the output layer themselves, so post-processing inside the
architecture's forward would otherwise be left out of training and applied at inference. Read from the
transformers 5.23 sources: Gemma-2/3 soft-cap (`final_logit_softcapping`), Cohere multiplies by `logit_scale`,
Granite divides by `logits_scaling`; the others use the logits as they come. An architecture not listed here has
not been checked, and training it is refused rather than risking a silently different objective.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform


def _plain(config: PretrainedConfig) -> LogitTransform:
    return IDENTITY


def _softcapped(config: PretrainedConfig) -> LogitTransform:
    return LogitTransform(softcap=config.final_logit_softcapping)


def _cohere(config: PretrainedConfig) -> LogitTransform:
    return LogitTransform(scale=config.logit_scale)


def _granite(config: PretrainedConfig) -> LogitTransform:
    return LogitTransform(scale=1 / config.logits_scaling)


LOGIT_TRANSFORMS: dict[str, Callable[[PretrainedConfig], LogitTransform]] = {
    "LlamaForCausalLM": _plain,  # also SmolLM2
    "MistralForCausalLM": _plain,
    "Qwen2ForCausalLM": _plain,
    "Qwen3ForCausalLM": _plain,
    "GPT2LMHeadModel": _plain,
    "GPTNeoXForCausalLM": _plain,
    "GemmaForCausalLM": _plain,
    "Gemma2ForCausalLM": _softcapped,
    "Gemma3ForCausalLM": _softcapped,
    "CohereForCausalLM": _cohere,
    "Cohere2ForCausalLM": _cohere,
    "GraniteForCausalLM": _granite,
    "PhiForCausalLM": _plain,
    "Phi3ForCausalLM": _plain,
    "OlmoForCausalLM": _plain,
    "Olmo2ForCausalLM": _plain,
    "SmolLM3ForCausalLM": _plain,
    "StableLmForCausalLM": _plain,
    "Starcoder2ForCausalLM": _plain,
}
# Output layers with a bias among those above: only the dense head (the model's own `lm_head`) applies it.
OUTPUT_BIAS = {"PhiForCausalLM"}


def logit_transform(class_name: str, config: PretrainedConfig) -> LogitTransform:
    """The post-processing of `class_name`'s logits under `config`; refuses an architecture not checked."""
    if class_name not in LOGIT_TRANSFORMS:
        raise ValueError(
            f"{class_name} (model_type {config.model_type!r}) is not among the architectures whose forward the loss "
            f"heads reproduce: whatever its forward does to the logits (scaling, soft-capping) would be left out of "
            f"training. Supported: {', '.join(sorted(LOGIT_TRANSFORMS))}"
        )
    return LOGIT_TRANSFORMS[class_name](config)


def causal_lm_class_name(config: PretrainedConfig) -> str:
    """The class `AutoModelForCausalLM.from_config(config)` instantiates, without building it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(f"model_type {config.model_type!r} has no causal-LM class in transformers")
    return name


def check_recipe_architecture(recipe) -> None:
    """Before launch: refuse, naming the recipe key, an architecture whose logits the heads do not reproduce.
    Resuming without either key trains the architecture its checkpoint was started with (checked then)."""
    from transformers import AutoConfig

    from ntl_pretrain.config import RecipeError

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
    class_name = causal_lm_class_name(config)
    try:
        logit_transform(class_name, config)
    except ValueError as error:
        raise RecipeError(f"{key}: {error}") from error
    if class_name in OUTPUT_BIAS and (recipe.loss.head == "chunked" or recipe.loss.vocab_parallel_size > 1):
        raise RecipeError(
            f"loss.head: {class_name}'s output layer has a bias, which only the dense head applies; set "
            "loss.head: dense and loss.vocab_parallel_size: 1"
        )
