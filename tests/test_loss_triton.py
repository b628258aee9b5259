"""The Triton backend (loss/triton_kernels.py) on CPU through Triton's interpreter, against the float64 reference:
every kind, the repository's real tokenizers (single digits, 1-3-digit chunks, Llama-3's), ignored positions,
answer-only NTL labels, gradients, bf16 logits, the chunked head with logit scaling and soft-capping, and
vocabulary-parallel shards on 2 gloo ranks (one launch for all their cases).

triton 3.x reads TRITON_INTERPRET when it is first imported, when `@triton.jit` decorates a kernel and at launch:
tests/conftest.py sets it for the session before anything imports triton, and the spawned ranks inherit it. The
interpreter runs each program's block operations in numpy, so the shapes are small.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from functools import partial

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import counting_collectives, run_distributed
from helpers.float64_reference import assert_close_relative, reference_rows
from helpers.launches import REPO
from helpers.real_tokenizers import real_tokenizer
from test_chunked import CAPPED, float64_reference, leaves, loss_and_grads, make_inputs
from test_vocab_parallel import BOUNDARIES, synthetic_vocab

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.loss.backend import KERNELS_MODULE, resolve_backend
from ntl_pretrain.loss.ce_ntl import VALUE_KINDS
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.preflight.world import check_loss_backend
from ntl_pretrain.tokenizer import load_tokenizer

KIND_CASES = [(kind, False) for kind in KINDS] + [(kind, True) for kind in VALUE_KINDS] + [(None, False)]
TOKENIZERS = {
    "tiny-1digit": lambda: load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer"),
    "tiny-3digit": lambda: load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit"),
    "llama3": lambda: real_tokenizer("llama3"),
}
G_CE, G_NTL = 0.7, -1.3  # distinct upstream gradients, so that a mix-up between CE and NTL shows
POSITIONS, CHUNK = (2, 4), 3  # the chunked head's cases: 8 positions in chunks of 3, 3, 2
SOME_CASES = [("was", False), ("digits", False), ("mse", True), ("number", False), (None, False)]
"""Where the kinds' own math is tested already: every path through the kernels (distance and expectation features,
reweighing, the number-level slope, CE only)."""


def interpreted_kernels():
    """The kernels module, decorated for the interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 for the session"
    kernels = importlib.import_module(KERNELS_MODULE)
    assert kernels.INTERPRETED, f"{KERNELS_MODULE} was imported before TRITON_INTERPRET=1 was set"
    return kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return interpreted_kernels()


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def number_vocab(request) -> NumberVocab:
    return NumberVocab.from_tokenizer(TOKENIZERS[request.param]())


