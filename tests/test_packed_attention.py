"""What transformers' attention does with packed rows whose position ids restart at each document (what
`data.per_document_attention: true` feeds the model), measured on CPU for sdpa and eager: a document's logits in a
packed row are compared with the same document run alone. docs/data.md states the results."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.evaluation.validation import packed_forward

FIRST, SECOND = [5, 17, 42, 8, 3], [9, 23, 61, 7, 30, 11]  # two documents; the second starts at position 0
ROWS = 2  # flash-attention-2 in transformers separates documents only in a batch of one row; sdpa/eager in any


def tiny_llama(attention: str, use_cache: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=use_cache)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float64).eval()


def packed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids_BT = torch.tensor([FIRST + SECOND] * ROWS)
    positions_BT = torch.tensor([list(range(len(FIRST))) + list(range(len(SECOND)))] * ROWS)
    return ids_BT, positions_BT


def second_document(model, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the second document's logits inside the packed rows, its logits alone)."""
    ids_BT, positions_BT = packed_rows()
    with torch.no_grad():
        packed = model(input_ids=ids_BT, position_ids=positions_BT, **kwargs).logits[:, len(FIRST) :]
        alone = model(input_ids=torch.tensor([SECOND] * ROWS)).logits
    return packed, alone


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_without_a_cache_restarting_positions_keep_attention_inside_documents(attention: str) -> None:
    """The trainer's forward: `use_cache` off (build_model sets it), no attention mask."""
    packed, alone = second_document(tiny_llama(attention, use_cache=False))
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_cache_or_an_attention_mask_lets_attention_cross_documents(attention: str) -> None:
    """With `use_cache` on (the exported config, for generation) or any 2D attention mask, transformers skips the
    packed-sequence mask: the positions still restart, but the second document attends to the first. Eval's
    `packed_forward` passes `use_cache=False` and no mask, so it computes what the trainer computed."""
    exported_like = tiny_llama(attention, use_cache=True)
    for kwargs in ({}, {"attention_mask": torch.ones(ROWS, len(FIRST) + len(SECOND), dtype=torch.long)}):
        packed, alone = second_document(exported_like, **kwargs)
        assert (packed - alone).abs().max() > 1e-3, kwargs
    _, alone = second_document(exported_like)
    with torch.no_grad():
        packed = packed_forward(exported_like, *packed_rows())[:, len(FIRST) :]
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
