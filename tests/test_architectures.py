"""Every model type the heads train (`architectures.CHECKED`), against transformers' own loss: a tiny random model
per type, its post-processing constants enlarged so that leaving a transform out would move CE by more than 10%;
the dense and chunked heads' CE equals `lm(input_ids, labels=input_ids).loss` to 1e-6, and the weights export
writes reload as they were trained. And the table of all types in docs/compatibility.md is the one the rule gives."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import VOCAB, enlarged_settings, tiny_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.export.hf_folder import model_from_state
from ntl_pretrain.heads import build_head
from ntl_pretrain.heads.architectures import CHECKED, OUTPUT_BIAS, checked_rule
from ntl_pretrain.heads.forward_rules import forward_rule, read_forward
from ntl_pretrain.loss.logit_transform import IDENTITY
from ntl_pretrain.model.build import CausalLMWithLoss

SEQ = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, the labels the trainer gives the heads (the next token; -100 where there is none) and positions."""
    input_ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return input_ids, labels, torch.arange(SEQ).expand(2, SEQ)


def head_ce(lm, head_kind: str, input_ids, labels, positions, transform=None) -> torch.Tensor:
    recipe = Recipe()
    recipe.loss.ntl.kind, recipe.loss.head, recipe.loss.chunk_size = None, head_kind, 5
    head = build_head(recipe, lm, None)
    if transform is not None:
        head.transform = transform
    num_tokens = (labels != -100).sum()
    with torch.no_grad():
        return CausalLMWithLoss(lm, head)(input_ids, labels, positions, num_tokens, num_tokens).loss


def test_every_checked_type_is_one_the_rule_accepts():
    refused = {t: forward_rule(t).refused for t in CHECKED if forward_rule(t).refused}
    assert not refused


@pytest.mark.parametrize("model_type", sorted(CHECKED))
def test_heads_give_transformers_loss_and_export_keeps_the_weights(model_type, tmp_path):
    lm = tiny_model(model_type, **enlarged_settings(model_type))
    input_ids, labels, positions = inputs = batch()
    with torch.no_grad():
        want = lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    has_bias = getattr(lm.get_output_embeddings(), "bias", None) is not None
    assert has_bias == (model_type in OUTPUT_BIAS)
    for head_kind in ("dense",) if has_bias else ("dense", "chunked"):
        got = head_ce(lm, head_kind, *inputs)
        assert abs(got - want) <= 1e-6 * want, f"{model_type} {head_kind}: {got.item()} != {want.item()}"
    if enlarged_settings(model_type):
        untransformed = head_ce(lm, "dense", *inputs, transform=IDENTITY)
        assert abs(untransformed - want) > 0.1 * want, f"{model_type}: the enlarged transform does not show"
    exported = model_from_state(lm.config, lm.state_dict(), model_type, None)
    exported.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for name, tensor in lm.state_dict().items():
        assert torch.equal(reloaded[name], tensor), f"{model_type}: {name} changed through export"


class LlamaOfTransformers517(LlamaForCausalLM):
    """LlamaForCausalLM's forward as transformers 5.17 wrote it (the GPU machine's version, 2026-11-27): it slices
    to `logits_to_keep` inside the projection instead of calling `slice_logits_to_keep`."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0,
                **kwargs):  # fmt: skip
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             cache_position=cache_position, **kwargs)  # fmt: skip
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


def test_the_older_inline_slicing_forward_reads_as_the_same_rule():
    older = read_forward("llama", "LlamaForCausalLM", LlamaOfTransformers517)
    assert older == forward_rule("llama")
    assert older.output_layer == "lm_head" and older.refused is None


def test_an_unchecked_type_is_refused_naming_why():
    with pytest.raises(ValueError, match=r"BartForCausalLM .* not among .* its forward does `if labels"):
        checked_rule(type("C", (), {"model_type": "bart"})())
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration .* a multimodal model"):
        checked_rule(type("C", (), {"model_type": "gemma3"})())


def test_the_documented_table_is_the_one_the_rule_gives():
    from ntl_pretrain.heads.coverage import documented_table, table

    assert documented_table() == table(), "regenerate it: python -m ntl_pretrain.heads.coverage --write"
