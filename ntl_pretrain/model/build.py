"""Build the HF causal LM under ZeRO-3 and attach the output head that computes CE + λ·NTL from its hidden
states (`ntl_pretrain.heads`: dense, chunked, or vocabulary-parallel when `loss.vocab_parallel_size` > 1), plus, for
a mixture of experts whose forward adds one, the routers' load-balancing loss (`heads/router_aux.py`).

Shapes: B batch, T sequence, H hidden size, V model vocabulary (may exceed the tokenizer's).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.integrations import HfDeepSpeedConfig

from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.heads import HeadOutput, OutputHead, build_head
from ntl_pretrain.heads.architectures import trunk_path
from ntl_pretrain.heads.router_aux import RouterBalancing, router_balancing
from ntl_pretrain.model import WITHOUT_HUB_KERNELS, flash_attention
from ntl_pretrain.model.document_attention import transformers_takes_varlen_arguments
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.reporting.metrics import flops_per_token

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class CausalLMWithLoss(nn.Module):
    """What the DeepSpeed engine runs: decoder trunk for hidden states, then the output head, plus `balancing`'s
    router load-balancing loss for a MoE whose forward adds one. The trunk is the submodule `lm`'s own forward calls
    (`heads.architectures.trunk_path`), found by name at each call so that it is not registered twice (its
    parameters would be checkpointed under two names)."""

    def __init__(self, lm: PreTrainedModel, head: OutputHead, balancing: RouterBalancing | None = None):
        super().__init__()
        self.lm = lm
        self.head = head
        self.balancing = balancing
        self.trunk = operator.attrgetter(trunk_path(lm))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
        num_number_tokens: torch.Tensor | None = None,
        ntl_labels: torch.Tensor | None = None,
        micro_batches: float | None = None,
        **attention_kwargs,
    ) -> HeadOutput:
        """`micro_batches`: of the global batch (all ranks), which share the balancing loss alike (router_aux.py);
        None with `num_tokens` None (sums). `attention_kwargs`: flash-attention 2's document boundaries
        (`document_attention.varlen_arguments`)."""
        router_logits = {} if self.balancing is None else {"output_router_logits": True}
        lm_out = self.trunk(self.lm)(input_ids=input_ids, position_ids=position_ids, **router_logits,
                                     **attention_kwargs)  # fmt: skip
        out = self.head(lm_out.last_hidden_state, labels, num_tokens, num_number_tokens, ntl_labels)
        if self.balancing is None:
            return out
        aux_loss = self.balancing.loss(lm_out.router_logits)
        loss = out.loss
        if self.balancing.weight:
            loss = loss + self.balancing.weight * (aux_loss if micro_batches is None else aux_loss / micro_batches)
        return out._replace(loss=loss, aux_loss=aux_loss.detach())


@dataclass
class BuiltModel:
    module: CausalLMWithLoss
    number_vocab: NumberVocab | None
    hf_deepspeed_config: HfDeepSpeedConfig
    """Held for the model's lifetime: transformers consults it to load and gather under ZeRO-3."""
    attention: str
    """The attention implementation the model runs (`model.attention`, `auto` resolved)."""


def attention_backend(
    requested: str, config: PretrainedConfig, dtype: torch.dtype, per_document_attention: bool = False
) -> str:
    """`auto`: flash-attention-2 where it can run (CUDA, bf16/fp16, an architecture that supports it, for
    per-document attention a transformers that takes the varlen arguments, and the flash_attn package imports: found
    is not enough, flash_attention.py), else PyTorch SDPA, else eager for architectures without SDPA (Gemma-2 in
    transformers 5)."""
    if requested != "auto":
        return requested
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    supports = lambda feature: model_class is None or bool(getattr(model_class, feature, False))  # noqa: E731
    flash_runs = torch.cuda.is_available() and dtype in (torch.bfloat16, torch.float16)
    flash_runs = flash_runs and supports("_supports_flash_attn")
    flash_runs = flash_runs and (not per_document_attention or transformers_takes_varlen_arguments())
    if flash_runs and flash_attention.import_error() is None:
        return "flash_attention_2"
    return "sdpa" if supports("_supports_sdpa") else "eager"


def hf_config(recipe: Recipe, tokenizer, saved_config: Path | None = None) -> PretrainedConfig:
    """The architecture: `init_from`'s config, `model.model_type` with `model.config` keys on top, or (resuming
    without either) the config saved in the checkpoint."""
    model = recipe.model
    if recipe.init_from is not None or model.model_type is None:
        source = recipe.init_from or saved_config
        if source is None:
            raise ValueError("model.model_type: null, and there is neither init_from nor a checkpoint to resume")
        config = AutoConfig.from_pretrained(source)
        for key, value in model.config.items():
            setattr(config, key, value)
        return config
    settings = {"vocab_size": model.padded_vocab_size(len(tokenizer)), **_special_token_ids(tokenizer)}
    settings.update(model.config)
    return AutoConfig.for_model(model.model_type, **settings)


