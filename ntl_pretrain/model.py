"""Build the HF causal LM under ZeRO-3 and attach the CE + λ·NTL loss head: the dense output layer inside the
engine, or (`loss.vocab_parallel_size` > 1) this rank's vocabulary slice of it, kept outside ZeRO-3.

Shapes: B batch, T sequence, H hidden size, V model vocabulary (may exceed the tokenizer's).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations import HfDeepSpeedConfig

from ntl_pretrain.config import ModelConfig, NtlConfig, Recipe
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.vocab_parallel_head import VocabParallelHead
from ntl_pretrain.metrics import flops_per_token
from ntl_pretrain.numbers import NumberVocab

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class HeadOutput(NamedTuple):
    """One micro-batch. A NamedTuple because ZeRO-3 hooks autograd only into tuples, lists and dicts of tensors
    that a module returns (a dataclass output breaks its backward bookkeeping).

    loss: differentiable; this rank's share `ΣCE/num_tokens + λ·ΣNTL/num_number_tokens` of the global-batch loss
    when the head was given the global counts, else `ΣCE + λ·ΣNTL`. ce, ntl: sums over this rank's positions (for
    logging); num_tokens, num_number_tokens: this rank's counts; number_ce: summed CE at the number labels (for
    validation)."""

    loss: torch.Tensor
    ce: torch.Tensor
    ntl: torch.Tensor
    num_tokens: torch.Tensor
    num_number_tokens: torch.Tensor
    number_ce: torch.Tensor


class DenseLossHead(nn.Module):
    """Output projection plus fused CE + NTL; returns sums (the step normalises over the global batch).

    The projection is the model's own `lm_head` module, called as a submodule so ZeRO-3 gathers its weight.
    Swappable: any module with this forward signature (e.g. a chunked or vocab-parallel head) plugs in.
    """

    def __init__(self, projection: nn.Module, number_vocab: NumberVocab | None, ntl: NtlConfig):
        super().__init__()
        self.projection = projection
        self.number_vocab = number_vocab
        self.ntl = ntl

    def forward(
        self,
        hidden_BTH: torch.Tensor,
        labels_BT: torch.Tensor,
        num_tokens: float | None = None,
        num_number_tokens: float | None = None,
    ) -> HeadOutput:
        """The signature `VocabParallelHead` has: the global batch's counts normalise `loss`, or None for sums."""
        logits_BTV = self.projection(hidden_BTH)
        out = ce_ntl_loss(
            logits_BTV,
            labels_BT,
            self.number_vocab,
            kind=self.ntl.kind,
            weight=self.ntl.weight,
            reweigh=self.ntl.reweigh,
            reduction="sum",
        )
        if num_tokens is None:
            loss = out.ce + self.ntl.weight * out.ntl
        else:
            loss = out.ce / num_tokens + self.ntl.weight * out.ntl / num_number_tokens
        return HeadOutput(loss, out.ce, out.ntl, out.num_tokens, out.num_number_tokens, out.number_ce)


class CausalLMWithLoss(nn.Module):
    """What the DeepSpeed engine runs: decoder trunk for hidden states, then the loss head."""

    def __init__(self, lm: PreTrainedModel, head: nn.Module):
        super().__init__()
        self.lm = lm
        if isinstance(head, VocabParallelHead):
            _hold_outside_zero(self, "head", head)
        else:
            self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        num_tokens: float | None = None,
        num_number_tokens: float | None = None,
    ) -> HeadOutput:
        hidden_BTH = self.lm.base_model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        out = self.head(hidden_BTH, labels, num_tokens, num_number_tokens)
        return HeadOutput(out.loss, out.ce, out.ntl, out.num_tokens, out.num_number_tokens, out.number_ce)


class VocabParallelOutputLayer(nn.Module):
    """Stands in for the LM's output layer when the matrix is sharded by vocabulary, so that the HF model still
    generates (the trainer's generation metrics): each call reassembles the [V, H] matrix from the group's slices
    (a collective; ZeRO-3 gathers a dense output layer on every call too). Training never calls it."""

    def __init__(self, head: VocabParallelHead):
        super().__init__()
        _hold_outside_zero(self, "head", head)

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden_BTH, self.head.full_weight().to(hidden_BTH.dtype))


def _hold_outside_zero(owner: nn.Module, name: str, head: VocabParallelHead) -> None:
    """Reference the head without registering it as a submodule: ZeRO-3 converts every parameter of the module it
    wraps into one partitioned tensor replicated across ranks, while each rank's slice is different and is
    optimised outside the engine."""
    object.__setattr__(owner, name, head)


