"""The Triton kernels at vocabulary widths that are not multiples of 16 (GPT-2's 50,257, BERT's 30,522, o200k's
199,999 in miniature: 257 and 1,003 columns), through Triton's interpreter, against the float64 reference.

Each row is read in whole 16-byte vectors, its ragged head and tail apart (loss/triton_kernels.py): rows of such a
width start at every offset modulo a vector, and strided views of wider logits shift them again. The row blocks
and class blocks are made small here (64 columns, 16 members), so that the loops take several trips, the last one
part-masked, and the 90-member class of two-digit tokens is more than one class block. The interpreter ignores
alignment hints, so the claims they rest on are checked on their own (`_row_split`, `_edge_columns`).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers.float64_reference import assert_close_relative, reference_rows
from test_chunked import float64_reference, leaves, loss_and_grads, make_inputs
from test_loss_triton import interpreted_kernels, labelled_batch

from ntl_pretrain.loss import ce_ntl_loss
from ntl_pretrain.loss.ce_ntl import ce_ntl_training_loss
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

kernels = interpreted_kernels()
WIDTHS = (257, 1003)
KINDS_CHECKED = {257: (None, "was", "mse", "digits", "number"), 1003: ("was", "number")}
"""Every kind's path through the kernels at the narrower width; the wider costs the interpreter more a row."""
G_CE, G_NTL, UPSTREAM = 0.7, -1.3, 1.7
NTL_WEIGHT = 0.3


def ragged_vocab(width: int) -> NumberVocab:
    """Words, the ten digits, two space-marked digits, the 90 two-digit chunks and two three-digit ones."""
    numbers = [str(d) for d in range(10)] + ["Ġ3", "Ġ4"] + [str(n) for n in range(10, 100)] + ["123", "900"]
    return NumberVocab.from_surfaces(["<pad>", "a", *numbers] + [f"w{i}" for i in range(width - 2 - len(numbers))])


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    from ntl_pretrain.loss import triton_ops

    monkeypatch.setattr(triton_ops, "MAX_BLOCK_V", 64)
    monkeypatch.setattr(triton_ops, "MAX_BLOCK_M", 16)


@triton.jit
def _split_kernel(row_start_ptr, num_columns, out_ptr, VECTOR: tl.constexpr):
    row_start = tl.load(row_start_ptr + tl.program_id(0))
    head, body_end = kernels._row_split(row_start, num_columns, VECTOR)
    columns, inside = kernels._edge_columns(head, body_end, num_columns, VECTOR)
    out = out_ptr + tl.program_id(0) * (2 + 4 * VECTOR)
    tl.store(out, head)
    tl.store(out + 1, body_end)
    tl.store(out + 2 + tl.arange(0, 2 * VECTOR), columns)
    tl.store(out + 2 + 2 * VECTOR + tl.arange(0, 2 * VECTOR), inside.to(tl.int64))


@pytest.mark.parametrize("vector", [4, 8])
def test_rows_split_into_aligned_vectors_and_edges_that_cover_them_once(vector):
    """What the kernels' alignment hints claim: the body starts on a vector boundary and holds whole vectors, and
    body plus edges are every column of the row exactly once; for every start offset and width up to 2 vectors."""
    row_starts = torch.arange(0, vector + 1, dtype=torch.int64)
    for num_columns in range(2 * vector + 2):
        out = torch.zeros(len(row_starts), 2 + 4 * vector, dtype=torch.int64)
        _split_kernel[(len(row_starts),)](row_starts, num_columns, out, VECTOR=vector)
        for row_start, (head, body_end, *edges) in zip(row_starts.tolist(), out.tolist(), strict=True):
            what = f"{row_start=} {num_columns=} {head=} {body_end=}"
            assert (row_start + head) % vector == 0 and 0 <= head < vector, what
            assert (body_end - head) % vector == 0 and body_end >= head, what
            assert body_end <= num_columns or body_end == head, what
            edge_columns = [c for c, inside in zip(edges[: 2 * vector], edges[2 * vector :], strict=True) if inside]
            covered = sorted(edge_columns + list(range(head, body_end)))
            assert covered == list(range(num_columns)), what


