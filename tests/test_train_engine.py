"""What the trainer adds to the DeepSpeed config (ntl_pretrain/train/engine.py): ZeRO-3 gathers each decoder layer
whole, for every model type the heads train, and prefetches a whole layer where the JSON leaves the size to it. What
it replaces inside DeepSpeed's optimizers is tests/test_zero_optimizer.py's."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.launches import TINY
from helpers.tiny_models import tiny_config
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.config.deepspeed import build_deepspeed_config
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads.architectures import CHECKED, trunk_path
from ntl_pretrain.train.engine import engine_config, layer_classes, qualified_name

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


@pytest.mark.parametrize("model_type", sorted(CHECKED))
def test_every_decoder_layer_is_gathered_whole(model_type):
    """Every parameter of the trunk's layer stack lies in a module of a layer class: one fetch per layer."""
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(tiny_config(model_type))
    classes = set(layer_classes(lm))
    leaves = [module for module in lm.modules() if qualified_name(type(module)) in classes]
    trunk = lm.get_submodule(trunk_path(lm))
    stack = max((module for module in trunk.modules() if isinstance(module, torch.nn.ModuleList)), key=len)
    gathered = {id(param) for leaf in leaves for param in leaf.parameters()}
    assert leaves and {id(param) for param in stack.parameters()} <= gathered, (model_type, classes)


def test_layer_classes_join_the_leaf_modules_only_under_zero3_layer_gathering():
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(tiny_config("llama"))
    recipe, layer = Recipe(), "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    config = engine_config(ZERO3, recipe, lm)
    classes = config["zero_optimization"]["leaf_module"]["classes"]
    assert layer in classes and "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock" in classes
    assert "leaf_module" not in ZERO3["zero_optimization"]  # the recipe's dict is not changed
    own = copy.deepcopy(ZERO3)
    own["zero_optimization"]["leaf_module"] = {"classes": "MyBlock"}
    assert engine_config(own, recipe, lm)["zero_optimization"]["leaf_module"]["classes"] == ["MyBlock", layer]
    recipe.deepspeed.gather = "module"
    assert "leaf_module" not in engine_config(ZERO3, recipe, lm)["zero_optimization"]
    recipe.deepspeed.gather = "layer"
    stage2 = {"zero_optimization": {"stage": 2}}
    assert engine_config(stage2, recipe, lm) == stage2


def test_zero3_prefetches_a_whole_decoder_layer_unless_the_json_sets_the_size(tmp_path):
    """Llama-3-8B's layer: attention 2·4096² + 2·4096·1024, MLP 3·4096·14336, two norms of 4096 (218.1M, above
    DeepSpeed's default 5e7); a small model keeps the default; a JSON's own value, and only "auto", is left alone."""
    llama_8b_layer = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                                 num_key_value_heads=8, vocab_size=128)  # fmt: skip
    with torch.device("meta"):
        big, small = (AutoModelForCausalLM.from_config(config) for config in (llama_8b_layer, tiny_config("llama")))
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    zero = engine_config(ZERO3, Recipe(), big)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == layer
    assert engine_config(ZERO3, Recipe(), small)["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    own = {"zero_optimization": {**ZERO3["zero_optimization"], "stage3_prefetch_bucket_size": 1234}}
    assert engine_config(own, Recipe(), big)["zero_optimization"]["stage3_prefetch_bucket_size"] == 1234
    shipped = build_deepspeed_config(load_recipe(TINY), 1)["zero_optimization"]  # zero3.json says "auto"
    assert "stage3_prefetch_bucket_size" not in shipped and "stage3_param_persistence_threshold" not in shipped
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234}}))
    chosen = build_deepspeed_config(load_recipe(TINY, [f"deepspeed.config={path}"]), 1)["zero_optimization"]
    assert chosen["stage3_prefetch_bucket_size"] == 1234
