"""Output heads: the output layer plus CE + λ·NTL, from the decoder's hidden states to a `HeadOutput`.

One interface (`OutputHead`, base.py), chosen once from the recipe by `build_head`:
- `dense` (dense.py): the model's `lm_head` materialises the logits, inside the ZeRO-3 engine;
- `chunked` (chunked.py, the default): a chunk of positions at a time, the logits never whole, inside the engine;
- vocabulary-parallel (`loss.vocab_parallel_size` > 1, vocab_parallel.py): each rank of a group holds rows of the
  output layer outside ZeRO-3, computed chunked (or in one chunk with `dense`).
Every head applies what the architecture's forward does to the logits (architectures.py). What is asked of a
checkpoint offline (a resume's check, export's output matrix) is asked of every head kind: each knows its own files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads.architectures import logit_transform
from ntl_pretrain.heads.base import HeadOutput, OutputHead
from ntl_pretrain.heads.chunked import ChunkedHead
from ntl_pretrain.heads.dense import DenseHead
from ntl_pretrain.numbers import NumberVocab

__all__ = ["ChunkedHead", "DenseHead", "HeadOutput", "OutputHead", "build_head", "check_resume",
           "saved_output_matrix"]  # fmt: skip


def head_kinds() -> tuple[type[OutputHead], ...]:
    from ntl_pretrain.heads.vocab_parallel import VocabParallelOutputHead

    return DenseHead, ChunkedHead, VocabParallelOutputHead


def check_resume(step_folder: Path | None, recipe: Recipe, world_size: int) -> None:
    """Every head kind refuses, naming the key, a checkpoint whose head state the recipe's head cannot continue."""
    for kind in head_kinds():
        kind.check_resume(step_folder, recipe, world_size)


def saved_output_matrix(step_folder: Path) -> torch.Tensor | None:
    """The output matrix a head saved outside the engine's shards (None: it is in the shards)."""
    return next((m for kind in head_kinds() if (m := kind.saved_output_matrix(step_folder)) is not None), None)


def build_head(recipe: Recipe, lm: PreTrainedModel, number_vocab: NumberVocab | None) -> OutputHead:
    """The recipe's head for `lm` (collective when vocabulary-parallel: every rank calls it)."""
    loss = recipe.loss
    transform = logit_transform(lm)
    if loss.vocab_parallel_size > 1:
        from ntl_pretrain.heads.vocab_parallel import VocabParallelOutputHead

        return VocabParallelOutputHead.from_model(lm, number_vocab, recipe, transform)
    if loss.head == "dense":
        return DenseHead(lm.get_output_embeddings(), number_vocab, loss.ntl, transform, loss.backend)
    return ChunkedHead(lm.get_output_embeddings(), number_vocab, loss.ntl, transform, loss.chunk_size, loss.backend)
