"""linear_ce_ntl_loss against the unchunked path (hidden @ weight.T + ce_ntl_loss) and the float64 reference,
dense and sharded by vocabulary over gloo groups."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import counting_collectives, run_distributed
from helpers.float64_reference import assert_close_relative, reduce_rows, reference_rows
from test_vocab_parallel import BOUNDARIES, synthetic_vocab

from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.loss.ce_ntl import VALUE_KINDS
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform

NTL_WEIGHT = 0.3
HIDDEN = 8
CHUNK_SIZES = (1, 4, 7, None, 1000)
CAPPED = LogitTransform(scale=1.5, softcap=2.0)  # scaled, then soft-capped well inside the logits' range
KIND_CASES = [(k, False) for k in KINDS] + [(k, True) for k in VALUE_KINDS] + [(None, False)]  # reweigh: value kinds


def make_inputs(nv, seed: int, shape=(3, 5), number_fraction=0.5):
    """hidden [*shape, H], weight [V, H] in float64 and labels [*shape] with some numbers and some ignored."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(nv.vocab_size, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, nv.vocab_size, shape, generator=generator)
    numbers = nv.number_ids[torch.randint(0, len(nv.number_ids), shape, generator=generator)]
    draw = torch.rand(shape, generator=generator)
    labels = torch.where(draw < number_fraction, numbers, labels).masked_fill(draw > 0.85, -100)
    return hidden, weight, labels


def leaves(*tensors, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in tensors]


def unchunked(hidden, weight, labels, nv, kind, reweigh, reduction):
    logits = hidden @ weight.T
    out = ce_ntl_loss(logits, labels, nv, kind=kind, ntl_weight=NTL_WEIGHT, reweigh=reweigh, reduction=reduction)
    return parts(out)


def float64_reference(hidden, weight, labels, nv, kind, reweigh, reduction, transform=IDENTITY):
    logits = transform(hidden @ weight.T).reshape(-1, nv.vocab_size)
    ce_N, ntl_N = reference_rows(logits, labels, nv, kind, reweigh)
    ce, ntl = reduce_rows(ce_N, ntl_N, labels, nv, kind, reduction)
    return ce + NTL_WEIGHT * ntl, ce, ntl


def parts(out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return out.loss, out.ce, out.ntl


def loss_and_grads(fn, hidden, weight, upstream=1.0):
    loss, ce, ntl = fn(hidden, weight)
    (upstream * loss).backward()
    return [t.detach() for t in (loss, ce, ntl, hidden.grad, weight.grad)]


@pytest.mark.parametrize("kind,reweigh", KIND_CASES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_equals_unchunked_fp32_and_float64_reference(kind, reweigh, reduction):
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=len(str(kind)) + reweigh)
    for chunk_size in CHUNK_SIZES:
        chunked = lambda h, w, cs=chunk_size: parts(
            linear_ce_ntl_loss(
                h, w, labels, nv, kind=kind, ntl_weight=NTL_WEIGHT, reweigh=reweigh, reduction=reduction, chunk_size=cs
            )
        )
        dense = lambda h, w: unchunked(h, w, labels, nv, kind, reweigh, reduction)
        reference = lambda h, w: float64_reference(h, w, labels, nv, kind, reweigh, reduction)
        got32 = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float32), upstream=1.7)
        want32 = loss_and_grads(dense, *leaves(hidden, weight, dtype=torch.float32), upstream=1.7)
        got64 = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
        want64 = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
        for name, a32, b32, a64, b64 in zip(
            ("loss", "ce", "ntl", "hidden grad", "weight grad"), got32, want32, got64, want64, strict=True
        ):
            assert_close_relative(a32, b32, 1e-5, f"fp32 {name} {chunk_size=}")
            assert_close_relative(a64, b64, 1e-6, f"fp64 {name} {chunk_size=}")


