"""`apply_ntl` on a transformers causal LM, family by family (identity, scale, divide and soft-cap transforms; tied
and untied output layers; Llama's, OPT's and GPT-2's trunks; a MoE with its balancing loss): with λ·NTL off the
patched forward gives transformers' own loss and gradients; with NTL on its terms equal `ce_ntl_loss` in float64 on
transformers' own logits; completion-only labels (-100) and padding count nowhere; without labels the logits are
transformers'; in one's own loop, micro-batches given the step's counts add up to one call over them all, and so do
two processes under FSDP2 (`fully_shard`, the output layer sharded between them); undone,
the model is transformers' again bit for bit; models and arguments it cannot serve are refused, naming why."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.tiny_models import enlarged_settings, tiny_model
from transformers import AutoTokenizer

from ntl_pretrain.heads.forward_rules import forward_rule
from ntl_pretrain.integrations import apply_ntl
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.package_files import resolve_path

TOKENIZER = AutoTokenizer.from_pretrained(resolve_path("pkg:ntl_pretrain/corpus/tiny-tokenizer"))
NV = NumberVocab.from_tokenizer(TOKENIZER)
FAMILIES = ["llama", "gemma2", "cohere", "granite", "opt", "gpt2", "mixtral"]
LAMBDA = 0.3

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def family_model(model_type: str):
    """A tiny model of the family at the tiny tokenizer's vocabulary, its logit transform enlarged so that leaving
    it out would show, a MoE asked for its router logits (so that its forward adds the balancing loss); in eval
    mode, so that dropout (OPT's, GPT-2's) draws nothing."""
    settings = {**enlarged_settings(model_type), "vocab_size": len(TOKENIZER)}
    if forward_rule(model_type).aux_loss is not None:
        settings["output_router_logits"] = True
    return tiny_model(model_type, **settings)


def batch() -> dict[str, torch.Tensor]:
    """Two rows of arithmetic, the second padded; labels on the answers only (-100 on prompts and padding)."""
    rows = [("12 + 345 = ", "357"), ("7 * 8 = ", "56")]
    prompts, answers = [TOKENIZER(p).input_ids for p, _ in rows], [TOKENIZER(a).input_ids for _, a in rows]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    ids, mask, labels = [], [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        pad = width - len(prompt) - len(answer)
        ids.append(prompt + answer + [TOKENIZER.eos_token_id] * pad)
        mask.append([1] * (width - pad) + [0] * pad)
        labels.append([-100] * len(prompt) + answer + [-100] * pad)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


def loss_and_gradients(lm, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm.zero_grad()
    out = lm(**inputs)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_with_ntl_off_the_loss_and_gradients_are_transformers(model_type):
    lm, inputs = family_model(model_type), batch()
    want_loss, want_grads = loss_and_gradients(lm, inputs)
    apply_ntl(lm, TOKENIZER, kind="was", ntl_weight=0.0)
    got_loss, got_grads = loss_and_gradients(lm, inputs)
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    assert got_grads.keys() == want_grads.keys()
    # float32 sums in another order: up to 2e-6 of the largest gradient element (measured; OPT's key biases, whose
    # gradient is 0 but for rounding, are all rounding)
    largest = max(grad.abs().max().item() for grad in want_grads.values())
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, rtol=0, atol=1e-5 * largest, msg=name)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_with_ntl_on_the_terms_equal_the_float64_loss_on_transformers_logits(model_type):
    lm, inputs = family_model(model_type), batch()
    with torch.no_grad():  # transformers' own forward (float32: a MoE's grouped matmul takes no float64)
        logits = lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.double()
    want = ce_ntl_loss(logits[:, :-1], inputs["labels"][:, 1:], NV, kind="was", ntl_weight=LAMBDA)
    apply_ntl(lm, TOKENIZER, kind="was", ntl_weight=LAMBDA)
    out = lm(**inputs)
    assert out.logits is None and out.num_number_tokens == 5 == want.num_number_tokens  # 3 + 2 answer digits
    assert out.ce.item() == pytest.approx(want.ce.item(), rel=1e-6)
    assert out.ntl.item() == pytest.approx(want.ntl.item(), rel=1e-6) and want.ntl > 0.1
    aux = 0.0 if getattr(out, "aux_loss", None) is None else lm.config.router_aux_loss_coef * out.aux_loss
    assert out.loss.item() == pytest.approx((out.ce + LAMBDA * out.ntl + aux).item(), rel=1e-6)


def test_without_labels_the_logits_are_transformers_and_the_output_layer_forms_none_with_labels():
    lm, inputs = family_model("llama"), batch()
    want = lm(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    apply_ntl(lm, TOKENIZER)
    calls = []
    lm.lm_head.register_forward_hook(lambda *_: calls.append(1))
    got = lm(inputs["input_ids"], inputs["attention_mask"]).logits  # positional, as transformers' signature allows
    assert torch.equal(got, want) and calls == [1]
    lm(**inputs)
    assert calls == [1]


def test_shift_labels_are_taken_as_they_are_as_transformers_takes_them():
    lm, inputs = family_model("llama"), batch()
    shifted = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    want = lm(**inputs, shift_labels=shifted).loss
    apply_ntl(lm, TOKENIZER, kind="was", ntl_weight=0.0)
    assert lm(**inputs, shift_labels=shifted).loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert lm(**inputs, shift_labels=shifted.roll(1, dims=1)).loss.item() != pytest.approx(want.item(), rel=1e-3)


def label_counts(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The label tokens and the number labels of `inputs` (shifted, as the loss reads them), counted here."""
    shifted = inputs["labels"][:, 1:]
    return (shifted != -100).sum(), ((shifted != -100) & (NV.classes[shifted.clamp_min(0)] >= 0)).sum()


