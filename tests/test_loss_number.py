"""Number-level NTL (kind "number"): spans, losses and gradients against the float64 reference that walks each row
number by number (helpers/float64_reference.py), against `ntloss.NumberLevelLoss` on single-digit tokenizers, through
the chunked head, and at the edges (decimal points, rows, long numbers, zero targets, torch.compile)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from helpers.float64_reference import assert_close_relative, count_ntl_terms, reference_numbers, reference_rows
from helpers.real_tokenizers import real_tokenizer

from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.loss.number_level import EPS, MAX_PLACE, count_numbers, find_number_spans
from ntl_pretrain.numbers import NumberVocab

# Numbers of one to eight digits, chunked differently by each tokenizer; decimals, a double point, a dotted triple.
TEXTS = [
    "pay 12345 or 7 then 1234567, 42 and 0 at 12.34",
    "x 98765432 y 3 14 159 at 2.5 and 56.78.9 or 3..4 then 0.5",
]


def labels_of(tokenizer, texts: list[str], width: int) -> torch.Tensor:
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:width]
        rows.append(ids + [-100] * (width - len(ids)))
    return torch.tensor(rows)


def real_case(name: str, width: int = 32, seed: int = 0):
    tokenizer = real_tokenizer(name)
    nv = NumberVocab.from_tokenizer(tokenizer)
    labels = labels_of(tokenizer, TEXTS, width)
    labels[0, 3] = -100  # an ignored label ends a number
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*labels.shape, nv.vocab_size, generator=generator, dtype=torch.float64)
    return tokenizer, nv, labels, logits


@pytest.mark.parametrize("float_level", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama3", "cl100k"])
def test_equals_float64_reference_on_multi_digit_tokenizers(name, float_level):
    _, nv, labels, logits = real_case(name)
    ours = logits.clone().requires_grad_(True)
    out = ce_ntl_loss(ours, labels, nv, kind="number", reduction="none", float_level=float_level)
    theirs = logits.clone().requires_grad_(True)
    ref_ce, ref_ntl = reference_rows(theirs.reshape(-1, nv.vocab_size), labels, nv, "number", False, float_level)
    assert_close_relative(out.ce.reshape(-1), ref_ce, 1e-12, "ce")
    assert_close_relative(out.ntl.reshape(-1), ref_ntl, 1e-12, "per-number loss")
    generator = torch.Generator().manual_seed(1)
    g_ce, g_ntl = torch.randn(2, *labels.shape, generator=generator, dtype=torch.float64)
    ((out.ce * g_ce).sum() + (out.ntl * g_ntl).sum()).backward()
    ((ref_ce * g_ce.reshape(-1)).sum() + (ref_ntl * g_ntl.reshape(-1)).sum()).backward()
    assert_close_relative(ours.grad, theirs.grad, 1e-9, "logits grad")
    numbers = count_ntl_terms(labels, nv, "number", float_level)
    assert int(out.num_number_tokens) == int(count_numbers(labels, nv, float_level=float_level)) == numbers > 8
    mean = ce_ntl_loss(logits, labels, nv, kind="number", ntl_weight=0.3, float_level=float_level)
    assert_close_relative(mean.ntl, ref_ntl.sum() / numbers, 1e-12, "mean over numbers")


@pytest.mark.parametrize("float_level", [False, True])
@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_equals_ntloss_number_level_loss_on_single_digit_tokenizers(name, float_level):
    from ntloss import NumberLevelLoss

    tokenizer, nv, labels, logits = real_case(name, seed=2)
    reference = NumberLevelLoss(tokenizer, vocab_size=nv.vocab_size, float_level=float_level, reweigh=False)
    ours, theirs = (logits.float().requires_grad_(True) for _ in range(2))
    out = ce_ntl_loss(ours, labels, nv, kind="number", float_level=float_level)
    expected = reference(theirs, labels)
    torch.testing.assert_close(out.ntl, expected, rtol=1e-5, atol=1e-6)
    out.ntl.backward()
    expected.backward()
    assert_close_relative(ours.grad, theirs.grad, 1e-5, "logits grad")
    assert float(out.ntl) > 0.1 and ours.grad.abs().sum() > 0


def test_chunked_head_equals_dense_with_numbers_across_chunks():
    """Chunks of 5 positions cut numbers apart; the first pass sees every position of each number."""
    _, nv, labels, _ = real_case("llama3")
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(*labels.shape, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(nv.vocab_size, 16, generator=generator, dtype=torch.float64) / 2
    for float_level in (False, True):
        results = []
        for chunked in (True, False):
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            if chunked:
                out = linear_ce_ntl_loss(h, w, labels, nv, kind="number", chunk_size=5, float_level=float_level)
            else:
                out = ce_ntl_loss(h @ w.T, labels, nv, kind="number", float_level=float_level)
            (1.7 * out.loss).backward()
            results.append((out.loss, out.ce, out.ntl, out.num_number_tokens, h.grad, w.grad))
        for name, a, b in zip(("loss", "ce", "ntl", "numbers", "hidden grad", "weight grad"), *results, strict=True):
            assert_close_relative(a, b, 1e-6, f"{name} {float_level=}")


def test_spans_follow_markers_wordpiece_and_rows():
    surfaces = ["a", "12", "345", "Ġ67", "Ġ8", "9", "##1", "2"]
    nv = NumberVocab.from_surfaces(surfaces[:6])
    spans = find_number_spans(torch.tensor([[1, 2, 3, 5, 0, 4, 5, 1]]), nv)
    assert spans.first.tolist() == [True, False, True, False, False, True, False, False]
    assert spans.number.tolist() == [0, 0, 1, 1, -1, 2, 2, 2]
    assert spans.place.tolist() == [1e3, 1, 10, 1, 0, 1e3, 100, 1]  # "Ġ8","9","12" is 8912
    assert int(spans.count) == 3
    wordpiece = NumberVocab.from_surfaces(surfaces)  # has ## tokens: only ## continues
    spans = find_number_spans(torch.tensor([[7, 6, 7, 7, 6]]), wordpiece)
    assert spans.first.tolist() == [True, False, True, True, False]
    assert spans.place.tolist() == [10, 1, 1, 10, 1]
    rows = find_number_spans(torch.tensor([[0, 1, 5], [5, 1, 3]]), nv)  # a row's end ends a number
    assert rows.number.tolist() == [-1, 0, 0, 1, 1, 2] and rows.place.tolist() == [0, 10, 1, 100, 1, 1]


@pytest.mark.parametrize(
    "row,joined,split",
    [
        ([2, 1, 3], [[(0, 1), (2, 1)]], [[(0, 1)], [(2, 1)]]),  # 1.2 is 12 with float_level
        ([2, 1, 4], [[(0, 1)], [(2, 1)]], None),  # a marked token after the point starts a new number
        ([2, 1, 1, 3], [[(0, 1)], [(3, 1)]], None),  # two points
        ([2, 5, 3], [[(0, 1)], [(2, 1)]], None),  # ".." is not a decimal point
        ([2, 1, 3, 1, 2], [[(0, 1), (2, 1), (4, 1)]], [[(0, 1)], [(2, 1)], [(4, 1)]]),  # 1.2.1 is 121
        ([1, 2, 1], [[(1, 1)]], None),  # points at the edges join nothing
        ([2, 6, 1, 2], [[(0, 1), (1, 2), (3, 1)]], [[(0, 1), (1, 2)], [(3, 1)]]),  # 1 23 . 1 (multi-digit)
    ],
)
def test_decimal_points_join_two_runs_only_with_float_level(row, joined, split):
    nv = NumberVocab.from_surfaces(["a", ".", "1", "2", "Ġ3", "..", "23"])
    labels = torch.tensor([row])
    for float_level, numbers in ((True, joined), (False, split or joined)):
        assert reference_numbers(labels, nv, float_level) == numbers
        spans = find_number_spans(labels, nv, float_level=float_level)
        assert int(spans.count) == len(numbers)
        for index, number in enumerate(numbers):
            digits_after = [sum(d for _, d in number[i + 1 :]) for i in range(len(number))]
            assert [int(spans.number[p]) for p, _ in number] == [index] * len(number)
            assert [float(spans.place[p]) for p, _ in number] == [10.0**e for e in digits_after]
        in_numbers = {p for number in numbers for p, _ in number}
        assert all(int(spans.number[p]) == -1 for p in range(len(row)) if p not in in_numbers)


def test_long_numbers_stay_finite_and_exact_to_float64():
    """A 400-digit number (beyond float64's range) and a 17-digit one, against exact rational arithmetic."""
    nv = NumberVocab.from_surfaces(["a"] + [str(d) for d in range(10)])
    generator = torch.Generator().manual_seed(4)
    for digits in (17, 400):
        labels = torch.randint(1, 11, (1, digits), generator=generator)
        logits = (3 * torch.randn(1, digits, 11, generator=generator, dtype=torch.float64)).requires_grad_(True)
        out = ce_ntl_loss(logits, labels, nv, kind="number", reduction="none")
        out.ntl.sum().backward()
        assert torch.isfinite(logits.grad).all() and logits.grad[..., 1:].abs().sum() > 0
        q = torch.softmax(logits.detach()[0, :, 1:], -1)
        expected = (q * torch.arange(10, dtype=torch.float64)).sum(-1).tolist()
        predicted = sum(Fraction(e) * 10 ** (digits - 1 - t) for t, e in enumerate(expected))
        target = int("".join(str(int(label) - 1) for label in labels[0]))
        exact = abs(predicted - target) / (abs(predicted) + abs(target) + Fraction(EPS))
        assert float(out.ntl[0, 0]) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), digits
        assert int(out.num_number_tokens) == 1 and (out.ntl[0, 1:] == 0).all()
    assert digits > MAX_PLACE


