"""ce_ntl_loss against ntloss, F.cross_entropy and a float64 per-position reference written from the definition."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.float64_reference import reference_rows
from helpers.real_tokenizers import real_tokenizer
from ntloss import NTLoss, NTLossDotProduct

from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

VALUE_KINDS = ["was", "mse", "mae", "huber"]
KINDS = [*VALUE_KINDS, "digits"]
KIND_CASES = [(kind, False) for kind in KINDS] + [(kind, True) for kind in VALUE_KINDS]  # reweigh: value kinds only
NTLOSS_FUNCTIONS = {"mse": F.mse_loss, "mae": F.l1_loss, "huber": F.huber_loss}


def reference_loss(logits, labels, nv, kind, reweigh, ignore_index=-100):
    """Per-position (CE, NTL) in float64, one position at a time, straight from the definition in docs/loss.md."""
    ce, ntl = [], []
    for z, t in zip(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1).tolist(), strict=True):
        if t == ignore_index:
            ce.append(z.sum() * 0)
            ntl.append(z.sum() * 0)
            continue
        ce.append(torch.logsumexp(z, 0) - z[t])
        if kind is None or nv.classes[t] < 0:
            ntl.append(z.sum() * 0)
            continue
        members = nv.classes == nv.classes[t]
        q = torch.softmax(z[members], 0)
        v, y, s = nv.values[members].double(), float(nv.values[t]), float(nv.scales[t])
        if kind == "was":
            loss, worst = (q * (v - y).abs()).sum() / s, (v.max() - v.min()) / s
        elif kind == "digits":
            k = nv.class_info[nv.classes[t]].digits
            distance = (nv.digits[members, :k].double() - nv.digits[t, :k].double()).abs().sum(1) / k
            loss = (q * distance).sum()
        else:
            f = {"mse": lambda e: e**2, "mae": abs, "huber": lambda e: F.huber_loss(e, torch.zeros_like(e))}[kind]
            loss, worst = f(((q * v).sum() - y) / s), f((v.max() - v.min()) / s)
        if reweigh:
            mass = torch.softmax(z, 0)[members].sum()
            loss = loss * mass + 1.01 * worst * (1 - mass)
        ntl.append(loss)
    return torch.stack(ce).view(labels.shape), torch.stack(ntl).view(labels.shape)


def random_batch(nv, shape, number_fraction=0.5, ignore_fraction=0.1, scale=3.0, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, nv.vocab_size, generator=generator, dtype=torch.float64) * scale
    labels = torch.randint(0, nv.vocab_size, shape, generator=generator)
    numbers = nv.number_ids[torch.randint(0, len(nv.number_ids), shape, generator=generator)]
    draw = torch.rand(shape, generator=generator)
    labels = torch.where(draw < number_fraction, numbers, labels)
    labels = torch.where(draw > 1 - ignore_fraction, -100, labels)
    return logits.to(dtype), labels


def grads_of(fn, logits, *outputs_weights):
    logits = logits.detach().clone().requires_grad_(True)
    outputs = fn(logits)
    total = sum(w * o.sum() for w, o in zip(outputs_weights, outputs, strict=True))
    total.backward()
    return [o.detach() for o in outputs], logits.grad


@pytest.mark.parametrize("tokenizer", ["mistral", "qwen2"])
@pytest.mark.parametrize("kind,reweigh", KIND_CASES)
def test_matches_ntloss_on_single_digit_tokenizers(tokenizer, kind, reweigh):
    tok = real_tokenizer(tokenizer)
    nv = NumberVocab.from_tokenizer(tok)
    logits, labels = random_batch(nv, (2, 24), seed=hash((tokenizer, kind)) % 1000)
    # ntloss adds digit tokens to the tokenizer it is given; hand it a copy so ours stays untouched.
    if kind in ("was", "digits"):  # on single digits the digit-wise distance is |v_j - y|
        reference = NTLoss(copy.deepcopy(tok), digit_level=True, reweigh=reweigh)
    else:
        reference = NTLossDotProduct(
            copy.deepcopy(tok), digit_level=True, reweigh=reweigh, loss_function=NTLOSS_FUNCTIONS[kind]
        )
    out = ce_ntl_loss(logits, labels, nv, kind=kind, reweigh=reweigh)
    torch.testing.assert_close(out.ntl, reference(logits, labels), rtol=1e-5, atol=1e-5)
    expected_ce = F.cross_entropy(logits.view(-1, nv.vocab_size), labels.view(-1))
    torch.testing.assert_close(out.ce, expected_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, out.ce + 0.3 * out.ntl)


@pytest.mark.parametrize("kind,reweigh", KIND_CASES)
def test_multi_digit_values_and_gradients_match_float64_reference(kind, reweigh):
    nv = NumberVocab.from_tokenizer(real_tokenizer("gpt2"))  # 16 classes: 1..16 digits, with and without Ġ
    logits, labels = random_batch(nv, (3, 8), dtype=torch.float64, seed=7)
    ours = lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv, kind, reweigh=reweigh, reduction="none"))
    theirs = lambda z: reference_loss(z, labels, nv, kind, reweigh)
    (ce, ntl), grad = grads_of(ours, logits, 1.0, 0.7)
    (ref_ce, ref_ntl), ref_grad = grads_of(theirs, logits, 1.0, 0.7)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ntl, ref_ntl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert (ntl != 0).sum() >= 6, "the batch must exercise NTL"


def test_fp32_matches_float64_reference_on_llama3_chunks():
    nv = NumberVocab.from_tokenizer(real_tokenizer("llama3"))
    logits, labels = random_batch(nv, (2, 10), seed=3)
    (ce, ntl), grad = grads_of(
        lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv, reduction="none")), logits, 1.0, 0.3
    )
    (ref_ce, ref_ntl), ref_grad = grads_of(
        lambda z: reference_loss(z, labels, nv, "was", False), logits.double(), 1.0, 0.3
    )
    torch.testing.assert_close(ce, ref_ce.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ntl, ref_ntl.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-4, atol=1e-7)


def small_vocab():
    surfaces = ["a", "b", "0", "1", "2", "3", "Ġ4", "Ġ5", "Ġ6", "10", "42", "99", "c", "▁7", "d"]
    return NumberVocab.from_surfaces(surfaces)


@pytest.mark.parametrize("kind,reweigh", [*KIND_CASES, (None, False), (None, True)])
def test_gradcheck_float64(kind, reweigh):
    nv = small_vocab()
    logits = torch.randn(7, nv.vocab_size, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([2, 5, 9, 10, 0, -100, 13])

    def outputs(z):
        out = ce_ntl_loss(z, labels, nv, kind=kind, reweigh=reweigh, reduction="none")
        return out.ce, out.ntl

    assert torch.autograd.gradcheck(outputs, (logits,), eps=1e-6, atol=1e-7)


def test_reductions_agree_and_leading_dims_are_kept():
    nv = small_vocab()
    logits, labels = random_batch(nv, (2, 3, 5), seed=11)
    none = ce_ntl_loss(logits, labels, nv, reduction="none")
    total = ce_ntl_loss(logits, labels, nv, reduction="sum")
    mean = ce_ntl_loss(logits, labels, nv, reduction="mean")
    assert none.ce.shape == labels.shape and none.ntl.shape == labels.shape
    valid, numbers = labels != -100, (labels >= 0) & (nv.classes[labels.clamp_min(0)] >= 0)
    assert int(total.num_tokens) == int(valid.sum()) and int(total.num_number_tokens) == int(numbers.sum())
    torch.testing.assert_close(total.ce, none.ce.sum())
    torch.testing.assert_close(mean.ce, total.ce / total.num_tokens)
    torch.testing.assert_close(mean.ntl, total.ntl / total.num_number_tokens)
    assert (none.ntl[~numbers] == 0).all() and (none.ce[~valid] == 0).all()


def test_batch_without_number_labels_has_zero_ntl_and_ce_only_gradient():
    nv = small_vocab()
    logits, _ = random_batch(nv, (12,), seed=5)
    labels = torch.tensor([0, 1, 12, 14, -100, 0, 1, 12, 14, 0, 1, 12])
    (_, ntl), grad = grads_of(lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv)), logits, 1.0, 1.0)
    _, ce_grad = grads_of(lambda z: (F.cross_entropy(z, labels),), logits, 1.0)
    assert float(ntl) == 0.0
    torch.testing.assert_close(grad, ce_grad, rtol=1e-6, atol=1e-8)


def test_all_ignored_gives_zero_loss_and_zero_gradient():
    nv = small_vocab()
    logits, _ = random_batch(nv, (4,), seed=2)
    labels = torch.full((4,), -100)
    (loss,), grad = grads_of(lambda z: (ce_ntl_loss(z, labels, nv).loss,), logits, 1.0)
    assert float(loss) == 0.0 and (grad == 0).all()


def test_kind_none_is_cross_entropy_through_the_same_path():
    nv = small_vocab()
    logits, labels = random_batch(nv, (9,), seed=4)
    (ce,), grad = grads_of(lambda z: (ce_ntl_loss(z, labels, None, kind=None).loss,), logits, 1.0)
    (expected,), expected_grad = grads_of(lambda z: (F.cross_entropy(z, labels),), logits, 1.0)
    torch.testing.assert_close(ce, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-8)


def test_bf16_logits_are_computed_in_fp32():
    nv = NumberVocab.from_tokenizer(real_tokenizer("llama3"))
    logits, labels = random_batch(nv, (6,), seed=8)
    low = logits.bfloat16().requires_grad_(True)
    out = ce_ntl_loss(low, labels, nv)
    out.loss.backward()
    exact = ce_ntl_loss(low.detach().float(), labels, nv)
    assert out.loss.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, exact.loss, rtol=1e-6, atol=1e-6)


def test_chunked_rows_equal_one_chunk(monkeypatch):
    import ntl_pretrain.loss.fused as fused

    nv = NumberVocab.from_tokenizer(real_tokenizer("mistral"))
    logits, labels = random_batch(nv, (13,), seed=9)
    run = lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv, reweigh=True, reduction="none"))
    (ce, ntl), grad = grads_of(run, logits, 1.0, 0.5)
    monkeypatch.setitem(fused.CHUNK_ELEMENTS, "cpu", nv.vocab_size * 4)  # 4 rows per chunk: 4 chunks, the last short
    (ce4, ntl4), grad4 = grads_of(run, logits, 1.0, 0.5)
    assert torch.equal(ce, ce4) and torch.equal(ntl, ntl4) and torch.equal(grad, grad4)


@pytest.mark.parametrize(
    ("logits_shape", "labels", "kwargs", "error", "message"),
    [
        ((2, 15), torch.zeros(3, dtype=torch.long), {}, ValueError, "leading shape"),
        ((2, 15), torch.zeros(2), {}, TypeError, "int64"),
        ((2, 16), torch.zeros(2, dtype=torch.long), {}, ValueError, "vocab_size=16"),
        ((2, 15), torch.tensor([3, 15]), {}, RuntimeError, r"\[0, 15\)"),
        ((2, 15), torch.tensor([3, -5]), {}, RuntimeError, "ignore_index"),
        ((2, 15), torch.zeros(2, dtype=torch.long), {"kind": "l2"}, ValueError, "kind must be"),
        ((2, 15), torch.zeros(2, dtype=torch.long), {"reduction": "avg"}, ValueError, "reduction must be"),
    ],
)
def test_bad_inputs_say_what_was_expected(logits_shape, labels, kwargs, error, message):
    with pytest.raises(error, match=message):
        ce_ntl_loss(torch.randn(*logits_shape), labels, small_vocab(), **kwargs)


def test_integer_logits_and_missing_vocab_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        ce_ntl_loss(torch.zeros(2, 15, dtype=torch.long), torch.zeros(2, dtype=torch.long), small_vocab())
    with pytest.raises(ValueError, match="needs a NumberVocab"):
        ce_ntl_loss(torch.randn(2, 15), torch.zeros(2, dtype=torch.long), None)


def test_lambda_is_ntl_weight_and_its_old_name_weight_still_works_with_a_deprecation_warning():
    logits, labels = torch.randn(6, 15), torch.tensor([3, 4, 12, 5, 6, 7])
    want = ce_ntl_loss(logits, labels, small_vocab(), ntl_weight=0.7)
    assert want.loss.item() == pytest.approx((want.ce + 0.7 * want.ntl).item()) and want.ntl > 0
    with pytest.warns(DeprecationWarning, match="ntl_weight"):
        old = ce_ntl_loss(logits, labels, small_vocab(), weight=0.7)
    assert torch.equal(old.loss, want.loss)
    with pytest.raises(TypeError, match="both ntl_weight= and"):
        ce_ntl_loss(logits, labels, small_vocab(), ntl_weight=0.5, weight=0.7)
    with pytest.raises(TypeError, match="unexpected keyword argument 'wieght'"):
        ce_ntl_loss(logits, labels, small_vocab(), wieght=0.7)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_into_one_graph_with_torch_compile(backend):
    """fullgraph=True: a graph break (a host sync, a Python branch on a tensor) fails instead of passing silently."""
    torch._dynamo.reset()
    nv = small_vocab()
    logits, labels = random_batch(nv, (6,), seed=1)
    eager_logits, compiled_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    eager = ce_ntl_loss(eager_logits, labels, nv).loss
    compiled = torch.compile(lambda z: ce_ntl_loss(z, labels, nv).loss, backend=backend, fullgraph=True)(
        compiled_logits
    )
    torch.testing.assert_close(compiled, eager)
    eager.backward()
    compiled.backward()
    torch.testing.assert_close(compiled_logits.grad, eager_logits.grad)


def test_number_ce_is_the_cross_entropy_at_number_labels():
    nv = small_vocab()
    logits, labels = random_batch(nv, (3, 7), seed=5, dtype=torch.float64)
    numbers = (labels >= 0) & (nv.classes[labels.clamp_min(0)] >= 0)
    reference = F.cross_entropy(logits[numbers], labels[numbers], reduction="sum")
    assert 0 < int(numbers.sum()) < int((labels != -100).sum())
    for reduction, expected in (("sum", reference), ("mean", reference / numbers.sum())):
        torch.testing.assert_close(ce_ntl_loss(logits, labels, nv, reduction=reduction).number_ce, expected)
    per_position = ce_ntl_loss(logits, labels, nv, reduction="none").number_ce
    torch.testing.assert_close(per_position[numbers].sum(), reference)
    assert (per_position[~numbers] == 0).all()


def test_digits_sees_a_near_miss_in_the_last_digit_where_was_barely_does():
    """The issue's arithmetic: label `157`, all mass on `156`: digit-wise 1/3, class-scaled WAS 1/100."""
    nv = NumberVocab.from_surfaces(["a", "157", "156", "999", "14", "15", "7", "6"])
    logits = torch.full((2, nv.vocab_size), -1e4)
    logits[0, 2] = logits[1, 4] = 0.0  # 156 for 157, 14 for 15
    labels = torch.tensor([1, 5])
    digits = ce_ntl_loss(logits, labels, nv, kind="digits", reduction="none").ntl
    was = ce_ntl_loss(logits, labels, nv, kind="was", reduction="none").ntl
    torch.testing.assert_close(digits, torch.tensor([1 / 3, 1 / 2]))
    torch.testing.assert_close(was, torch.tensor([1 / 100, 1 / 10]))