def test_in_your_own_loop_micro_batches_given_the_step_counts_equal_one_call():
    lm, inputs = family_model("llama"), batch()
    apply_ntl(lm, TOKENIZER, kind="was", ntl_weight=LAMBDA)
    want_loss, want_grads = loss_and_gradients(lm, inputs)
    num_tokens, num_numbers = label_counts(inputs)
    lm.zero_grad()
    total = 0.0
    for row in (slice(0, 1), slice(1, 2)):  # rows with 3 and 2 number labels: their own means would differ
        micro = {key: value[row] for key, value in inputs.items()}
        out = lm(**micro, num_items_in_batch=num_tokens, num_number_tokens=num_numbers)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(want_loss.item(), rel=1e-6)
    for name, param in lm.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="num_number_tokens= beside num_items_in_batch"):
        lm(**inputs, num_items_in_batch=num_tokens)


def fully_sharded(lm, output_layer_apart: bool):
    """`lm` under FSDP2 as accelerate's `fsdp_version: 2` shards it: each decoder layer a unit of its own, the root
    (embeddings, final norm, output layer) another; `output_layer_apart`: the output layer also a unit of its own (a
    size-based wrap policy makes it one), whose hooks never run, since the patched forward does not call it."""
    from torch.distributed.fsdp import fully_shard

    for module in lm.modules():
        if type(module).__name__ in lm._no_split_modules:
            fully_shard(module)
    if output_layer_apart:
        fully_shard(lm.get_output_embeddings())
    return fully_shard(lm)


def rows_under_fsdp2_on_this_rank(models: dict, results: dict) -> None:
    """Each of two processes: the patched model under FSDP2, its own row of `batch()` given both rows' counts (its
    loss times 2: FSDP2 averages gradients over processes, as Trainer scales for `average_tokens_across_devices`);
    rank 0 keeps the loss summed over processes and every parameter's whole gradient."""
    rank, inputs = torch.distributed.get_rank(), batch()
    num_tokens, num_numbers = label_counts(inputs)
    for (model_type, apart), lm in models.items():
        apply_ntl(lm, TOKENIZER, kind="was", ntl_weight=LAMBDA)
        sharded = fully_sharded(lm, apart)
        row = {key: value[rank : rank + 1] for key, value in inputs.items()}
        loss = sharded(**row, num_items_in_batch=num_tokens, num_number_tokens=num_numbers).loss
        (loss * 2).backward()
        torch.distributed.all_reduce(summed := loss.detach().clone())
        grads = {name: param.grad.full_tensor() for name, param in sharded.named_parameters()}
        if rank == 0:
            results[model_type, apart] = (summed, grads, type(lm.lm_head.weight).__name__)


@pytest.mark.slow
def test_under_fsdp2_two_processes_rows_equal_one_call_over_both():
    """The output layer's weight, sharded over two processes (a DTensor between forwards), is whole inside the
    patched forward and gets its gradient: untied (llama) and tied (gpt2), in the root's unit or in its own."""
    cases = [("llama", False), ("gpt2", False), ("llama", True)]
    models = {case: family_model(case[0]) for case in cases}
    wants = {}
    for model_type in ("llama", "gpt2"):
        patched = family_model(model_type)  # the same seed: the same weights
        apply_ntl(patched, TOKENIZER, kind="was", ntl_weight=LAMBDA)
        wants[model_type] = loss_and_gradients(patched, batch())
    results = torch.multiprocessing.Manager().dict()
    run_distributed(rows_under_fsdp2_on_this_rank, 2, models, results, timeout_s=300)
    for case in cases:
        want_loss, want_grads = wants[case[0]]
        loss, grads, weight_class = results[case]
        assert weight_class == "DTensor", case  # sharded outside the forward
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6), case
        assert grads.keys() == want_grads.keys()
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")


def test_undone_the_model_is_transformers_bit_for_bit():
    lm, inputs = family_model("gemma2"), batch()
    want_loss, want_grads = loss_and_gradients(lm, inputs)
    want_logits = lm(**inputs).logits
    patch = apply_ntl(lm, TOKENIZER)
    assert lm(**inputs).loss != want_loss
    patch.undo()
    assert "forward" not in vars(lm)
    got_loss, got_grads = loss_and_gradients(lm, inputs)
    assert torch.equal(got_loss, want_loss) and torch.equal(lm(**inputs).logits, want_logits)
    assert all(torch.equal(got_grads[name], grad) for name, grad in want_grads.items())
    with pytest.raises(RuntimeError, match="undone already"):
        patch.undo()