@dataclass
class BuiltModel:
    module: CausalLMWithLoss
    number_vocab: NumberVocab | None
    hf_deepspeed_config: HfDeepSpeedConfig
    """Held for the model's lifetime: transformers consults it to load and gather under ZeRO-3."""
    vocab_parallel_head: VocabParallelHead | None = None
    """This rank's slice of the output layer (`loss.vocab_parallel_size` > 1), outside the module DeepSpeed wraps."""


def attention_backend(requested: str) -> str:
    """`auto` means flash-attention-2 when it is installed and CUDA is present, else PyTorch SDPA."""
    if requested != "auto":
        return requested
    flash = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
    return "flash_attention_2" if flash else "sdpa"


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
    settings = {"vocab_size": padded_vocab_size(len(tokenizer), model), **_special_token_ids(tokenizer)}
    settings.update(model.config)
    return AutoConfig.for_model(model.model_type, **settings)


def padded_vocab_size(tokenizer_size: int, model: ModelConfig) -> int:
    multiple = model.pad_vocab_to_multiple_of
    return -(-tokenizer_size // multiple) * multiple


def _special_token_ids(tokenizer) -> dict[str, int]:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids["eos_token_id"]
    return {key: value for key, value in ids.items() if value is not None}


def build_model(
    recipe: Recipe,
    tokenizer,
    ds_config: dict,
    saved_config: Path | None = None,
    vocab_group: dist.ProcessGroup | None = None,
) -> BuiltModel:
    """Instantiate (from scratch or `init_from`) partitioned under ZeRO-3, with HF's weight init.
    `saved_config`: a checkpoint's `hf_config/` folder, the architecture when resuming without model_type.
    `vocab_group`: this rank's vocabulary-parallel group (`loss.vocab_parallel_size` > 1), else None."""
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    config = hf_config(recipe, tokenizer, saved_config)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size={config.vocab_size} < tokenizer length {len(tokenizer)}")
    kwargs = {"attn_implementation": attention_backend(recipe.model.attention), "dtype": DTYPES[recipe.train.precision]}
    if recipe.init_from is None:
        lm = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        lm = AutoModelForCausalLM.from_pretrained(recipe.init_from, config=config, **kwargs)
    if recipe.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    number_vocab = None
    if recipe.loss.ntl.kind is not None:
        number_vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=config.vocab_size)
        number_vocab.require_numbers()
    if vocab_group is None:
        head = DenseLossHead(lm.get_output_embeddings(), number_vocab, recipe.loss.ntl)
        return BuiltModel(CausalLMWithLoss(lm, head), number_vocab, hf_ds_config)
    head = vocab_parallel_head(lm, vocab_group, number_vocab, recipe.loss.ntl)
    return BuiltModel(CausalLMWithLoss(lm, head), number_vocab, hf_ds_config, head)


def vocab_parallel_head(
    lm: PreTrainedModel, group: dist.ProcessGroup, number_vocab: NumberVocab | None, ntl: NtlConfig
) -> VocabParallelHead:
    """This rank's rows of `lm`'s output layer (refused, with the reason, when it is tied to the input embedding),
    in fp32: the slice is its own optimizer's master copy. `lm`'s output layer becomes a parameterless stand-in."""
    head = VocabParallelHead.from_output_layer(
        lm, group, number_vocab=number_vocab, kind=ntl.kind, ntl_weight=ntl.weight, reweigh=ntl.reweigh
    ).float()
    lm.set_output_embeddings(VocabParallelOutputLayer(head))
    return head


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


def model_flops_per_token(lm: PreTrainedModel, seq_len: int) -> float:
    """Training FLOPs per token (see `ntl_pretrain.metrics`): the input embedding is a lookup, not a matmul,
    unless it is tied to the output projection."""
    embedding, output = lm.get_input_embeddings().weight, lm.get_output_embeddings()
    tied = embedding is getattr(output, "weight", None)
    matmul_params = count_parameters(lm) - (0 if tied else getattr(embedding, "ds_numel", embedding.numel()))
    if isinstance(output, VocabParallelOutputLayer):  # the sharded matrix is no parameter of `lm`
        matmul_params += output.head.vocab_size * output.head.weight.shape[1]
    config = lm.config
    return flops_per_token(matmul_params, config.num_hidden_layers, config.hidden_size, seq_len)