@pytest.mark.parametrize("kind,reweigh", [("was", False), ("mse", True), (None, False)])
def test_logit_scaling_and_soft_capping_equal_float64_reference(kind, reweigh):
    """The transform's chain rule inside the kernel, against autograd through the same operations in float64."""
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=12)
    reference = lambda h, w: float64_reference(h, w, labels, nv, kind, reweigh, "sum", CAPPED)
    want = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
    assert float((hidden @ weight.T).abs().max()) > 3 * CAPPED.softcap  # the cap bites
    for chunk_size in (1, 4, None):
        chunked = lambda h, w, cs=chunk_size: parts(
            linear_ce_ntl_loss(h, w, labels, nv, kind=kind, ntl_weight=NTL_WEIGHT, reweigh=reweigh, reduction="sum",
                               chunk_size=cs, transform=CAPPED)
        )  # fmt: skip
        got = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
        for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
            assert_close_relative(a, b, 1e-6, f"{name} {chunk_size=}")


@pytest.mark.parametrize("number_fraction,ignored", [(0.0, False), (1.0, False), (0.5, True)])
def test_no_numbers_all_numbers_all_ignored(number_fraction, ignored):
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=3, number_fraction=number_fraction)
    if ignored:
        labels = torch.full_like(labels, -100)
    chunked = lambda h, w: parts(linear_ce_ntl_loss(h, w, labels, nv, kind="was", ntl_weight=NTL_WEIGHT, chunk_size=4))
    reference = lambda h, w: float64_reference(h, w, labels, nv, "was", False, "mean")
    got = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float64))
    want = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64))
    for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
        assert_close_relative(a, b, 1e-6, name)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_number_ce_equals_the_dense_loss(reduction):
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=5)
    chunked = linear_ce_ntl_loss(hidden, weight, labels, nv, reduction=reduction, chunk_size=4)
    dense = ce_ntl_loss(hidden @ weight.T, labels, nv, reduction=reduction)
    assert_close_relative(chunked.number_ce, dense.number_ce, 1e-9, "number_ce")


def test_only_loss_is_differentiable_and_given_counts_normalise_mean():
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=5)
    h, w = leaves(hidden, weight, dtype=torch.float64)
    out = linear_ce_ntl_loss(h, w, labels, nv, reduction="mean", num_tokens=100, num_number_tokens=40, chunk_size=4)
    assert out.loss.requires_grad and not out.ce.requires_grad and not out.ntl.requires_grad
    summed = linear_ce_ntl_loss(h, w, labels, nv, reduction="sum")
    torch.testing.assert_close(out.ce, summed.ce / 100)
    torch.testing.assert_close(out.ntl, summed.ntl / 40)
    torch.testing.assert_close(out.loss, out.ce + 0.3 * out.ntl)
    assert (out.num_tokens, out.num_number_tokens) == (summed.num_tokens, summed.num_number_tokens)


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=9)
    (h,) = leaves(hidden, dtype=torch.float64)
    linear_ce_ntl_loss(h, weight, labels, nv, chunk_size=4).loss.backward()
    (h_ref, w_ref) = leaves(hidden, weight, dtype=torch.float64)
    float64_reference(h_ref, w_ref, labels, nv, "was", False, "mean")[0].backward()
    assert weight.grad is None
    assert_close_relative(h.grad, h_ref.grad, 1e-6, "hidden grad")


def test_backpropagating_twice_is_refused():
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=10)
    loss = linear_ce_ntl_loss(*leaves(hidden, weight, dtype=torch.float64), labels, nv).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_without_gradients_gives_the_same_loss():
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=6)
    with torch.no_grad():
        evaluated = linear_ce_ntl_loss(hidden, weight, labels, nv, chunk_size=4)
    trained = linear_ce_ntl_loss(*leaves(hidden, weight, dtype=torch.float64), labels, nv, chunk_size=4)
    torch.testing.assert_close(evaluated.loss, trained.loss.detach())