def _special_token_ids(tokenizer) -> dict[str, int]:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids["eos_token_id"]
    return {key: value for key, value in ids.items() if value is not None}


def number_vocabulary(recipe: Recipe, tokenizer, vocab_size: int | None = None) -> NumberVocab | None:
    """The number tokens NTL acts on; None with NTL off. A tokenizer without any is refused (`RecipeError`): NTL
    would have nothing to learn, and every step would log `ntl 0`."""
    kind = recipe.loss.ntl.kind
    if kind is None:
        return None
    vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
    if not vocab.class_info:
        source = "tokenizer.path" if recipe.tokenizer.path else "init_from" if recipe.init_from else "checkpoint"
        raise RecipeError(f"loss.ntl.kind: {kind}, but the tokenizer ({source}'s) has no number token (no token of "
                          f"ASCII digits), so NTL has nothing to learn; use a tokenizer with number tokens, or "
                          f"loss.ntl.kind: null for CE alone")  # fmt: skip
    return vocab


def build_model(
    recipe: Recipe,
    tokenizer,
    ds_config: dict,
    saved_config: Path | None = None,
) -> BuiltModel:
    """Instantiate (from scratch or `init_from`) partitioned under ZeRO-3, with HF's weight init, and its output
    head. `saved_config`: a checkpoint's `hf_config/` folder, the architecture when resuming without model_type."""
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    config = hf_config(recipe, tokenizer, saved_config)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size={config.vocab_size} < tokenizer length {len(tokenizer)}")
    number_vocab = number_vocabulary(recipe, tokenizer, config.vocab_size)  # refused before any weight loads
    dtype = DTYPES[recipe.train.precision]
    attention = attention_backend(recipe.model.attention, config, dtype, recipe.data.per_document_attention)
    kwargs = {"attn_implementation": attention, "dtype": dtype}
    if recipe.init_from is None or saved_config is not None:  # a resumed run loads its own weights
        lm = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        lm = AutoModelForCausalLM.from_pretrained(recipe.init_from, config=config, **kwargs, **WITHOUT_HUB_KERNELS)
    if recipe.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    head = build_head(recipe, lm, number_vocab)
    balancing = router_balancing(lm, recipe.loss.router_aux_weight)
    return BuiltModel(CausalLMWithLoss(lm, head, balancing), number_vocab, hf_ds_config, attention)


def parameter_groups(module: CausalLMWithLoss, weight_decay: float) -> list[dict]:
    """Decoupled weight decay on matrices only: norms, biases and embeddings are not decayed."""
    embedding_ids = {id(module.lm.get_input_embeddings().weight)}
    decay, no_decay = [], []
    for param in module.parameters():
        if not param.requires_grad:
            continue
        ndim = len(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps only a flat shard in param.shape
        (decay if ndim >= 2 and id(param) not in embedding_ids else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_parameters(module: nn.Module) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def active_parameters(lm: PreTrainedModel) -> int:
    """The parameters one token's forward multiplies by: all of a dense model's; of a mixture of experts' routed
    experts, `num_experts_per_tok` of each layer's `num_experts`. transformers keeps a layer's routed experts in one
    `*Experts` module whose parameters have the expert as their leading dimension (shared experts and routers are
    modules of their own, used by every token)."""
    total, per_token = count_parameters(lm), getattr(lm.config, "num_experts_per_tok", None)
    if not per_token:
        return total
    for module in lm.modules():
        if type(module).__name__.endswith("Experts"):
            for param in module.parameters(recurse=False):
                experts = getattr(param, "ds_shape", param.shape)[0]  # ZeRO-3 keeps the full shape there
                numel = getattr(param, "ds_numel", param.numel())
                total -= numel - numel * min(per_token, experts) // experts
    return total


def model_flops_per_token(lm: PreTrainedModel, seq_len: int, outside_parameters: int = 0) -> float:
    """Training FLOPs per token (see `ntl_pretrain.reporting.metrics`): the input embedding is a lookup, not a matmul,
    unless it is tied to the output projection; a mixture of experts counts the experts a token is routed to
    (`active_parameters`). `outside_parameters`: output parameters the head holds outside `lm`
    (`OutputHead.parameters_outside_model`)."""
    embedding, output = lm.get_input_embeddings().weight, lm.get_output_embeddings()
    tied = embedding is getattr(output, "weight", None)
    matmul_params = active_parameters(lm) - (0 if tied else getattr(embedding, "ds_numel", embedding.numel()))
    matmul_params += outside_parameters
    config = lm.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return flops_per_token(matmul_params, config.num_hidden_layers, config.num_attention_heads * head_dim, seq_len)
