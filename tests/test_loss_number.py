"""Number-level NTL (kind "number", issue 12): spans and per-number losses against a float64 reference written
per number from the definition, on real multi-digit tokenizers and on WordPiece-style surfaces."""

import pytest
import torch

from ntl_pretrain.loss.number_level import EPS, count_numbers, find_spans, number_losses
from ntl_pretrain.numbers import NumberVocab, parse_number_token
from real_tokenizers import real_tokenizer


def reference_numbers(logits, labels, surfaces, nv):
    """Per row, a Python walk over positions: list of (first position, loss) in float64."""
    out = []
    wordpiece = any(c.marker == "wordpiece" for c in nv.class_info)
    for row_logits, row in zip(logits.double(), labels.tolist(), strict=True):
        current = None  # (first position, [(expected, value, digits)])
        numbers = []
        for t, label in enumerate(row):
            parsed = parse_number_token(surfaces[label]) if label >= 0 and surfaces[label] else None
            if parsed is None:
                current = None
                continue
            marker, digits, value = parsed
            joins = marker == "wordpiece" if wordpiece else marker == "none"
            if current is None or not joins:
                current = (t, [])
                numbers.append(current)
            members = (nv.classes == nv.classes[label]).nonzero().flatten()
            probs = torch.softmax(row_logits[t, members], dim=-1)
            current[1].append((float(probs @ nv.values[members].double()), value, digits))
        for first, parts in numbers:
            predicted = target = 0.0
            for expected, value, digits in parts:  # Horner: shift by the digits of each later token
                predicted, target = predicted * 10.0**digits + expected, target * 10.0**digits + value
            out.append((len(out), first, abs(predicted - target) / (abs(predicted) + abs(target) + EPS)))
    return out


def number_labels(tokenizer, texts, width):
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:width]
        rows.append(ids + [-100] * (width - len(ids)))
    return torch.tensor(rows)


@pytest.mark.parametrize("name", ["gpt2", "llama3", "cl100k"])
def test_matches_float64_reference_per_number(name):
    tokenizer = real_tokenizer(name)
    surfaces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    nv = NumberVocab.from_surfaces(surfaces)
    labels = number_labels(tokenizer, ["pay 12345 or 7 then 1234567, 42 and 0", "x 98765432 y 3 14 159"], 16)
    labels[0, 3] = -100  # an ignored label ends a number
    torch.manual_seed(0)
    logits = torch.randn(*labels.shape, nv.vocab_size, dtype=torch.float64) * 3
    loss, count = number_losses(logits, labels, nv)
    expected = torch.zeros(labels.shape, dtype=torch.float64)
    reference = []
    for r in range(labels.shape[0]):
        for _, first, value in reference_numbers(logits[r : r + 1], labels[r : r + 1], surfaces, nv):
            expected[r, first] = value
            reference.append(value)
    assert int(count) == len(reference) > 4
    assert int(count_numbers(labels, nv)) == len(reference)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


def test_spans_markers_and_wordpiece():
    surfaces = ["a", "12", "345", "Ġ67", "Ġ8", "9", "##1", "2"]
    nv = NumberVocab.from_surfaces(surfaces[:6])
    is_number, starts, span, later, count = find_spans(torch.tensor([[1, 2, 3, 5, 0, 4, 5, 1]]), nv)
    assert starts.tolist() == [True, False, True, False, False, True, False, False]
    assert is_number.tolist() == [True] * 4 + [False] + [True] * 3
    assert span.tolist() == [0, 0, 1, 1, -1, 2, 2, 2]
    assert later.tolist() == [3, 0, 1, 0, 0, 3, 2, 0]  # "Ġ8","9","12" is 8912
    assert int(count) == 3
    wordpiece = NumberVocab.from_surfaces(surfaces)  # has ## tokens: only ## continues
    _, starts, _, later, count = find_spans(torch.tensor([[7, 6, 7, 7, 6]]), wordpiece)
    assert starts.tolist() == [True, False, True, True, False]
    assert later.tolist() == [1, 0, 0, 1, 0]
    assert int(count) == 3


def test_rows_never_join_and_gradcheck():
    nv = NumberVocab.from_surfaces(["a", "0", "1", "2", "3", "10", "Ġ5"])
    labels = torch.tensor([[0, 2, 3], [4, 5, 6]])
    assert int(count_numbers(labels, nv)) == 3  # "12" ends at the row end; the next row starts "3","10"
    _, _, _, later, _ = find_spans(labels, nv)
    assert later.tolist() == [0, 1, 0, 2, 0, 0]
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: number_losses(x, labels, nv)[0].sum(), (logits,))


def test_ce_ntl_loss_kind_number_is_ce_plus_mean_per_number_loss():
    from ntl_pretrain.loss import ce_ntl_loss

    tokenizer = real_tokenizer("gpt2")
    nv = NumberVocab.from_tokenizer(tokenizer)
    labels = number_labels(tokenizer, ["a 12345 b 7 c 2024", "x 31 y 4 z 100000"], 12)
    logits = torch.randn(*labels.shape, nv.vocab_size, dtype=torch.float64, requires_grad=True)
    out = ce_ntl_loss(logits, labels, nv, kind="number", weight=0.3)
    per_number, count = number_losses(logits, labels, nv)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, nv.vocab_size), labels.reshape(-1))
    assert int(out.num_number_tokens) == int(count) > 4
    torch.testing.assert_close(out.loss, ce + 0.3 * per_number.sum() / count, rtol=1e-12, atol=1e-12)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="reweigh"):
        ce_ntl_loss(logits, labels, nv, kind="number", reweigh=True)
