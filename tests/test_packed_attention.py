"""What transformers' attention does with packed rows whose position ids restart at each document (what
`data.per_document_attention: true` feeds the model), measured on CPU for sdpa and eager: a document's logits in a
packed row are compared with the same document run alone. docs/data.md states the results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.launches import TINY
from transformers import AutoModelForCausalLM, LlamaConfig

from ntl_pretrain.data.packing import make_batch
from ntl_pretrain.evaluation.validation import packed_forward
from ntl_pretrain.model.build import CausalLMWithLoss
from ntl_pretrain.model.document_attention import varlen_arguments

FIRST, SECOND = [5, 17, 42, 8, 3], [9, 23, 61, 7, 30, 11]  # two documents; the second starts at position 0
ROWS = 2  # flash-attention-2 in transformers separates documents only in a batch of one row; sdpa/eager in any
# How close "the same" is: transformers' eager attention takes its softmax in float32 whatever the model's dtype, so
# eager is exact to float32 (a float64 matmul path that differs in the last bit can flip a float32 rounding: seen
# 1.3e-8 here), sdpa to float64. Crossing documents moves the logits by more than 1e-3.
TOLERANCE = {"sdpa": 1e-12, "eager": 1e-6}


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
    torch.testing.assert_close(packed, alone, rtol=TOLERANCE[attention], atol=TOLERANCE[attention])


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
    torch.testing.assert_close(packed, alone, rtol=TOLERANCE[attention], atol=TOLERANCE[attention])


# ---- flash-attention 2: the varlen arguments (document_attention.py) -------------------------------------------


def test_varlen_arguments_mark_every_document_and_row_start():
    """Rows of 8 tokens (EOS = 0) as the packer makes them with per-document attention; documents (by hand): row 0
    [0, 3) [3, 8); row 1 [8, 10) [10, 13) [13, 16) (the row starts inside a document)."""
    blocks_BT1 = np.array([[5, 6, 0, 7, 8, 9, 4, 4, 3], [2, 0, 5, 0, 0, 1, 1, 1, 1]])
    batch = make_batch(blocks_BT1, eos_id=0, per_document_attention=True)
    expected = torch.tensor([0, 3, 8, 10, 12, 13, 16], dtype=torch.int32)  # an EOS right after an EOS: [12, 13)
    found = varlen_arguments(batch["position_ids"])
    assert set(found) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert found[key].dtype == torch.int32 and torch.equal(found[key], expected)
    assert found["max_length_q"] == found["max_length_k"] == 5 and type(found["max_length_q"]) is int


def flash_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           **_):  # fmt: skip
    """flash_attn_varlen_func's contract in torch: q/k/v [N, heads, D] hold the documents back to back; causal
    attention inside each [cu[i], cu[i+1])."""
    assert type(max_seqlen_q) is int and type(max_seqlen_k) is int  # flash-attn takes them as Python ints
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        piece = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*piece, is_causal=causal, scale=softmax_scale,
                                                        enable_gqa=True).transpose(0, 1)  # fmt: skip
    return out


def flash_reference(q, k, v, causal, softmax_scale, **_):
    """flash_attn_func's contract: q/k/v [B, T, heads, D], causal attention over each row."""
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal,
                                         scale=softmax_scale, enable_gqa=True)  # fmt: skip
    return out.transpose(1, 2)


def flash_keyword_arguments(is_causal, softmax_scale, max_seqlen_q=None, max_seqlen_k=None, **_):
    seqlens = {} if max_seqlen_q is None else {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    return {"causal": is_causal, "softmax_scale": softmax_scale, **seqlens}


@pytest.fixture
def flash_attention_in_torch(monkeypatch):
    """transformers' own flash-attention-2 path (mask, batch-size rule, varlen routing), its CUDA kernels replaced
    by the torch functions above, so that it runs on CPU."""
    from transformers import modeling_flash_attention_utils

    kernels = ((flash_reference, flash_varlen_reference, None, None, None), (flash_keyword_arguments, dict))
    monkeypatch.setattr(modeling_flash_attention_utils, "lazy_import_flash_attention", lambda *a, **k: kernels)

    def flash_llama():
        model = tiny_llama("sdpa", use_cache=False)
        model.config._attn_implementation = "flash_attention_2"
        return model

    return flash_llama


def test_flash_attention_with_two_rows_crosses_documents_unless_given_the_varlen_arguments(flash_attention_in_torch):
    model = flash_attention_in_torch()
    packed, alone = second_document(model)
    assert (packed - alone).abs().max() > 1e-3  # transformers alone: plain causal attention over each row
    packed, alone = second_document(model, **varlen_arguments(packed_rows()[1]))
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)


def test_the_trainers_module_hands_the_varlen_arguments_to_the_trunk(flash_attention_in_torch):
    """CausalLMWithLoss passes them on: the head sees the second document's hidden states as computed alone."""
    model = flash_attention_in_torch()
    seen = CausalLMWithLoss(model, HiddenStates())
    ids_BT, positions_BT = packed_rows()
    with torch.no_grad():
        packed = seen(ids_BT, ids_BT, positions_BT, **varlen_arguments(positions_BT))[:, len(FIRST) :]
        alone = model.base_model(input_ids=torch.tensor([SECOND] * ROWS)).last_hidden_state
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)


class HiddenStates(torch.nn.Module):
    def forward(self, hidden_BTH, labels_BT, num_tokens=None, num_number_tokens=None, ntl_labels_BT=None):
        return hidden_BTH


def test_per_document_flash_attention_is_refused_where_transformers_drops_the_varlen_arguments(monkeypatch):
    from transformers import modeling_flash_attention_utils

    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.config.recipe import RecipeError
    from ntl_pretrain.model import document_attention, flash_attention
    from ntl_pretrain.preflight import world as preflight

    assert document_attention.transformers_takes_varlen_arguments()  # the installed version does
    recipe = load_recipe(TINY, ["model.attention=flash_attention_2", "data.per_document_attention=true"])
    unseparated = load_recipe(TINY, ["model.attention=flash_attention_2"])
    # flash-attn installed and importing (the import check itself: tests/test_flash_attention_guard.py)
    monkeypatch.setattr(flash_attention, "installed", lambda: True)
    monkeypatch.setattr(flash_attention, "import_error_in_child", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preflight.check_attention(recipe)

    def older(query_states, key_states, value_states, attention_mask, query_length, is_causal=True, **kwargs):
        """transformers before the varlen arguments: they would land in **kwargs and be ignored."""

    monkeypatch.setattr(modeling_flash_attention_utils, "_flash_attention_forward", older)
    with pytest.raises(RecipeError, match="data.per_document_attention: flash_attention_2 keeps attention inside"):
        preflight.check_attention(recipe)
    preflight.check_attention(unseparated)  # documents not kept apart: nothing to refuse