@pytest.mark.parametrize(
    ("model_type", "arguments", "message"),
    [
        ("gptj", {}, "output layer has a bias"),
        ("bart", {}, "not among the architectures"),
        ("llama", {"kind": "l2"}, r"kind must be one of .*, or None for CE alone, got 'l2' \(a str\)"),
        ("llama", {"ntl_weight": -1.0}, r"ntl_weight must be a finite number >= 0 \(0 trains on CE alone\), got -1.0$"),
        ("llama", {"ntl_weight": math.inf}, r"ntl_weight must be a finite number >= 0 .*, got inf$"),
        ("llama", {"ntl_weight": math.nan}, r"ntl_weight must be a finite number >= 0 .*, got nan$"),
        ("llama", {"ntl_weight": "0.3"}, r"ntl_weight must be a finite number >= 0 .*, got '0.3' \(a str\)$"),
        ("llama", {"ntl_weight": True}, r"ntl_weight must be a finite number >= 0 .*, got True \(a bool\)$"),
        ("llama", {"reweigh": "yes"}, r"reweigh must be True or False, got 'yes' \(a str\)"),
        ("llama", {"kind": None, "reweigh": True}, "reweigh: weighs the NTL term, and kind None trains without one"),
        ("llama", {"kind": "was", "float_level": True}, "float_level"),
        ("llama", {"chunk_size": 0}, r"chunk_size must be a whole number of positions >= 1, or None .*, got 0$"),
        ("llama", {"chunk_size": 64.0}, r"chunk_size must be .*, got 64.0$"),
        ("llama", {"backend": "cuda"}, "backend must be one of"),
        (
            "llama",
            {"tokenizer": None},
            r"tokenizer must be the model's transformers tokenizer \(NTL of kind 'was' "
            r"reads its number tokens\), got None; or pass kind=None for CE alone",
        ),
        ("llama", {"tokenizer": "gpt2"}, r"tokenizer must be .*, got 'gpt2' \(a str\); or pass kind=None"),
    ],
)
def test_what_it_cannot_serve_is_refused_in_one_line_naming_the_argument(model_type, arguments, message):
    """Each bad argument gets one line in the drop-in's words (Python's None, its own argument names, never a
    recipe's keys), naming the argument and the way out."""
    lm = tiny_model(model_type, vocab_size=len(TOKENIZER))
    with pytest.raises(ValueError, match=message) as refused:
        apply_ntl(lm, **{"tokenizer": TOKENIZER, **arguments})
    assert one_line_in_the_drop_ins_words(refused.value)
    assert "forward" not in vars(lm)


def one_line_in_the_drop_ins_words(error: Exception) -> bool:
    text = str(error)
    return text.startswith("apply_ntl: ") and "\n" not in text and "loss.ntl" not in text and "null" not in text


def test_ce_alone_needs_no_tokenizer():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    want = lm(**batch()).loss
    apply_ntl(lm, None, kind=None)
    assert torch.allclose(lm(**batch()).loss, want, rtol=1e-6, atol=0)


def test_a_model_that_is_not_its_types_causal_lm_is_refused_by_its_own_name():
    """The trunk alone (LlamaModel: no output layer) and a masked LM are refused naming the class given and the
    causal LM to pass; a tokenizer without number tokens naming kind=None."""
    from tokenizers import Tokenizer, models
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    trunk = tiny_model("llama", vocab_size=len(TOKENIZER)).model
    causal = r"model: LlamaModel is not a causal LM with an output layer; .*pass LlamaForCausalLM, the causal LM of"
    with pytest.raises(ValueError, match=causal + " model_type 'llama'") as refused:
        apply_ntl(trunk, TOKENIZER)
    assert one_line_in_the_drop_ins_words(refused.value)
    bert = BertForMaskedLM(BertConfig(vocab_size=len(TOKENIZER), hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"model: BertForMaskedLM is not a causal LM .*pass BertLMHeadModel"
    ) as refused:
        apply_ntl(bert, TOKENIZER)
    assert one_line_in_the_drop_ins_words(refused.value)
    words = {word: index for index, word in enumerate(["[UNK]", "a", "b", "plus", "equals"])}
    letters = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="[UNK]")))
    lm = tiny_model("llama", vocab_size=len(words))
    with pytest.raises(ValueError, match=r"tokenizer: NTL needs number tokens, .*; pass kind=None") as refused:
        apply_ntl(lm, letters)
    assert one_line_in_the_drop_ins_words(refused.value)
    assert "forward" not in vars(lm) and "forward" not in vars(trunk) and "forward" not in vars(bert)


def test_a_second_patch_is_refused():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    apply_ntl(lm, TOKENIZER)
    with pytest.raises(ValueError, match="has NTL applied already"):
        apply_ntl(lm, TOKENIZER)
