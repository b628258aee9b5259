"""Pre-flight of the model: the HF config the run will build and `init_from`'s weights, checked before launch for
what transformers or the first forward would reject on every rank (a traceback per rank, and a run folder left
behind). Each failure is one `RecipeError` naming the key (`model.config.<key>`, or `init_from` for a key that
comes from its config.json)."""

from __future__ import annotations

import json
import numbers
from pathlib import Path

from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.errors import InputError
from ntl_pretrain.preflight.config_keys import check_whole_number_keys

SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "n_embd", "n_layer", "n_head", "n_inner")  # fmt: skip
POSITION_KEYS = ("max_position_embeddings", "n_positions")  # Llama-style, GPT-2
PROBABILITY_SUFFIXES = ("dropout", "_pdrop")  # attention_dropout, hidden_dropout; GPT-2's attn_pdrop, resid_pdrop
ACTIVATION_KEYS = ("hidden_act", "activation_function", "hidden_activation")  # Llama-style, GPT-2, Gemma
HEAD_SPLITS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"))  # width, heads that share it


def check_model(recipe: Recipe, config, tokenizer) -> None:
    """`config`: the HF config pre-flight built (None when it comes from the checkpoint a resume loads)."""
    if config is None:
        return
    values = config.to_dict()
    check_sizes(recipe, values)
    check_heads(recipe, values)
    check_probabilities(recipe, values)
    check_activations(recipe, values)
    if tokenizer is not None:
        check_vocab(recipe, values, len(tokenizer))
    build_on_meta(recipe, config)
    if recipe.init_from is not None:
        check_weights(Path(recipe.init_from).expanduser(), config)


def check_given_sizes(recipe: Recipe) -> None:
    """The sizes `model.config` sets, before transformers builds a config from them: it divides by the head count
    (a ZeroDivisionError) and warns about token ids outside a negative vocabulary before any check of ours runs."""
    given = recipe.model.config
    check_whole_number_keys(recipe)
    check_sizes(recipe, given)  # `where` names every key of model.config as model.config.<key>
    for width_key, heads_key in HEAD_SPLITS:
        width, heads = given.get(width_key), given.get(heads_key)
        if isinstance(width, int) and isinstance(heads, int) and "head_dim" not in given and width % heads:
            raise RecipeError(f"model.config.{heads_key}: {heads} heads do not divide {width_key} ({width}); each "
                              f"head takes an equal share of it")  # fmt: skip


def where(recipe: Recipe, key: str) -> str:
    """The recipe key that set `key`: an override in `model.config`, else init_from's config.json."""
    if key in recipe.model.config or recipe.init_from is None:
        return f"model.config.{key}"
    return f"init_from: {Path(recipe.init_from).expanduser() / 'config.json'}: {key}"


def check_sizes(recipe: Recipe, values: dict) -> None:
    for key in SIZE_KEYS:
        value = values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise RecipeError(f"{where(recipe, key)}: must be >= 1, got {value}")


def check_heads(recipe: Recipe, values: dict) -> None:
    """Grouped-query attention shares each key/value head among a whole number of query heads."""
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise RecipeError(f"{where(recipe, 'num_key_value_heads')}: {kv_heads} does not divide num_attention_heads "
                          f"({heads}); each key/value head serves a whole number of query heads")  # fmt: skip


def check_probabilities(recipe: Recipe, values: dict) -> None:
    for key, value in values.items():
        is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if key.endswith(PROBABILITY_SUFFIXES) and is_number and not 0 <= value < 1:
            raise RecipeError(f"{where(recipe, key)}: a dropout probability must be in [0, 1), got {value}")


def check_activations(recipe: Recipe, values: dict) -> None:
    from transformers.activations import ACT2FN

    for key in ACTIVATION_KEYS:
        value = values.get(key)
        if isinstance(value, str) and value not in ACT2FN:
            raise RecipeError(f"{where(recipe, key)}: unknown activation {value!r}; transformers knows "
                              f"{', '.join(sorted(ACT2FN))}")  # fmt: skip


