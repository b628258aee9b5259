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
from helpers.distributed import counting_collectives, run_distributed
from helpers.float64_reference import assert_close_relative, count_ntl_terms, reduce_rows, reference_rows

from ntl_pretrain.loss import KINDS, ce_ntl_loss
from ntl_pretrain.loss.ce_ntl import VALUE_KINDS
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


# Llama-3-like chunks for the digit-wise kind: its distance sums over a 2- or 3-digit class that two shards share.
CHUNK_SURFACES = (
    ["<pad>", "a"]
    + [str(d) for d in range(10)]
    + [f"{i:02d}" for i in range(0, 100, 3)]
    + ["007", "123", "150", "156", "157", "900", "999"]
    + [f"w{i}" for i in range(5)]
)
CHUNK_BOUNDARIES = {2: [0, 30, 58], 3: [0, 20, 49, 58], 4: [0, 11, 30, 50, 58]}


def check_case(nv, kind, reweigh, reduction, dtype, composition, seed, boundaries=BOUNDARIES) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lo, hi = boundaries[world_size][rank], boundaries[world_size][rank + 1]
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
            ntl_weight=NTL_WEIGHT,
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
    ce_N, ntl_N = reference_rows(reference_logits.reshape(-1, nv.vocab_size), labels, nv, kind, reweigh)
    ref_ce, ref_ntl = reduce_rows(ce_N.view(labels.shape), ntl_N.view(labels.shape), labels, nv, kind, reduction)
    ((ref_ce * g_ce).sum() + (ref_ntl * g_ntl).sum()).backward()

    relative = 1e-6 if dtype == torch.float64 else 1e-4
    assert_close_relative(out.ce, ref_ce, relative, f"{what} ce")
    assert_close_relative(out.ntl, ref_ntl, relative, f"{what} ntl")
    assert_close_relative(out.loss, ref_ce + NTL_WEIGHT * ref_ntl, relative, f"{what} loss")
    assert_close_relative(local.grad, reference_logits.grad[..., lo:hi], relative, f"{what} grad")


def check_all_cases() -> None:
    nv = synthetic_vocab()
    cases = [(kind, False) for kind in KINDS] + [(kind, True) for kind in VALUE_KINDS] + [(None, False)]
    dtypes, reductions = (torch.float64, torch.float32), ("mean", "sum", "none")
    for seed, ((kind, reweigh), reduction, dtype, composition) in enumerate(
        itertools.product(cases, reductions, dtypes, BATCHES)
    ):
        check_case(nv, kind, reweigh, reduction, dtype, composition, seed)
    chunks = NumberVocab.from_surfaces(CHUNK_SURFACES)
    for seed, (reduction, dtype, composition) in enumerate(
        itertools.product(reductions, dtypes, ("mixed", "all_numbers"))
    ):
        check_case(chunks, "digits", False, reduction, dtype, composition, 1000 + seed, CHUNK_BOUNDARIES)


def test_chunk_vocab_splits_a_multi_digit_class_between_shards():
    nv = NumberVocab.from_surfaces(CHUNK_SURFACES)
    assert nv.vocab_size == 58
    for bounds in CHUNK_BOUNDARIES.values():
        shard_of = torch.bucketize(torch.arange(nv.vocab_size), torch.tensor(bounds[1:-1]), right=True)
        shards_of_class = [shard_of[nv.classes == c].unique().numel() for c in range(len(nv.class_info))]
        split = [c for c, info in enumerate(nv.class_info) if info.digits > 1 and shards_of_class[c] > 1]
        assert split, f"{bounds}: a 2- or 3-digit class must straddle a shard boundary"


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


HIDDEN = 8
POSITIONS = (2, 5)