def test_bf16_inputs_match_fp32_to_bf16_precision():
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=7)
    run = lambda dtype: loss_and_grads(
        lambda h, w: parts(linear_ce_ntl_loss(h, w, labels, nv, chunk_size=4)), *leaves(hidden, weight, dtype=dtype)
    )
    for got, want in zip(run(torch.bfloat16), run(torch.float32), strict=True):
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"reduction": "none"}, "only the combined loss is differentiable"),
        ({"chunk_size": 0}, "chunk_size must be a positive"),
        ({"weight_grad_rows": 0}, "weight_grad_rows must be a positive"),
        ({"weight": torch.zeros(41, 3, dtype=torch.float64)}, "weight must be \\[V, H\\]"),
        ({"labels": torch.zeros(4, dtype=torch.long)}, "leading shape"),
    ],
)
def test_bad_arguments_say_what_was_expected(kwargs, message):
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=8)
    arguments = {"hidden": hidden, "weight": weight, "labels": labels, "nv": nv} | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        linear_ce_ntl_loss(**arguments)


def check_sharded_cases() -> None:
    """Each rank holds rows [lo, hi) of the weight and the same positions; compare with the float64 reference."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = BOUNDARIES[world_size][rank], BOUNDARIES[world_size][rank + 1]
    nv = synthetic_vocab()
    cases = itertools.product(("was", "mse", "digits", None), (False, True), ("sum", "mean"), (4, None))
    for seed, (kind, reweigh, reduction, chunk_size) in enumerate(c for c in cases if c[:2] != ("digits", True)):
        transform = CAPPED if seed % 4 in (1, 2) else IDENTITY
        what = f"world={world_size} rank={rank} {kind=} {reweigh=} {reduction=} {chunk_size=} {transform=}"
        hidden, weight, labels = make_inputs(nv, seed)
        h, w = leaves(hidden, weight[lo:hi], dtype=torch.float64)
        with counting_collectives() as forward_calls:
            out = linear_ce_ntl_loss(
                h,
                w,
                labels,
                nv,
                kind=kind,
                ntl_weight=NTL_WEIGHT,
                reweigh=reweigh,
                reduction=reduction,
                chunk_size=chunk_size,
                group=dist.group.WORLD,
                vocab_start=lo,
                transform=transform,
            )
        with counting_collectives() as backward_calls:
            (1.7 * out.loss).backward()
        chunks = -(-labels.numel() // 4) if chunk_size else 1
        # two per chunk, two for the class pass over all positions (with NTL), one to agree on the chunk size
        expected = 2 * chunks + 2 * (kind is not None) + (chunk_size is None)
        assert forward_calls == Counter(all_reduce=expected), f"{what}: {forward_calls}"
        assert not backward_calls, f"{what}: backward collectives {dict(backward_calls)}"
        hidden_grad = h.grad.clone()
        dist.all_reduce(hidden_grad)
        want = loss_and_grads(
            partial(
                float64_reference,
                labels=labels,
                nv=nv,
                kind=kind,
                reweigh=reweigh,
                reduction=reduction,
                transform=transform,
            ),
            *leaves(hidden, weight, dtype=torch.float64),
            upstream=1.7,
        )
        got = (out.loss, out.ce, out.ntl, hidden_grad, w.grad)
        want[4] = want[4][lo:hi]
        for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
            assert_close_relative(a, b, 1e-6, f"{what} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_vocabulary_equals_float64_reference(world_size):
    run_distributed(check_sharded_cases, world_size)


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Element-wise |got - want| / |want| over the entries at least 1% of the largest (near zero every rounding
    is relatively huge, for either path)."""
    want = want.double()
    significant = want.abs() >= 0.01 * want.abs().max()
    return ((got.double() - want).abs() / want.abs())[significant]


