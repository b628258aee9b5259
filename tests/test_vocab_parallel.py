"""ce_ntl_loss sharded by vocabulary over gloo groups of 2, 3 and 4 ranks against the float64 dense reference.

Each world size is one spawn; every case (kind, reweigh, reduction, dtype, batch composition) runs inside it.
The shards are uneven, a number class straddles a shard boundary and the last shard holds no number token.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from distributed import counting_collectives, run_distributed
from float64_reference import assert_close_relative, reduce_rows, reference_rows

from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.numbers import NumberVocab

NTL_WEIGHT = 0.3
# 41 ids: words, the ten digits, space-marked digits, 2- and 3-digit chunks, then words only.
SURFACES = (
    ["<pad>", "a"]
    + [str(d) for d in range(10)]
    + ["Ġ3", "Ġ4", "Ġ5", "Ġ8"]
    + ["10", "25", "42", "99", "07"]
    + ["123", "900"]
    + [f"w{i}" for i in range(18)]
)
# Uneven shard boundaries per world size; the last shard has no number token, and with 3 and 4 ranks the digit
# class straddles a shard boundary.
BOUNDARIES = {2: [0, 26, 41], 3: [0, 9, 25, 41], 4: [0, 5, 14, 30, 41]}
BATCHES = ("mixed", "no_numbers", "all_numbers", "all_ignored")


def synthetic_vocab() -> NumberVocab:
    return NumberVocab.from_surfaces(SURFACES)


def make_batch(nv: NumberVocab, composition: str, seed: int, shape=(3, 5)) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits [*shape, V] and labels [*shape]; identical on every rank (same seed)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, nv.vocab_size, generator=generator, dtype=torch.float64)
    numbers = nv.number_ids[torch.randint(0, len(nv.number_ids), shape, generator=generator)]
    words = torch.nonzero(nv.classes < 0).flatten()
    words = words[torch.randint(0, len(words), shape, generator=generator)]
    draw = torch.rand(shape, generator=generator)
    labels = {
        "mixed": torch.where(draw < 0.5, numbers, words).masked_fill(draw > 0.85, -100),
        "no_numbers": words.masked_fill(draw > 0.8, -100),
        "all_numbers": numbers,
        "all_ignored": torch.full(shape, -100),
    }[composition]
    return logits, labels


def upstream_gradients(shape, reduction: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct upstream gradients for CE and NTL so that a mix-up between them shows."""
    generator = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.randn(shape, generator=generator, dtype=torch.float64), torch.randn(
            shape, generator=generator, dtype=torch.float64
        )
    return torch.tensor(0.7, dtype=torch.float64), torch.tensor(-1.3, dtype=torch.float64)


def check_case(nv, kind, reweigh, reduction, dtype, composition, seed) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = BOUNDARIES[world_size][rank], BOUNDARIES[world_size][rank + 1]
    full_logits, labels = make_batch(nv, composition, seed)
    g_ce, g_ntl = upstream_gradients(labels.shape, reduction, seed)
    what = f"world={world_size} rank={rank} {kind=} {reweigh=} {reduction=} {dtype=} {composition=}"

    local = full_logits[..., lo:hi].to(dtype).requires_grad_(True)
    with counting_collectives() as forward_calls:
        out = ce_ntl_loss(
            local,
            labels,
            nv,
            kind=kind,
            weight=NTL_WEIGHT,
            reweigh=reweigh,
            reduction=reduction,
            group=dist.group.WORLD,
            vocab_start=lo,
        )
    with counting_collectives() as backward_calls:
        ((out.ce * g_ce.to(dtype)).sum() + (out.ntl * g_ntl.to(dtype)).sum()).backward()
    assert forward_calls == Counter(all_reduce=2), f"{what}: forward collectives {dict(forward_calls)}"
    assert not backward_calls, f"{what}: backward collectives {dict(backward_calls)}"

    reference_logits = full_logits.detach().clone().requires_grad_(True)
    ce_N, ntl_N = reference_rows(reference_logits.reshape(-1, nv.vocab_size), labels.reshape(-1), nv, kind, reweigh)
    ref_ce, ref_ntl = reduce_rows(ce_N.view(labels.shape), ntl_N.view(labels.shape), labels, nv, kind, reduction)
    ((ref_ce * g_ce).sum() + (ref_ntl * g_ntl).sum()).backward()

    relative = 1e-6 if dtype == torch.float64 else 1e-4
    assert_close_relative(out.ce, ref_ce, relative, f"{what} ce")
    assert_close_relative(out.ntl, ref_ntl, relative, f"{what} ntl")
    assert_close_relative(out.loss, ref_ce + NTL_WEIGHT * ref_ntl, relative, f"{what} loss")
    assert_close_relative(local.grad, reference_logits.grad[..., lo:hi], relative, f"{what} grad")


def check_all_cases() -> None:
    nv = synthetic_vocab()
    cases = [(kind, reweigh) for kind in KINDS for reweigh in (False, True)] + [(None, False)]
    dtypes, reductions = (torch.float64, torch.float32), ("mean", "sum", "none")
    for seed, ((kind, reweigh), reduction, dtype, composition) in enumerate(
        itertools.product(cases, reductions, dtypes, BATCHES)
    ):
        check_case(nv, kind, reweigh, reduction, dtype, composition, seed)


def test_synthetic_vocab_has_the_shapes_the_cases_need():
    nv = synthetic_vocab()
    assert nv.vocab_size == 41 and all(41 % k for k in BOUNDARIES)
    digits = torch.nonzero(nv.classes == nv.classes[SURFACES.index("0")]).flatten()
    for world_size, bounds in BOUNDARIES.items():
        assert (nv.classes[bounds[-2] :] < 0).all(), "the last shard must hold no number token"
        if world_size > 2:
            assert any(digits[0] < bound <= digits[-1] for bound in bounds), "digits must straddle a shard boundary"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_vocab_parallel_equals_dense_float64_reference(world_size):
    run_distributed(check_all_cases, world_size)
