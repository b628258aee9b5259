"""Inputs as training loops hand them over, on both backends (Triton through its interpreter on CPU): under
`torch.autocast` (bf16 on CPU) `ce_ntl_loss` and `linear_ce_ntl_loss` behave as `nn.Linear` + `F.cross_entropy` do;
a hidden/weight pair of two dtypes outside autocast is refused naming both; column-major and strided logits, hidden
states and weights give what contiguous ones give; a +inf logit gives the same losses on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.float64_reference import assert_close_relative, reference_rows
from test_loss_triton import TOKENIZERS, interpreted_kernels

from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

BACKENDS = ["torch", "triton"]
POSITIONS, HIDDEN = 6, 16
AUTOCAST = {"device_type": "cpu", "dtype": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return interpreted_kernels()


@pytest.fixture(scope="module")
def nv() -> NumberVocab:
    return NumberVocab.from_tokenizer(TOKENIZERS["tiny-3digit"]())


def inputs(nv: NumberVocab, seed: int = 0):
    """fp32 hidden [N, H], weight [V, H] and labels [N] (number tokens, words and an ignored position)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(POSITIONS, HIDDEN, generator=generator)
    weight = 0.3 * torch.randn(nv.vocab_size, HIDDEN, generator=generator)
    labels = nv.number_ids[torch.randint(len(nv.number_ids), (POSITIONS,), generator=generator)]
    labels[1], labels[4] = 7, -100  # a word token and an ignored position
    return hidden, weight, labels


def grads_of(loss_fn, *tensors):
    """(loss, gradients of `tensors`) of `loss_fn(*leaves)`, leaves being copies of `tensors` that take gradients."""
    leaves = [tensor.detach().clone().requires_grad_(True) for tensor in tensors]
    loss = loss_fn(*leaves)
    loss.backward()
    return loss.detach(), *[leaf.grad for leaf in leaves]


