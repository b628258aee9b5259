"""`apply_ntl` under transformers' `Trainer` (fp32 and bf16 on CPU): three steps with gradient accumulation equal a
float64 loop that shares nothing with the drop-in but the loss kernel (transformers' own forward for the logits,
`ce_ntl_loss` on them, the step's counts taken here); accumulation equals one big micro-batch; evaluation's loss is
the reference's per batch; ce and ntl are logged with loss = ce + λ·ntl; undone, the Trainer trains as one never
patched, bit for bit; a Trainer that computes the loss from logits itself is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import tiny_model
from transformers import AutoTokenizer, Trainer, TrainingArguments

from ntl_pretrain.integrations import apply_ntl
from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.package_files import resolve_path

TOKENIZER = AutoTokenizer.from_pretrained(resolve_path("pkg:ntl_pretrain/corpus/tiny-tokenizer"))
NV = NumberVocab.from_tokenizer(TOKENIZER)
SEQ, LAMBDA, LR, STEPS = 20, 0.3, 0.1, 3
# SGD, not Adam: Adam's first step moves a weight by about the learning rate whatever the sign and size of its
# gradient, so float32 rounding of a near-zero gradient would part the float32 run from the float64 reference.

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def example(a: int, b: int) -> dict:
    """`a + b = ` then the sum: labels on the sum only (TRL's completion-only labels), padded with attention 0."""
    prompt, answer = TOKENIZER(f"{a} + {b} = ").input_ids, TOKENIZER(f"{a + b}").input_ids
    used = len(prompt) + len(answer)
    pad = SEQ - used
    return {
        "input_ids": torch.tensor(prompt + answer + [TOKENIZER.eos_token_id] * pad),
        "attention_mask": torch.tensor([1] * used + [0] * pad),
        "labels": torch.tensor([-100] * len(prompt) + answer + [-100] * pad),
    }


def dataset(size: int = 12) -> list[dict]:
    # sums of 1 to 4 digits: micro-batches differ in their share of number labels
    pairs = torch.randint(0, 10, (size, 2), generator=torch.Generator().manual_seed(0)) ** torch.tensor([1, 3])
    return [example(a, b) for a, b in pairs.tolist()]


def trainer_for(lm, micro: int, accumulation: int, **settings) -> Trainer:
    args = TrainingArguments(
        output_dir="trainer-out", per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
        gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        optim="sgd", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, **settings,
    )  # fmt: skip
    return Trainer(model=lm, args=args, train_dataset=dataset())


def logged(trainer: Trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def ntl_terms(shifted: torch.Tensor, kind: str) -> torch.Tensor:
    """Counted here, apart from the drop-in: number labels, or with kind number the first of each run of them."""
    is_number = (shifted != -100) & (NV.classes[shifted.clamp_min(0)] >= 0)
    if kind != "number":
        return is_number.sum()
    before = torch.nn.functional.pad(is_number, (1, 0))[..., :-1]
    return (is_number & ~before).sum()


def reference_steps(lm, data: list[dict], micro: int, accumulation: int, kind: str) -> list[tuple[float, float]]:
    """(ce, ntl) of each step of a float64 copy of `lm` trained as the Trainer trains (SGD, gradient norm clipped at
    1, constant learning rate), CE over the step's label tokens and NTL over its NTL terms."""
    model = copy.deepcopy(lm).double().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        first = step * micro * accumulation
        batches = [data[i : i + micro] for i in range(first, first + micro * accumulation, micro)]
        batches = [{key: torch.stack([row[key] for row in batch]) for key in batch[0]} for batch in batches]
        num_tokens = sum((batch["labels"][:, 1:] != -100).sum() for batch in batches)
        num_terms = sum(ntl_terms(batch["labels"][:, 1:], kind) for batch in batches)
        ce = ntl = 0.0
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            out = ce_ntl_loss(logits[:, :-1], batch["labels"][:, 1:], NV, kind=kind, ntl_weight=LAMBDA, reduction="sum")
            (out.ce / num_tokens + LAMBDA * out.ntl / num_terms).backward()
            ce, ntl = ce + out.ce.item() / num_tokens.item(), ntl + out.ntl.item() / num_terms.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        steps.append((ce, ntl))
    return steps


@pytest.mark.parametrize("kind", ["was", "number"])
def test_three_accumulated_steps_equal_a_float64_loop(kind):
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    want = reference_steps(lm, dataset(), micro=2, accumulation=2, kind=kind)
    trainer = trainer_for(lm, micro=2, accumulation=2)
    apply_ntl(trainer, TOKENIZER, kind=kind, ntl_weight=LAMBDA)
    trainer.train()
    got = list(zip(logged(trainer, "ce"), logged(trainer, "ntl"), logged(trainer, "loss"), strict=True))
    assert len(got) == STEPS
    for (ce, ntl, loss), (want_ce, want_ntl) in zip(got, want, strict=True):
        # float32 against float64: 1e-6 at step 1, a few 1e-6 by step 3 as the two models part (measured)
        assert ce == pytest.approx(want_ce, rel=3e-5) and ntl == pytest.approx(want_ntl, rel=3e-5)
        assert loss == pytest.approx(ce + LAMBDA * ntl, rel=1e-6)
    assert want[2][0] < 0.9 * want[0][0]  # the steps moved the model: its gradients are compared too


def test_accumulated_micro_batches_equal_one_micro_batch_of_them_all():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    runs = {}
    for micro, accumulation in ((4, 1), (2, 2), (1, 4)):
        trainer = trainer_for(copy.deepcopy(lm), micro, accumulation)
        apply_ntl(trainer, TOKENIZER, kind="was", ntl_weight=LAMBDA)
        trainer.train()
        runs[micro] = trainer
    for micro in (2, 1):
        for key in ("loss", "ce", "ntl"):
            assert logged(runs[micro], key) == pytest.approx(logged(runs[4], key), rel=1e-6), (micro, key)
        for (name, got), want in zip(runs[micro].model.named_parameters(), runs[4].model.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_loss_is_each_batch_own_ce_and_ntl():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    data = dataset(4)
    model = copy.deepcopy(lm).double()
    want = []
    for batch in (data[:2], data[2:]):
        batch = {key: torch.stack([row[key] for row in batch]) for key in batch[0]}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = ce_ntl_loss(logits[:, :-1], batch["labels"][:, 1:], NV, kind="was", ntl_weight=LAMBDA)
        want.append(out.loss.item())
    trainer = trainer_for(lm, micro=2, accumulation=1)
    apply_ntl(trainer, TOKENIZER, kind="was", ntl_weight=LAMBDA)
    metrics = trainer.evaluate(data, metric_key_prefix="eval")
    assert metrics["eval_loss"] == pytest.approx(sum(want) / 2, rel=1e-5)


def test_bf16_trains_on_cpu_without_the_output_layer_forming_logits_and_undoes_inside_accelerates_autocast():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    fp32 = trainer_for(copy.deepcopy(lm), micro=2, accumulation=2)
    apply_ntl(fp32, TOKENIZER)
    fp32.train()
    calls = []
    lm.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    bf16 = trainer_for(lm, micro=2, accumulation=2, bf16=True)
    patch = apply_ntl(bf16, TOKENIZER)
    bf16.train()
    assert calls == [] and lm.lm_head.weight.dtype == torch.float32
    patch.undo()  # accelerate has wrapped the patched forward in autocast since: undone, it is transformers' inside
    inputs = {key: torch.stack([row[key] for row in dataset(2)]) for key in ("input_ids", "attention_mask", "labels")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = type(lm).forward(lm, **inputs)
    got = lm(**inputs)
    assert torch.equal(got.logits, want.logits.float()) and torch.equal(got.loss, want.loss.float())
    first_bf16, first_fp32 = logged(bf16, "loss")[0], logged(fp32, "loss")[0]
    assert first_bf16 == pytest.approx(first_fp32, rel=1e-2) and first_bf16 != pytest.approx(first_fp32, rel=1e-5)
    assert logged(bf16, "loss")[-1] < 0.9 * first_bf16  # it trains (the trajectories part by a few % by step 3)
    for loss, ce, ntl in zip(logged(bf16, "loss"), logged(bf16, "ce"), logged(bf16, "ntl"), strict=True):
        assert loss == pytest.approx(ce + LAMBDA * ntl, rel=1e-6)


def test_undone_the_trainer_trains_as_one_never_patched():
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    plain = trainer_for(copy.deepcopy(lm), micro=2, accumulation=2)
    plain.train()
    undone = trainer_for(lm, micro=2, accumulation=2)
    apply_ntl(undone, TOKENIZER).undo()
    assert {"forward", "log", "_get_num_items_in_batch"}.isdisjoint({*vars(lm), *vars(undone)})
    undone.train()
    assert logged(undone, "loss") == logged(plain, "loss") and "ce" not in undone.state.log_history[0]
    for got, want in zip(undone.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("setting", "why"),
    [({"label_smoothing_factor": 0.1}, "label_smoothing_factor"), ({"compute_loss_func": len}, "compute_loss_func")],
)
def test_a_trainer_that_computes_the_loss_from_logits_is_refused(setting, why):
    lm = tiny_model("llama", vocab_size=len(TOKENIZER))
    if "compute_loss_func" in setting:
        trainer = trainer_for(lm, micro=2, accumulation=1)
        trainer.compute_loss_func = setting["compute_loss_func"]
    else:
        trainer = trainer_for(lm, micro=2, accumulation=1, **setting)
    with pytest.raises(ValueError, match=why):
        apply_ntl(trainer, TOKENIZER)
    assert "forward" not in vars(lm)