def labelled_batch(nv: NumberVocab, seed: int, shape=(2, 4), dtype=torch.float32):
    """Logits [*shape, V], labels with numbers in runs, other tokens and ignored positions, and answer-only NTL
    labels (each ignores some labels the other keeps, as packing's label roles do)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, nv.vocab_size, generator=generator)
    numbers = nv.number_ids[torch.randint(0, len(nv.number_ids), shape, generator=generator)]
    words = torch.nonzero(nv.classes < 0).flatten()
    words = words[torch.randint(0, len(words), shape, generator=generator)]
    draw = torch.rand(shape, generator=generator)
    labels = torch.where(draw < 0.6, numbers, words).masked_fill(draw > 0.9, -100)
    roles = torch.rand(shape, generator=generator)
    ce_labels, ntl_labels = labels.masked_fill(roles < 0.2, -100), labels.masked_fill(roles > 0.8, -100)
    return logits.to(dtype), labels, ce_labels, ntl_labels


def dense_values_and_grad(logits, labels, nv, kind, reweigh, backend, ntl_labels=None):
    leaf = logits.detach().clone().requires_grad_(True)
    out = ce_ntl_loss(leaf, labels, nv, kind=kind, reweigh=reweigh, reduction="none", ntl_labels=ntl_labels,
                      backend=backend)  # fmt: skip
    (G_CE * out.ce.sum() + G_NTL * out.ntl.sum()).backward()
    return out.ce.detach().reshape(-1), out.ntl.detach().reshape(-1), leaf.grad


def reference_values_and_grad(logits, ce_labels, nv, kind, reweigh, ntl_labels=None):
    leaf = logits.detach().double().requires_grad_(True)
    logits_NV = leaf.reshape(-1, nv.vocab_size)
    ce_N, _ = reference_rows(logits_NV, ce_labels, nv, kind, reweigh)
    _, ntl_N = reference_rows(logits_NV, ce_labels if ntl_labels is None else ntl_labels, nv, kind, reweigh)
    (G_CE * ce_N.sum() + G_NTL * ntl_N.sum()).backward()
    return ce_N.detach(), ntl_N.detach(), leaf.grad


def chunked_parts(h, w, labels, nv, kind, reweigh, **options):
    out = linear_ce_ntl_loss(h, w, labels, nv, kind=kind, reweigh=reweigh, reduction="sum", chunk_size=CHUNK,
                             backend="triton", **options)  # fmt: skip
    return out.loss, out.ce, out.ntl


def test_the_kernels_module_is_interpreted_and_auto_keeps_torch_on_cpu(kernels):
    assert kernels.INTERPRETED
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == "torch"  # the interpreter is for tests, not for CPU runs
    assert resolve_backend("triton", cpu, torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="backend: triton cannot run here: its kernels compute in fp32"):
        resolve_backend("triton", cpu, torch.float64)
    with pytest.raises(ValueError, match="loss.backend must be one of"):
        resolve_backend("cuda", cpu, torch.float32, key="loss.backend")


def test_dense_loss_equals_the_float64_reference_for_every_kind(number_vocab):
    """Per-position CE and NTL and the logits' gradient, with ignored positions; NTL on all labels, or (every other
    case) on answer labels only, the CE labels then differing from the NTL ones."""
    nv = number_vocab
    # reweighing and CE only on the tiny tokenizers; Llama-3's 128,256 columns cost the interpreter seconds a case
    cases = [(kind, False) for kind in KINDS] if nv.vocab_size > 100_000 else KIND_CASES
    for seed, (kind, reweigh) in enumerate(cases):
        logits, labels, ce_labels, ntl_labels = labelled_batch(nv, seed)
        answers = seed % 2 == 1
        what = f"{kind=} {reweigh=} {answers=}"
        ce_given, ntl_given = (ce_labels, ntl_labels) if answers else (labels, None)
        got = dense_values_and_grad(logits, ce_given, nv, kind, reweigh, "triton", ntl_given)
        want = reference_values_and_grad(logits, ce_given, nv, kind, reweigh, ntl_given)
        for name, a, b in zip(("ce", "ntl", "grad"), got, want, strict=True):
            assert_close_relative(a, b, 2e-5, f"{what} {name}")
        if kind is not None:
            assert float(got[1].abs().sum()) > 0, f"{what}: no NTL term was tested"


def test_bf16_logits_are_computed_in_fp32_as_the_torch_backend_does():
    nv = NumberVocab.from_tokenizer(TOKENIZERS["tiny-3digit"]())
    for seed, kind in enumerate(("was", "digits", "number")):
        logits, labels, _, _ = labelled_batch(nv, seed, dtype=torch.bfloat16)
        got = dense_values_and_grad(logits, labels, nv, kind, False, "triton")
        want = dense_values_and_grad(logits, labels, nv, kind, False, "torch")
        assert got[2].dtype == torch.bfloat16
        for name, a, b in zip(("ce", "ntl"), got[:2], want[:2], strict=True):
            assert_close_relative(a, b, 1e-5, f"{kind} {name}")
        # both round the same fp32 gradient to bf16: at most one bf16 step apart
        torch.testing.assert_close(got[2], want[2], rtol=2**-7, atol=2**-8 * float(want[2].abs().max()))


@pytest.mark.parametrize("transform", [None, CAPPED], ids=["plain", "scaled-capped"])
def test_chunked_head_equals_the_float64_reference(transform, monkeypatch):
    """linear_ce_ntl_loss in chunks, its gradient written over each chunk's logits by the kernel (which applies the
    transform and its chain rule), against autograd through the float64 reference. Rows of 41 columns in blocks of
    16 and classes of up to 10 members in blocks of 4: the kernels' online log-sum-exps run over several blocks, the
    last one part-masked."""
    from ntl_pretrain.loss import triton_ops

    monkeypatch.setattr(triton_ops, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(triton_ops, "MAX_BLOCK_M", 4)
    nv = synthetic_vocab()
    extra = {} if transform is None else {"transform": transform}
    for seed, (kind, reweigh) in enumerate(KIND_CASES if transform is None else SOME_CASES):
        hidden, weight, labels = make_inputs(nv, seed=seed, shape=POSITIONS)
        what = f"{kind=} {reweigh=} {transform=}"
        chunked = partial(chunked_parts, labels=labels, nv=nv, kind=kind, reweigh=reweigh, **extra)
        reference = partial(float64_reference, labels=labels, nv=nv, kind=kind, reweigh=reweigh, reduction="sum",
                            **extra)  # fmt: skip
        got = loss_and_grads(chunked, *leaves(hidden, weight, dtype=torch.float32), upstream=1.7)
        want = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
        for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
            assert_close_relative(a, b, 1e-5, f"{what} {name}")


def test_chunked_head_in_bf16_matches_the_torch_backend():
    """bf16 hidden states and weight: the kernel reads the bf16 chunk and writes its bf16 gradient in place."""
    nv = NumberVocab.from_tokenizer(TOKENIZERS["tiny-3digit"]())
    hidden, weight, labels = make_inputs(nv, seed=3, shape=(4, 6))
    results = {}
    for backend in ("triton", "torch"):
        h = hidden.bfloat16().requires_grad_(True)
        w = (0.1 * weight).bfloat16().requires_grad_(True)
        out = linear_ce_ntl_loss(h, w, labels, nv, kind="digits", chunk_size=5, backend=backend)
        out.loss.backward()
        results[backend] = (out.loss.detach(), h.grad.float(), w.grad.float())
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-7 * float(b.abs().max()), msg=name)


def test_triton_where_it_cannot_run_is_refused_before_launch(monkeypatch):
    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml", ["loss.backend=triton"])
    check_loss_backend(recipe)  # TRITON_INTERPRET=1 (this session's): the ranks would interpret the kernels on CPU
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RecipeError, match=r"^loss.backend: triton cannot run here: its kernels run on CUDA GPUs, and "
                                          r"this is the CPU .*; use auto or torch$"):  # fmt: skip
        check_loss_backend(recipe)
    check_loss_backend(load_recipe(REPO / "recipes" / "tiny-cpu.yaml", ["loss.backend=auto"]))


def check_sharded_cases() -> None:
    """Each rank holds columns [lo, hi) of the vocabulary (uneven; the last rank no number token): ce_ntl_loss on
    its logits for every kind, and linear_ce_ntl_loss on its rows of the weight in chunks, against the float64
    reference of the whole vocabulary, with the collectives the design allows (none in backward)."""
    interpreted_kernels()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = BOUNDARIES[world_size][rank], BOUNDARIES[world_size][rank + 1]
    nv = synthetic_vocab()
    for seed, (kind, reweigh) in enumerate(KIND_CASES):
        check_sharded_dense(nv, kind, reweigh, seed, lo, hi)
    for seed, (kind, reweigh) in enumerate(SOME_CASES):
        check_sharded_chunked(nv, kind, reweigh, seed, lo, hi)


def check_sharded_dense(nv, kind, reweigh, seed, lo, hi) -> None:
    what = f"rank={dist.get_rank()} dense {kind=} {reweigh=}"
    logits, labels, _, _ = labelled_batch(nv, seed)
    local = logits[..., lo:hi].clone().requires_grad_(True)
    with counting_collectives() as calls:
        out = ce_ntl_loss(local, labels, nv, kind=kind, reweigh=reweigh, reduction="none", group=dist.group.WORLD,
                          vocab_start=lo, backend="triton")  # fmt: skip
    assert calls == Counter(all_reduce=2), f"{what}: {calls}"
    with counting_collectives() as calls:
        (G_CE * out.ce.sum() + G_NTL * out.ntl.sum()).backward()
    assert not calls, f"{what}: backward collectives {calls}"
    ce_N, ntl_N, grad = reference_values_and_grad(logits, labels, nv, kind, reweigh)
    assert_close_relative(out.ce.reshape(-1), ce_N, 2e-5, f"{what} ce")
    assert_close_relative(out.ntl.reshape(-1), ntl_N, 2e-5, f"{what} ntl")
    assert_close_relative(local.grad, grad[..., lo:hi], 2e-5, f"{what} grad")


def check_sharded_chunked(nv, kind, reweigh, seed, lo, hi) -> None:
    transform = {"transform": CAPPED} if seed % 2 else {}
    what = f"rank={dist.get_rank()} chunked {kind=} {reweigh=} {transform=}"
    hidden, weight, labels = make_inputs(nv, seed=seed, shape=POSITIONS)
    h, w = leaves(hidden, weight[lo:hi], dtype=torch.float32)
    with counting_collectives() as calls:
        loss, ce, ntl = chunked_parts(h, w, labels, nv, kind, reweigh, group=dist.group.WORLD, vocab_start=lo,
                                      **transform)  # fmt: skip
    chunks = -(-labels.numel() // CHUNK)  # two all-reduces a chunk, two for the class pass (with NTL)
    assert calls == Counter(all_reduce=2 * chunks + 2 * (kind is not None)), f"{what}: {calls}"
    (1.7 * loss).backward()
    hidden_grad = h.grad.clone()
    dist.all_reduce(hidden_grad)
    reference = partial(float64_reference, labels=labels, nv=nv, kind=kind, reweigh=reweigh, reduction="sum",
                        **transform)  # fmt: skip
    want = loss_and_grads(reference, *leaves(hidden, weight, dtype=torch.float64), upstream=1.7)
    want[4] = want[4][lo:hi]
    got = (loss, ce, ntl, hidden_grad, w.grad)
    for name, a, b in zip(("loss", "ce", "ntl", "hidden grad", "weight grad"), got, want, strict=True):
        assert_close_relative(a, b, 1e-5, f"{what} {name}")


@pytest.mark.slow
def test_vocabulary_parallel_shards_on_two_ranks_equal_the_float64_reference():
    run_distributed(check_sharded_cases, 2, timeout_s=300)