def rank_inputs(nv: NumberVocab, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [*POSITIONS, H] (float64) and labels of data-parallel rank `rank`: every rank holds other tokens."""
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(*POSITIONS, HIDDEN, generator=generator, dtype=torch.float64)
    numbers = nv.number_ids[torch.randint(0, len(nv.number_ids), POSITIONS, generator=generator)]
    words = torch.randint(0, nv.vocab_size, POSITIONS, generator=generator)
    draw = torch.rand(POSITIONS, generator=generator)
    return hidden, torch.where(draw < 0.4, numbers, words).masked_fill(draw > 0.85, -100)


def dense_reference(nv, weight, kind, reweigh, world_size):
    """Global-batch loss ΣCE/N + λ·ΣNTL/N_num over all ranks' positions, float64, with gradients."""
    inputs = [rank_inputs(nv, rank) for rank in range(world_size)]
    hidden = [h.clone().requires_grad_(True) for h, _ in inputs]
    labels = torch.cat([labels for _, labels in inputs])  # the ranks' rows, one after another
    weight = weight.clone().requires_grad_(True)
    logits = torch.cat([h.reshape(-1, HIDDEN) for h in hidden]) @ weight.T
    ce_N, ntl_N = reference_rows(logits, labels, nv, kind, reweigh)
    num_tokens = int((labels != -100).sum())
    num_numbers = count_ntl_terms(labels, nv, kind)
    scales = 1 / max(1, num_tokens), NTL_WEIGHT / max(1, num_numbers)
    (ce_N.sum() * scales[0] + ntl_N.sum() * scales[1]).backward()
    per_rank = ce_N.view(world_size, -1).sum(1), ntl_N.view(world_size, -1).sum(1)
    return hidden, weight.grad, per_rank, scales, (num_tokens, num_numbers)


def check_head_cases() -> None:
    from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead, vocab_bounds

    rank, world_size = dist.get_rank(), dist.get_world_size()
    nv = synthetic_vocab()
    weight = torch.randn(nv.vocab_size, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    lo, hi = vocab_bounds(nv.vocab_size, world_size)[rank : rank + 2]
    for kind, reweigh, chunk_size in [
        ("was", False, 3),
        ("digits", False, 3),  # the same all-reduces as was: its distance sums ride in the class pass's SUM
        ("mse", True, None),
        (None, False, 4),
        ("number", False, 3),
        ("number", False, None),
    ]:
        what = f"world={world_size} rank={rank} {kind=} {reweigh=} {chunk_size=}"
        ref_hidden, ref_weight_grad, (ce_sums, ntl_sums), scales, counts = dense_reference(
            nv, weight, kind, reweigh, world_size
        )
        head = VocabParallelHead(
            weight[lo:hi].clone(), nv.vocab_size, dist.group.WORLD, nv, kind=kind, ntl_weight=NTL_WEIGHT,
            reweigh=reweigh, chunk_size=chunk_size,
        )  # fmt: skip
        hidden, labels = rank_inputs(nv, rank)
        hidden.requires_grad_(True)
        with counting_collectives() as forward_calls:
            out = head(hidden, labels, num_tokens=counts[0], num_number_tokens=counts[1])
        # As the trainer does: scale by the world size, DeepSpeed-style averaging divides it back out.
        with counting_collectives() as backward_calls:
            (world_size * out.loss).backward()
        head.average_gradients(data_parallel_size=world_size)

        chunks = -(-world_size * hidden[..., 0].numel() // chunk_size) if chunk_size else 1
        class_pass = 2 if kind is not None else 0  # the number-token logits of all positions, before the chunks
        # no all-reduce agrees on the chunk size: the head knows every rank's shard width
        expected = Counter(all_gather_into_tensor=2, all_reduce=2 * chunks + class_pass)
        assert forward_calls == expected, f"{what}: forward collectives {dict(forward_calls)}"
        assert backward_calls == Counter(reduce_scatter_tensor=1), f"{what}: backward {dict(backward_calls)}"
        share = ce_sums[rank] * scales[0] + ntl_sums[rank] * scales[1]
        assert_close_relative(out.loss, share, 1e-9, f"{what} loss share")
        assert_close_relative(out.ce, ce_sums[rank], 1e-9, f"{what} ce sum")
        assert_close_relative(out.ntl, ntl_sums[rank], 1e-9, f"{what} ntl sum")
        dense = ce_ntl_loss(hidden.detach() @ weight.T, labels, nv, kind=kind, reduction="sum")
        assert_close_relative(out.number_ce, dense.number_ce, 1e-9, f"{what} number-label ce sum")
        trunk_grad = hidden.grad / world_size  # what DeepSpeed's averaging leaves for the decoder trunk
        assert_close_relative(trunk_grad, ref_hidden[rank].grad, 1e-9, f"{what} hidden grad")
        assert_close_relative(head.weight.grad, ref_weight_grad[lo:hi], 1e-9, f"{what} weight grad")
        assert torch.equal(head.full_weight(), weight), f"{what}: full_weight must reassemble the matrix"


def check_head_bf16_hidden_with_fp32_slice() -> None:
    """The slice may stay fp32 (its own master copy) while the trunk runs in bf16: forward casts it."""
    from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead, vocab_bounds

    rank, world_size = dist.get_rank(), dist.get_world_size()
    nv = synthetic_vocab()
    weight = torch.randn(nv.vocab_size, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    lo, hi = vocab_bounds(nv.vocab_size, world_size)[rank : rank + 2]
    _, ref_weight_grad, (ce_sums, ntl_sums), scales, counts = dense_reference(nv, weight, "was", False, world_size)
    head = VocabParallelHead(weight[lo:hi].float(), nv.vocab_size, dist.group.WORLD, nv, ntl_weight=NTL_WEIGHT)
    hidden, labels = rank_inputs(nv, rank)
    out = head(hidden.bfloat16(), labels, num_tokens=counts[0], num_number_tokens=counts[1])
    out.loss.backward()
    assert head.weight.grad.dtype == torch.float32
    share = ce_sums[rank] * scales[0] + ntl_sums[rank] * scales[1]
    torch.testing.assert_close(out.loss.double(), share.detach(), rtol=0.03, atol=0.03)
    torch.testing.assert_close(head.weight.grad.double(), ref_weight_grad[lo:hi], rtol=0.05, atol=0.02)


def check_head_from_output_layer() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead, vocab_bounds

    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = dict(vocab_size=41, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    untied = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False))
    head = VocabParallelHead.from_output_layer(untied, dist.group.WORLD, number_vocab=synthetic_vocab())
    lo, hi = vocab_bounds(41, world_size)[rank : rank + 2]
    assert torch.equal(head.weight, untied.lm_head.weight[lo:hi])
    assert torch.equal(head.full_weight(), untied.lm_head.weight)
    tied = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="ties it to the input embeddings"):
        VocabParallelHead.from_output_layer(tied, dist.group.WORLD, number_vocab=synthetic_vocab())


def check_head(with_transformers_model: bool) -> None:
    check_head_cases()
    check_head_bf16_hidden_with_fp32_slice()
    if with_transformers_model:  # importing transformers costs seconds per rank: once is enough
        check_head_from_output_layer()


def test_vocab_bounds_are_even_and_cover_the_vocabulary():
    from ntl_pretrain.heads.vocab_parallel_layer import vocab_bounds

    assert vocab_bounds(41, 3) == [0, 14, 28, 41]
    assert vocab_bounds(128256, 8) == [16032 * r for r in range(9)]
    assert vocab_bounds(10, 4) == [0, 3, 6, 8, 10]


def test_assemble_output_matrix_from_saved_slices():
    from ntl_pretrain.heads.vocab_parallel_layer import assemble_output_matrix, vocab_bounds

    matrix = torch.randn(10, 3)
    bounds = vocab_bounds(10, 4)
    slices = {lo: matrix[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)}
    assert torch.equal(assemble_output_matrix(dict(reversed(slices.items())), 10), matrix)
    with pytest.raises(ValueError, match="expected a slice at row 3"):
        assemble_output_matrix({0: matrix[:3], 6: matrix[6:]}, 10)
    with pytest.raises(ValueError, match="cover 8 rows"):
        assemble_output_matrix({0: matrix[:8]}, 10)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_head_equals_dense_output_layer(world_size):
    run_distributed(check_head, world_size, world_size == 2)


ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    # DeepSpeed clips at 1.0 by default over the parameters it owns; the head's slice is not among them, so a
    # vocabulary-parallel run must fold the slice's norm into the clipping itself (see docs/vocab-parallel.md).
    "gradient_clipping": 0.0,
}
# Plain SGD: unlike Adam it is not scale-invariant, so a gradient off by any factor changes the curve.
LEARNING_RATE = 0.5


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=41, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def micro_batch(nv: NumberVocab, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
    """(inputs [2, 8], labels [2, 8], global (label count, number-label count)): other tokens on every rank."""
    ids = torch.randint(0, nv.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1000 * step + rank))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[0, :2] = -100
    valid = labels != -100
    counts = torch.stack([valid.sum(), (valid & (nv.classes[labels.clamp_min(0)] >= 0)).sum()]).double()
    dist.all_reduce(counts)
    return inputs, labels, tuple(counts.tolist())


class DenseModel(torch.nn.Module):
    """k = 1: the whole LM in the engine, lm_head gathered by ZeRO-3; returns CE and NTL sums."""

    def __init__(self, lm, nv):
        super().__init__()
        self.lm, self.nv = lm, nv

    def forward(self, inputs, labels):
        from ntl_pretrain.loss import ce_ntl_loss

        hidden = self.lm.model(input_ids=inputs).last_hidden_state
        return ce_ntl_loss(self.lm.lm_head(hidden), labels, self.nv, ntl_weight=NTL_WEIGHT, reduction="sum")


class Trunk(torch.nn.Module):
    """k > 1: the decoder without its output layer in the engine; the head runs outside it."""

    def __init__(self, lm):
        super().__init__()
        self.model = lm.model

    def forward(self, inputs):
        return self.model(input_ids=inputs).last_hidden_state


def zero3_losses(vocab_parallel: bool, steps: int) -> list[float]:
    """Global-batch losses of `steps` ZeRO-3 updates, the way the trainer normalises and scales them."""
    import deepspeed

    from ntl_pretrain.heads.vocab_parallel_layer import VocabParallelHead

    nv, world_size, lm = synthetic_vocab(), dist.get_world_size(), tiny_llama()
    if vocab_parallel:
        head = VocabParallelHead.from_output_layer(lm, dist.group.WORLD, number_vocab=nv, ntl_weight=NTL_WEIGHT)
        head_optimizer = torch.optim.SGD(head.parameters(), lr=LEARNING_RATE)
    module = Trunk(lm) if vocab_parallel else DenseModel(lm, nv)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=ZERO3)
    losses = []
    for step in range(steps):
        inputs, labels, (num_tokens, num_numbers) = micro_batch(nv, step, dist.get_rank())
        if vocab_parallel:
            share = head(engine(inputs), labels, num_tokens=num_tokens, num_number_tokens=num_numbers).loss
        else:
            out = engine(inputs, labels)
            share = out.ce / num_tokens + NTL_WEIGHT * out.ntl / num_numbers
        engine.backward(world_size * share, scale_wrt_gas=False)
        if vocab_parallel:
            head.average_gradients(world_size)
            head_optimizer.step()
            head_optimizer.zero_grad()
        engine.step()
        total = share.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def check_zero3_parity(steps: int) -> None:
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skips a compile nothing here uses
    deepspeed.init_distributed(dist_backend="gloo")
    dense, parallel = zero3_losses(False, steps), zero3_losses(True, steps)
    assert len(set(dense)) > 1, "the loss must move for the comparison to mean anything"
    torch.testing.assert_close(torch.tensor(parallel), torch.tensor(dense), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_zero3_training_with_the_head_follows_the_dense_loss_curve(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_distributed(check_zero3_parity, 2, 10)