@pytest.mark.parametrize("tokenizer", ["mistral", "qwen2"])
def test_digits_is_was_on_single_digit_tokens_to_the_bit(tokenizer):
    nv = NumberVocab.from_tokenizer(real_tokenizer(tokenizer))
    logits, labels = random_batch(nv, (3, 16), seed=21)
    run = lambda kind: lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv, kind=kind, reduction="none"))
    (ce, ntl), grad = grads_of(run("digits"), logits, 1.0, 0.3)
    (was_ce, was_ntl), was_grad = grads_of(run("was"), logits, 1.0, 0.3)
    assert torch.equal(ce, was_ce) and torch.equal(ntl, was_ntl) and torch.equal(grad, was_grad)
    assert (ntl != 0).sum() >= 10, "the batch must exercise NTL"


def wordpiece_vocab():
    """A BERT-style vocabulary: plain and `##`-continued number tokens of 1-3 digits beside words."""
    pieces = [str(i) for i in range(10)] + [f"{i:02d}" for i in range(0, 100, 7)] + ["123", "129", "903", "007"]
    return NumberVocab.from_surfaces(["[UNK]", "the", *pieces, *(f"##{p}" for p in pieces), "##s"])


@pytest.mark.parametrize("vocab", ["llama3", "cl100k", "gpt2", "wordpiece"])
def test_digits_values_and_gradients_equal_the_dense_float64_reference(vocab):
    """1-3 digit chunks (Llama-3, cl100k), GPT-2's merges with and without `Ġ`, WordPiece `##`: against the vectorised
    float64 reference (helpers/float64_reference.py), a second derivation beside `reference_loss`'s per-position one."""
    nv = wordpiece_vocab() if vocab == "wordpiece" else NumberVocab.from_tokenizer(real_tokenizer(vocab))
    logits, labels = random_batch(nv, (2, 12), number_fraction=0.7, seed=13, dtype=torch.float64)
    ours = lambda z: (lambda o: (o.ce, o.ntl))(ce_ntl_loss(z, labels, nv, kind="digits", reduction="none"))
    theirs = lambda z: tuple(t.view(labels.shape) for t in reference_rows(z.view(-1, nv.vocab_size), labels, nv,
                                                                            "digits", False))  # fmt: skip
    (ce, ntl), grad = grads_of(ours, logits, 1.0, 0.7)
    (ref_ce, ref_ntl), ref_grad = grads_of(theirs, logits, 1.0, 0.7)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ntl, ref_ntl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    multi_digit = nv.class_digits[nv.classes[labels.clamp_min(0)].clamp_min(0)] > 1
    assert ((ntl != 0) & multi_digit).sum() >= 4, "the batch must exercise multi-digit labels"
    # fp32 logits: the math in fp32, within rounding of the float64 values
    out32 = ce_ntl_loss(logits.float(), labels, nv, kind="digits", reduction="none")
    torch.testing.assert_close(out32.ntl, ref_ntl.float(), rtol=1e-5, atol=1e-5)


def test_digits_refuses_reweigh():
    with pytest.raises(ValueError, match="reweigh is not defined for kind='digits'"):
        ce_ntl_loss(torch.randn(2, 15), torch.zeros(2, dtype=torch.long), small_vocab(), kind="digits", reweigh=True)