def test_a_zero_target_costs_about_one_until_the_expectation_is_within_eps():
    """|ŷ − 0| / (|ŷ| + eps): 99.95% of the mass on "0" still costs ~1 (as in ntloss); see docs/loss.md."""
    nv = NumberVocab.from_surfaces([str(d) for d in range(10)])
    labels = torch.tensor([[0]])
    for peak, low, high in ((10.0, 0.999, 1.0), (30.0, 0.0, 1e-3)):
        logits = torch.zeros(1, 1, 10, dtype=torch.float64)
        logits[..., 0] = peak
        loss = float(ce_ntl_loss(logits, labels, nv, kind="number").ntl)
        assert low <= loss <= high, (peak, loss)


def test_compiles_into_one_graph_with_torch_compile():
    """fullgraph=True fails on a host sync (.item(), a Python branch on a tensor) in the span code."""
    torch._dynamo.reset()
    _, nv, labels, logits = real_case("gpt2", width=12)
    eager_logits, compiled_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss_of = lambda z: ce_ntl_loss(z, labels, nv, kind="number", float_level=True).loss
    eager = loss_of(eager_logits)
    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)(compiled_logits)
    torch.testing.assert_close(compiled, eager)
    eager.backward()
    compiled.backward()
    torch.testing.assert_close(compiled_logits.grad, eager_logits.grad)


def test_gradcheck_and_reweigh_refused():
    nv = NumberVocab.from_surfaces(["a", "0", "1", "2", "3", "10", "Ġ5"])
    labels = torch.tensor([[0, 2, 3, 5], [4, 5, 6, 2]])
    logits = torch.randn(2, 4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: ce_ntl_loss(z, labels, nv, kind="number", ntl_weight=0.7).loss, (logits,))
    with pytest.raises(ValueError, match="reweigh"):
        ce_ntl_loss(logits, labels, nv, kind="number", reweigh=True)
