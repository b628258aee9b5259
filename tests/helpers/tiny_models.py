"""Tiny random models of any causal-LM model type in transformers (hidden 64, 2 layers, vocabulary 128), for tests
that must cover every family: one shrinking rule for the size keys families share, and the few keys of a family's
own (`FAMILY_SETTINGS`) that the rule cannot guess."""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from ntl_pretrain.heads.forward_rules import forward_rule

VOCAB = 128
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "n_inner": 128,
    "ffn_hidden_size": 128, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_attention_heads": 4,
    "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "n_positions": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "first_k_dense_replace": 1, "rotary_dim": 16, "use_cache": False, "zero_expert_num": 2,
    "expert_ffn_hidden_size": 32, "shared_experts_intermediate_size": 32, "shared_intermediate_size": 32,
    "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_d_ssm": 128, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# Keys of a family's own that the shared rule above cannot set (its per-layer plans, widths that must agree).
FAMILY_SETTINGS: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "zaya": {"num_experts_per_tok": 1},
}

# Enlarged constants (the real ones, soft-cap 30 or scale 0.1-ish, move CE too little on random logits to be seen).
ENLARGED = {"*": 4.0, "/": 0.25, "softcap": 2.0}
DERIVED = {"minicpm3": {"dim_model_base": 256}}  # its logits_scaling is hidden_size / dim_model_base = 0.25


def tiny_config(model_type: str, **settings):
    """A tiny config of `model_type`: the family's defaults, with every size key they hold shrunk."""
    defaults = CONFIG_MAPPING[model_type]().to_dict()
    sizes = {key: value for key, value in SIZES.items() if key in defaults}
    if "kv_lora_rank" in defaults:  # multi-head latent attention: a key per query head, rotary over qk_rope_head_dim
        sizes.update(head_dim=sizes["qk_rope_head_dim"], num_key_value_heads=sizes["num_attention_heads"])
    layer_types = defaults.get("layer_types")
    if isinstance(layer_types, list):  # one of each kind of layer the family mixes, first ones first
        kinds = list(dict.fromkeys(layer_types))[:2]
        sizes["layer_types"] = (kinds * 2)[:2]
    return AutoConfig.for_model(model_type, **{**sizes, **FAMILY_SETTINGS.get(model_type, {}), **settings})


def tiny_model(model_type: str, seed: int = 0, **settings) -> torch.nn.Module:
    """fp32, eval mode (no dropout), weights perturbed so that the logits are several units from zero, where a
    left-out scale or soft-cap changes the loss; padding rows stay zero, as training keeps them (no gradient
    reaches them, and some families zero them again on load)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **settings)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in lm.parameters():
            param.add_(torch.randn_like(param) * 0.5)
        for module in lm.modules():
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx] = 0
    return lm


def enlarged_settings(model_type: str) -> dict:
    """The config keys of the type's post-processing (`self.config.logits_scaling` -> logits_scaling), enlarged."""
    if model_type in DERIVED:
        return DERIVED[model_type]
    rule = forward_rule(model_type)
    steps = [(op, expression) for op, expression in rule.factors]
    steps += [("softcap", rule.softcap)] if rule.softcap else []
    return {expression.rsplit(".", 1)[-1]: ENLARGED[op] for op, expression in steps}