def _leaf_and_logits(logits_NV: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(the leaf that takes the gradient, the logits read from it, their columns in it): the logits themselves, or
    the same values as a view into wider rows starting one element in (row stride and row starts off a vector)."""
    columns = slice(1, 1 + logits_NV.shape[1]) if shifted else slice(None)
    leaf = torch.zeros(logits_NV.shape[0], logits_NV.shape[1] + 3 * shifted, dtype=logits_NV.dtype)
    leaf[:, columns] = logits_NV
    leaf.requires_grad_(True)
    return leaf, leaf[:, columns], columns


@pytest.mark.parametrize("width", WIDTHS)
def test_dense_losses_at_ragged_widths_equal_the_float64_reference(width):
    """`ce_ntl_loss` (gradient in backward) on contiguous and strided logits, and `ce_ntl_training_loss` (gradient
    formed in forward, scaled by an upstream factor), per kind, against autograd through the float64 reference."""
    nv = ragged_vocab(width)
    for seed, kind in enumerate(KINDS_CHECKED[width]):
        logits, labels, _, _ = labelled_batch(nv, seed, shape=(2, 3))
        logits_NV, labels_N = logits.reshape(-1, width), labels.reshape(-1)
        reference = logits_NV.double().requires_grad_(True)
        ce_N, ntl_N = reference_rows(reference, labels_N, nv, kind, False)
        (G_CE * ce_N.sum() + G_NTL * ntl_N.sum()).backward(retain_graph=True)
        leaf, logits_read, columns = _leaf_and_logits(logits_NV, shifted=seed % 2 == 1)
        out = ce_ntl_loss(logits_read, labels_N, nv, kind=kind, reduction="none", backend="triton")
        (G_CE * out.ce.sum() + G_NTL * out.ntl.sum()).backward()
        what = f"{width=} {kind=} ce_ntl_loss"
        assert_close_relative(out.ce, ce_N, 2e-5, f"{what} ce")
        assert_close_relative(out.ntl, ntl_N, 2e-5, f"{what} ntl")
        assert_close_relative(leaf.grad[:, columns], reference.grad, 2e-5, f"{what} grad")

        reference.grad = None
        terms = float((ntl_N != 0).sum()) + 1.0  # counts of the global batch, not this call's
        (UPSTREAM * (ce_N.sum() / 5.0 + NTL_WEIGHT * ntl_N.sum() / terms)).backward()
        leaf = logits_NV.clone().requires_grad_(True)
        out = ce_ntl_training_loss(leaf, labels_N, nv, kind=kind, ntl_weight=NTL_WEIGHT, num_tokens=5.0,
                                   num_number_tokens=terms, backend="triton")  # fmt: skip
        (UPSTREAM * out.loss).backward()
        what = f"{width=} {kind=} ce_ntl_training_loss"
        assert_close_relative(out.ce, ce_N.sum(), 2e-5, f"{what} ce")
        assert_close_relative(out.ntl, ntl_N.sum(), 2e-5, f"{what} ntl")
        assert_close_relative(leaf.grad, reference.grad, 2e-5, f"{what} grad")
        if kind is not None:
            assert float(ntl_N.detach().abs().sum()) > 0, f"{what}: no NTL term was tested"


@pytest.mark.parametrize("width", WIDTHS)
def test_chunked_head_at_ragged_widths_equals_the_float64_reference(width):
    """The head's fused kernel writes each chunk's gradient over its logits, keeping the class members' logits in
    its stash; classes of 90 members take six class blocks."""
    nv = ragged_vocab(width)
    for seed, (kind, reweigh) in enumerate([("was", False), ("digits", False), ("mse", True), ("number", False)]):
        hidden, weight, labels = make_inputs(nv, seed=seed, shape=(2, 3), number_fraction=0.8)

        def chunked(h, w, kind=kind, reweigh=reweigh, labels=labels):
            out = linear_ce_ntl_loss(h, w, labels, nv, kind=kind, reweigh=reweigh, reduction="sum", chunk_size=4,
                                     backend="triton")  # fmt: skip
            return out.loss, out.ce, out.ntl

        def reference(h, w, kind=kind, reweigh=reweigh, labels=labels):
            return float64_reference(h, w, labels, nv, kind, reweigh, "sum")

        got = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float32), upstream=UPSTREAM)
        want = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64), upstream=UPSTREAM)
        for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
            assert_close_relative(a, b, 1e-5, f"{width=} {kind=} {reweigh=} {name}")


def test_reweighing_and_bf16_logits_at_a_ragged_width_match_the_torch_backend():
    """The training loss's two-pass path (reweighing needs every row's log-sum-exp first), and bf16 logits (vectors
    of 8), against the torch backend on the same inputs."""
    nv = ragged_vocab(WIDTHS[1])
    for dtype, kind, reweigh in [(torch.float32, "mse", True), (torch.bfloat16, "was", False)]:
        logits, labels, _, _ = labelled_batch(nv, 7, shape=(2, 3), dtype=dtype)
        results = []
        for backend in ("triton", "torch"):
            leaf = logits.reshape(-1, nv.vocab_size).clone().requires_grad_(True)
            out = ce_ntl_training_loss(leaf, labels.reshape(-1), nv, kind=kind, reweigh=reweigh, backend=backend)
            (UPSTREAM * out.loss).backward()
            results.append((out.loss.detach(), leaf.grad.float()))
        (loss, grad), (want_loss, want_grad) = results
        assert_close_relative(loss, want_loss, 1e-5, f"{dtype} {kind=} loss")
        if dtype == torch.float32:
            assert_close_relative(grad, want_grad, 1e-5, f"{dtype} {kind=} grad")
        else:  # both round the same fp32 gradient to bf16: at most one bf16 step apart
            torch.testing.assert_close(grad, want_grad, rtol=2**-7, atol=2**-8 * float(want_grad.abs().max()))


def test_the_training_loss_keeps_the_gradient_not_the_logits():
    """Autograd saves no [N, V] tensor for backward (the logits may be freed after forward); the formed gradient
    serves one backward pass."""
    nv = ragged_vocab(WIDTHS[0])
    logits, labels, _, _ = labelled_batch(nv, 3, shape=(2, 3))
    leaf = logits.reshape(-1, nv.vocab_size).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = ce_ntl_training_loss(leaf, labels.reshape(-1), nv, kind="was", backend="triton")
    assert tuple(leaf.shape) not in saved, saved
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="formed for one backward pass"):
        out.loss.backward()


def test_logits_grad_refuses_a_buffer_overlapping_the_logits():
    """In place (the logits themselves) and a separate buffer, also one in the same storage, are taken; a buffer
    that shares some of the logits' memory would read what it already overwrote, and is refused."""
    from ntl_pretrain.loss import triton_ops

    rows, width = 3, 37
    storage = torch.randn(3 * rows, width)
    logits = storage[:rows]
    lse = torch.logsumexp(logits, 1)
    args = (lse, torch.ones(rows), torch.tensor([0, 5, -1]), torch.full((rows,), -1.0), None)
    want = torch.softmax(logits, 1)
    want[0, 0] -= 1
    want[1, 5] -= 1
    separate = storage[2 * rows :]
    triton_ops.logits_grad(logits, separate, *args)
    torch.testing.assert_close(separate, want)
    for overlapping in (storage[1 : rows + 1], storage.view(-1)[width // 2 :][: rows * width].view(rows, width)):
        with pytest.raises(ValueError, match="shares memory with the logits"):
            triton_ops.logits_grad(logits, overlapping, *args)
    triton_ops.logits_grad(logits, logits, *args)
    torch.testing.assert_close(logits, want)