def test_bf16_weight_gradient_is_as_accurate_as_the_dense_bf16_path():
    """2,048 positions in chunks of 4, on inputs that bf16 holds exactly (so the float64 reference is the exact
    gradient of what both paths compute) and logits near zero (the gradient is then mostly cancellation between
    positions). Rounding each chunk's product to bf16 before adding it compounds the error chunk after chunk;
    accumulated in fp32 and rounded once, every element is within one bf16 rounding of float64 (on CPU, where the
    fp32 logit gradient meets the upcast hidden states), and no element is worse than the dense bf16 path's."""
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=11, shape=(32, 64))
    hidden, weight = hidden.bfloat16().double(), (0.01 * weight).bfloat16().double()
    grads = {}
    for name, dtype in (("chunked", torch.bfloat16), ("dense", torch.bfloat16), ("float64", torch.float64)):
        h, w = leaves(hidden, weight, dtype=dtype)
        if name == "chunked":
            linear_ce_ntl_loss(h, w, labels, nv, ntl_weight=NTL_WEIGHT, reduction="sum", chunk_size=4).loss.backward()
        else:
            ce_ntl_loss(h @ w.T, labels, nv, ntl_weight=NTL_WEIGHT, reduction="sum").loss.backward()
        grads[name] = w.grad
    chunked, dense = (relative_errors(grads[name], grads["float64"]) for name in ("chunked", "dense"))
    assert chunked.max() <= 2**-8, float(chunked.max())
    assert chunked.max() <= dense.max(), (float(chunked.max()), float(dense.max()))


@pytest.fixture
def mixed_addmm(monkeypatch):
    """Install an `addmm(..., out_dtype, out=)` overload made of torch ops (one that accumulates in out's dtype, or
    one that rounds the product to the operands' dtype first), count its calls, and probe afresh."""
    from ntl_pretrain.loss import chunked

    plain = torch.addmm

    def install(rounds_to_low: bool) -> Counter:
        calls = Counter()

        def addmm(total, a, b, out_dtype=None, *, out=None):
            if out_dtype is None:
                return plain(total, a, b, out=out)
            calls["out_dtype"] += 1
            product = a @ b if rounds_to_low else a.to(out_dtype) @ b.to(out_dtype)
            return out.copy_(total.to(out_dtype) + product.to(out_dtype))

        monkeypatch.setattr(torch, "addmm", addmm)
        chunked.mixed_addmm_works.cache_clear()
        return calls

    yield install
    chunked.mixed_addmm_works.cache_clear()


