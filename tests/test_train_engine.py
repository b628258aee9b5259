"""What the trainer adds to DeepSpeed (ntl_pretrain/train/engine.py): ZeRO-3 gathers each decoder layer whole, for
every model type the heads train, and the foreach gradient norm is DeepSpeed's own norm bit for bit (stages 2 and 3,
2 ranks, clipping on), so the updates are the same."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.tiny_models import tiny_config
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads.architectures import CHECKED, trunk_path
from ntl_pretrain.train.engine import engine_config, foreach_gradient_norm, layer_classes, qualified_name

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
    assert engine_config(ZERO3, recipe, lm) == ZERO3
    recipe.deepspeed.gather = "layer"
    stage2 = {"zero_optimization": {"stage": 2}}
    assert engine_config(stage2, recipe, lm) == stage2


def train_twice(stage: int) -> None:
    """Two engines from the same weights and batches, one with DeepSpeed's per-parameter norm and one with ours:
    the same norm and the same weights after three clipped steps."""
    import deepspeed
    from deepspeed.utils import z3_leaf_module
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05, "zero_allow_untested_optimizer": True,
              "zero_optimization": {**ZERO3["zero_optimization"], "stage": stage}}  # fmt: skip
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96)  # fmt: skip
    results = []
    for ours in (False, True):
        keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 (ZeRO-3 builds the model partitioned while it lives)
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(llama, dtype=torch.float32)
        engine_settings = engine_config(config, Recipe(), lm)
        engine, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.AdamW(lm.parameters(), lr=1e-2),
                                          config=engine_settings)  # fmt: skip
        if ours:
            foreach_gradient_norm(engine.optimizer)
            assert "get_grad_norm_direct" in vars(engine.optimizer)  # installed, not passed over
        if stage == 3:
            assert all(z3_leaf_module(layer) for layer in lm.model.layers)
        norms = []
        for step in range(3):
            ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            norms.append(engine.get_global_grad_norm())
        with deepspeed.zero.GatheredParameters(list(lm.parameters()), enabled=stage == 3):
            results.append((norms, [param.detach().clone() for param in lm.parameters()]))
    (theirs_norms, theirs_weights), (our_norms, our_weights) = results
    assert [float(n) for n in our_norms] == [float(n) for n in theirs_norms]
    assert min(float(n) for n in our_norms) > config["gradient_clipping"]  # every step clipped by the norm
    assert all(torch.equal(a, b) for a, b in zip(our_weights, theirs_weights, strict=True))


def check_both_stages() -> None:
    for stage in (2, 3):
        train_twice(stage)


@pytest.mark.slow
def test_foreach_gradient_norm_is_deepspeeds_norm_bit_for_bit():
    run_distributed(check_both_stages, 2, timeout_s=300)