def check_vocab(recipe: Recipe, values: dict, tokenizer_size: int) -> None:
    """Every token id the tokenizer can produce has an embedding row."""
    vocab_size = values.get("vocab_size")
    if recipe.init_from is None and "vocab_size" not in recipe.model.config:
        vocab_size = recipe.model.padded_vocab_size(tokenizer_size)  # what model.hf_config sets from scratch
    if isinstance(vocab_size, int) and vocab_size < tokenizer_size:
        raise RecipeError(f"{where(recipe, 'vocab_size')}: {vocab_size} rows for a tokenizer of {tokenizer_size} "
                          f"tokens; raise it to at least {tokenizer_size} (or leave it out from scratch)")  # fmt: skip


def build_on_meta(recipe: Recipe, config) -> None:
    """Build the model on the meta device (no memory, no weights): the checks transformers' layers make at
    construction run here (GPT-2's `n_embd % n_head`)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as error:  # transformers and torch raise ValueError, RuntimeError, AttributeError ...
        key = "init_from" if recipe.init_from is not None else "model.config"
        raise RecipeError(f"{key}: transformers cannot build the model: {' '.join(str(error).split())}") from error


def check_weights(folder: Path, config) -> None:
    """init_from's weights load into the model `config` describes, as `from_pretrained` loads them: transformers' own
    loader on the meta device (no tensor read) applies its checkpoint conversion (one file entry per MoE expert fused
    into one tensor, GPT-NeoX's `embed_out` as `lm_head`), so a folder it loads passes and one it would not load (or
    would load with parameters left at random) is refused naming the tensor. Safetensors headers are read first, so
    that a damaged file is named; `pytorch_model.bin` folders are left to the loader at start."""
    try:
        found = safetensors_shapes(folder)
    except InputError as error:
        raise RecipeError(f"init_from: {error}") from error
    if found is None:
        return
    info = _meta_load_report(folder, config)
    if info["missing_keys"]:
        name = sorted(info["missing_keys"])[0]
        raise RecipeError(f"init_from: {folder} has no tensor {name}; the weights do not belong to the model its "
                          f"config.json and model.config describe (an untied output layer asked of tied weights: "
                          f"model.config.tie_word_embeddings)")  # fmt: skip
    for name, saved, wanted in sorted(info["mismatched_keys"]):
        raise RecipeError(f"init_from: {folder}: tensor {name} is {list(saved)}, the config makes it {list(wanted)}")


def _meta_load_report(folder: Path, config) -> dict:
    """`from_pretrained`'s loading report on the meta device; its refusal (a conversion that fails, a tensor that
    does not fit) as a RecipeError quoting it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from ntl_pretrain.model import WITHOUT_HUB_KERNELS

    verbosity, progress_bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # its load report and progress bar: the refusal below says what matters
    logging.disable_progress_bar()
    try:
        settings = {"device_map": "meta", "dtype": torch.float32, "ignore_mismatched_sizes": True}
        _, info = AutoModelForCausalLM.from_pretrained(  # hub kernels (on since transformers 5.25) refuse meta
            folder, config=config, output_loading_info=True, **settings, **WITHOUT_HUB_KERNELS
        )
    except Exception as error:  # transformers raises RuntimeError, ValueError, KeyError ... from its loader
        raise RecipeError(f"init_from: transformers cannot load {folder}: {' '.join(str(error).split())}") from error
    finally:
        logging.set_verbosity(verbosity)
        if progress_bar:
            logging.enable_progress_bar()
    return info


def safetensors_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Tensor name -> shape from the safetensors headers (no tensor is read); None without safetensors files. An
    unreadable index or file is an InputError naming it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise InputError(f"{index}: not a safetensors index ({error})") from error
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    shapes = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as weights:
                shapes.update({key: weights.get_slice(key).get_shape() for key in weights.keys()})  # noqa: SIM118
        except Exception as error:  # safetensors raises its own SafetensorError, and OSError for a missing shard
            raise InputError(f"{folder / name}: unreadable safetensors file ({error})") from error
    return shapes


def position_limits(config: dict) -> dict[str, int]:
    """The model's position limits by config key (`POSITION_KEYS`); none where rope scaling stretches them."""
    if rope_scaled(config):
        return {}
    return {key: config[key] for key in POSITION_KEYS if isinstance(config.get(key), int)}


def rope_scaled(config: dict) -> bool:
    """Rope scaling (linear, dynamic, yarn, ...) stretches the positions past the trained length: transformers < 5
    calls it `rope_scaling`, 5 calls it `rope_parameters` and always sets one (type `default` = no scaling)."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    return kind != "default"