def test_mixed_precision_addmm_is_probed_and_used_only_where_it_accumulates_in_fp32(mixed_addmm):
    from ntl_pretrain.loss.chunked import mixed_addmm_works

    cpu = torch.device("cpu")
    assert not mixed_addmm_works(cpu, torch.bfloat16, torch.float32)  # torch has no CPU kernel for the overload
    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=3, shape=(4, 6))
    expected = []
    for rounds_to_low in (None, False, True):  # the real CPU torch, a working overload, a rounding one
        calls = Counter() if rounds_to_low is None else mixed_addmm(rounds_to_low)
        h, w = leaves(hidden, 0.1 * weight, dtype=torch.bfloat16)
        linear_ce_ntl_loss(h, w, labels, nv, ntl_weight=NTL_WEIGHT, chunk_size=5).loss.backward()
        expected.append(w.grad)
        assert mixed_addmm_works(cpu, torch.bfloat16, torch.float32) is (rounds_to_low is False)
        # the probe's call, then (working overload) one for all 24 positions: where bf16 products accumulate in fp32,
        # the chunks' logit gradients wait for one weight-gradient matmul (WEIGHT_GROUP_ELEMENTS)
        assert calls["out_dtype"] == {None: 0, False: 1 + 1, True: 1}[rounds_to_low]
    torch.testing.assert_close(expected[2], expected[0], rtol=0, atol=0)  # refused: the upcast path ran
    # the working overload multiplies the bf16-rounded logit gradient: one bf16 rounding of the operand apart
    torch.testing.assert_close(expected[1], expected[0], rtol=2**-7, atol=2**-8 * float(expected[0].abs().max()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_weight_gradient_in_groups_of_chunks_is_the_same_sum(dtype, monkeypatch):
    """24 positions in chunks of 5 (the last one of 4), their weight gradient in matmuls of whole chunks: one per
    chunk, 2 or 3 chunks (a group cut short at the end), all at once; 7 rows round down to one chunk. Every way
    gives the chunk-by-chunk gradient up to the order of the sum (bf16: the fp32 accumulator, upcast operands)."""
    from ntl_pretrain.loss import chunked

    nv = synthetic_vocab()
    hidden, weight, labels = make_inputs(nv, seed=5, shape=(4, 6))
    matmuls = Counter()
    accumulate = chunked._accumulate_product

    def counted(total_VH, a_VR, low_a_VR, b_RH):
        matmuls[b_RH.shape[0]] += 1
        return accumulate(total_VH, a_VR, low_a_VR, b_RH)

    monkeypatch.setattr(chunked, "_accumulate_product", counted)
    grads = {}
    for group_rows, expected in [(5, {5: 4, 4: 1}), (7, {5: 4, 4: 1}), (10, {10: 2, 4: 1}), (15, {15: 1, 9: 1}),
                                 (1000, {24: 1})]:  # fmt: skip
        matmuls.clear()
        h, w = leaves(hidden, 0.1 * weight, dtype=dtype)
        linear_ce_ntl_loss(h, w, labels, nv, ntl_weight=NTL_WEIGHT, chunk_size=5, weight_grad_rows=group_rows,
                           reduction="sum").loss.backward()  # fmt: skip
        assert matmuls == Counter(expected), (group_rows, matmuls)
        grads[group_rows] = (w.grad.double(), h.grad.double())
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2**-8}[dtype]
    for group_rows, (weight_grad, hidden_grad) in grads.items():
        assert_close_relative(weight_grad, grads[5][0], tolerance, f"weight grad {group_rows=}")
        torch.testing.assert_close(hidden_grad, grads[5][1], rtol=0, atol=0)  # untouched by the grouping


def test_a_micro_batch_of_the_chunked_head_needs_no_host_sync(monkeypatch):
    """On the meta device every data-dependent host read (`.item()`, `int()`, `nonzero`) raises, and here so does
    every tensor made from Python numbers on a device (a host-to-device copy, which waits for the device): the
    trainer's global counts (`train.head_normalisers`, one device tensor per step) go through forward and backward
    of every kind without either. The Python numbers the trainer used to pass cost two copies per micro-batch."""
    from ntl_pretrain.config.recipe import NtlConfig
    from ntl_pretrain.heads import ChunkedHead
    from ntl_pretrain.train.trainer import head_normalisers

    def host_to_device_refused(make):
        def strict(data, *args, device=None, **kwargs):
            if device is not None and torch.device(device).type != "cpu" and not torch.is_tensor(data):
                raise AssertionError(f"host-to-device copy of {data!r}")
            return make(data, *args, device=device, **kwargs)

        return strict

    nv = synthetic_vocab()
    output_layer = torch.nn.Linear(HIDDEN, nv.vocab_size, bias=False, device="meta")
    counts = torch.tensor([37.0, 11.0, 64.0], dtype=torch.float64)  # as Trainer._global_counts returns them
    normalisers = head_normalisers(counts, torch.device("meta"))
    monkeypatch.setattr(torch, "as_tensor", host_to_device_refused(torch.as_tensor))
    monkeypatch.setattr(torch, "tensor", host_to_device_refused(torch.tensor))
    for kind in ("was", "number", None):
        head = ChunkedHead(output_layer, nv, NtlConfig(kind=kind), chunk_size=3)
        hidden = torch.randn(2, 5, HIDDEN, device="meta", requires_grad=True)
        labels = torch.zeros(2, 5, dtype=torch.long, device="meta")
        head(hidden, labels, normalisers[0], normalisers[1]).loss.backward()
        assert hidden.grad.shape == hidden.shape and output_layer.weight.grad.shape == output_layer.weight.shape
        output_layer.weight.grad = None
    with pytest.raises(AssertionError, match="host-to-device copy of 37.0"):
        head(hidden, labels, 37.0, 11.0)