def linear_and_cross_entropy(labels):
    """The loop transformers' Trainer runs with bf16=True: nn.Linear and F.cross_entropy under autocast."""

    def loss(hidden, weight):
        with torch.autocast(**AUTOCAST):
            return F.cross_entropy(F.linear(hidden, weight), labels)

    return loss


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_head_under_autocast_is_nn_linear_and_cross_entropy(nv, backend):
    """Matmuls in bf16 (the same bf16 logits as nn.Linear's: the loss agrees to fp32 rounding), the loss in fp32,
    the fp32 weight's gradient in fp32 (accumulated in fp32: within a bf16 rounding of autocast's), hidden's in its
    dtype; chunks of 4 positions."""
    hidden, weight, labels = inputs(nv)
    want = grads_of(linear_and_cross_entropy(labels), hidden, weight)

    def ours(h, w):
        with torch.autocast(**AUTOCAST):
            return linear_ce_ntl_loss(h, w, labels, nv, kind=None, chunk_size=4, backend=backend).loss

    got = grads_of(ours, hidden, weight)
    assert [x.dtype for x in got] == [x.dtype for x in want] == [torch.float32] * 3
    assert_close_relative(got[0], want[0], 1e-6, "loss")
    for name, a, b in zip(("hidden grad", "weight grad"), got[1:], want[1:], strict=True):
        assert_close_relative(a, b, 2**-6, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_head_with_ntl_under_autocast_multiplies_in_bf16(nv, backend):
    """With NTL: the float64 loss of the bf16-rounded operands' product rounded to bf16 (what autocast's matmul
    gives), and a bf16 hidden state with the fp32 weight (a model under autocast hands the head bf16)."""
    hidden, weight, labels = inputs(nv, seed=1)
    logits64 = (hidden.bfloat16() @ weight.bfloat16().T).double()
    ce_N, ntl_N = reference_rows(logits64, labels, nv, "was", False)
    want = ce_N.sum() / (labels != -100).sum() + 0.3 * ntl_N.sum() / (ntl_N != 0).sum()
    for h in (hidden, hidden.bfloat16()):
        leaf_h, leaf_w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast(**AUTOCAST):
            out = linear_ce_ntl_loss(leaf_h, leaf_w, labels, nv, kind="was", chunk_size=4, backend=backend)
        out.loss.backward()
        assert out.loss.dtype == torch.float32 and leaf_w.grad.dtype == torch.float32 and leaf_h.grad.dtype == h.dtype
        assert_close_relative(out.loss, want, 1e-5, f"loss from {h.dtype} hidden")


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_on_autocast_logits_is_cross_entropy(nv, backend):
    """ce_ntl_loss on the bf16 logits of an autocast nn.Linear: F.cross_entropy's loss and weight gradient."""
    hidden, weight, labels = inputs(nv, seed=2)
    want = grads_of(lambda w: linear_and_cross_entropy(labels)(hidden, w), weight)

    def ours(w):
        with torch.autocast(**AUTOCAST):
            return ce_ntl_loss(F.linear(hidden, w), labels, nv, kind=None, backend=backend).loss

    got = grads_of(ours, weight)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_close_relative(got[0], want[0], 1e-6, "loss")
    assert_close_relative(got[1], want[1], 2**-7, "weight grad")  # bf16 logit gradients, rounded alike


def test_two_dtypes_outside_autocast_are_refused_naming_both(nv):
    hidden, weight, labels = inputs(nv)
    with pytest.raises(TypeError, match=r"hidden \(torch.bfloat16\) and weight \(torch.float32\) must share a dtype"):
        linear_ce_ntl_loss(hidden.bfloat16(), weight, labels, nv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_major_and_strided_logits_give_what_contiguous_ones_do(nv, backend):
    generator = torch.Generator().manual_seed(3)
    labels = inputs(nv)[2]
    column_major = torch.randn(nv.vocab_size, POSITIONS, generator=generator).T
    strided = torch.randn(POSITIONS, 2 * nv.vocab_size, generator=generator)[:, ::2]
    for name, logits in (("column-major", column_major), ("every other column", strided)):
        for kind in (None, "digits"):
            loss = lambda z, k=kind: ce_ntl_loss(z, labels, nv, kind=k, backend=backend).loss  # noqa: E731
            got, want = grads_of(loss, logits), grads_of(loss, logits.contiguous())
            for part, a, b in zip(("loss", "grad"), got, want, strict=True):
                assert_close_relative(a, b, 1e-6, f"{name} {kind=} {part}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_major_hidden_and_weight_give_what_contiguous_ones_do(nv, backend):
    hidden, weight, labels = inputs(nv, seed=4)

    def loss(h, w):
        return linear_ce_ntl_loss(h, w, labels, nv, kind="mse", chunk_size=4, backend=backend).loss

    got = grads_of(loss, hidden.T.contiguous().T, weight.T.contiguous().T)
    want = grads_of(loss, hidden, weight)
    for part, a, b in zip(("loss", "hidden grad", "weight grad"), got, want, strict=True):
        assert_close_relative(a, b, 1e-6, part)


def test_an_infinite_logit_gives_the_same_losses_on_both_backends(nv):
    """+inf at another column: CE is inf (as torch.logsumexp makes it), NTL stays finite, the gradient is NaN at
    that column only; +inf at the label: CE is inf - inf, NaN. The Triton kernels once gave NaN for both."""
    _, _, labels = inputs(nv)
    logits = torch.randn(POSITIONS, nv.vocab_size, generator=torch.Generator().manual_seed(5))
    logits[0, 3] = logits[2, labels[2]] = float("inf")
    results = {}
    for backend in BACKENDS:
        leaf = logits.clone().requires_grad_(True)
        out = ce_ntl_loss(leaf, labels, nv, kind="was", reduction="none", backend=backend)
        (out.ce.sum() + out.ntl.sum()).backward()
        results[backend] = (out.ce.detach(), out.ntl.detach(), leaf.grad[:2])  # row 2's NTL, NaN, spreads NaN
    ce, ntl, grad = results["triton"]
    assert ce[0] == float("inf") and ntl[0].isfinite() and ce[2].isnan()
    assert grad[0].isnan().nonzero().flatten().tolist() == [3]
    for name, a, b in zip(("ce", "ntl", "grad"), results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, msg=name)
