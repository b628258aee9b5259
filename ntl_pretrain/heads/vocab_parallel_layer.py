"""The output layer + CE + λ·NTL for a group of k data-parallel ranks that share the vocabulary between them.

Legend: N positions of one rank, k ranks in the vocabulary-parallel group, M = k·N positions of the group,
H hidden size, V vocabulary, Vr rows of the output matrix this rank holds.

Under plain ZeRO-3 every rank gathers the whole [V, H] output matrix in forward, again in backward, and
reduce-scatters its [V, H] gradient. Here rank r of the group keeps rows [lo_r, hi_r) of the matrix for good:
forward all-gathers the group's hidden states ([k·N, H]) and labels, computes its vocabulary slice of the logits of
all k·N positions a chunk at a time (`linear_ce_ntl_rows`, two all-reduces per chunk), and backward
reduce-scatters the hidden-state gradient to the rank that owns each position. The matrix never moves.

The slice is a plain parameter outside ZeRO-3 (ZeRO would treat it as a replica of one tensor): optimise it with
its own optimizer, call `average_gradients` before stepping it; `full_weight` (online, a collective) or
`assemble_output_matrix` (offline, from saved slices) reassembles the matrix for export.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.loss.backend import resolve_backend
from ntl_pretrain.loss.ce_ntl import LossOutput
from ntl_pretrain.loss.chunked import default_chunk_rows, linear_ce_ntl_rows
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberVocab


def vocab_bounds(vocab_size: int, group_size: int) -> list[int]:
    """Row boundaries [lo_0 = 0, lo_1, ..., V] of the k slices: as even as possible, the first slices one longer."""
    base, extra = divmod(vocab_size, group_size)
    bounds = [0]
    for rank in range(group_size):
        bounds.append(bounds[-1] + base + (rank < extra))
    return bounds


class GatherPositions(torch.autograd.Function):
    """All-gather [N, H] -> [k·N, H] across the group; backward reduce-scatters (sums) the gradient back."""

    @staticmethod
    def forward(ctx, local_NH: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        gathered = local_NH.new_empty(size * local_NH.shape[0], *local_NH.shape[1:])
        dist.all_gather_into_tensor(gathered, local_NH.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad_gathered: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        grad_local = grad_gathered.new_empty(grad_gathered.shape[0] // size, *grad_gathered.shape[1:])
        dist.reduce_scatter_tensor(grad_local, grad_gathered.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_local, None


class VocabParallelHead(nn.Module):
    """Output layer and loss for one rank of a vocabulary-parallel group; forward returns this rank's share."""

    def __init__(
        self,
        weight_slice: torch.Tensor,
        vocab_size: int,
        group: dist.ProcessGroup,
        number_vocab: NumberVocab | None,
        kind: str | None = "was",
        ntl_weight: float = 0.3,
        reweigh: bool = False,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        transform: LogitTransform = IDENTITY,
        float_level: bool = False,
        backend: str = "auto",
    ):
        """`weight_slice` [Vr, H] are rows vocab_bounds(vocab_size, k)[r] : [r + 1] of the output matrix, r being
        this rank's index in `group`. It may be kept in fp32 (its own master copy) while hidden states are bf16:
        forward casts it to the hidden states' dtype. `transform`: the architecture's logit post-processing;
        `float_level`: as in `ce_ntl_loss` (kind "number"); `backend`: the recipe's `loss.backend`."""
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        bounds = vocab_bounds(vocab_size, size)
        self.vocab_start, vocab_end = bounds[rank], bounds[rank + 1]
        if weight_slice.shape[0] != vocab_end - self.vocab_start:
            raise ValueError(
                f"rank {rank} of a {size}-rank vocabulary group holds rows [{self.vocab_start}, {vocab_end}) of the "
                f"{vocab_size}-row output matrix, got a slice of {weight_slice.shape[0]} rows"
            )
        self.weight = nn.Parameter(weight_slice)
        self.vocab_size, self.group = vocab_size, group
        self.number_vocab, self.ntl = number_vocab, NtlConfig(kind, ntl_weight, reweigh, float_level)
        # Without a chunk size every rank takes the default for the widest shard: the same on all ranks, known
        # here, where `linear_ce_ntl_loss` would agree on it with an all-reduce and a host sync on every call.
        self.widest = max(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True))
        self.chunk_size, self.backend = chunk_size, backend
        self.ignore_index, self.transform = ignore_index, transform

    @classmethod
    def from_output_layer(cls, lm: nn.Module, group: dist.ProcessGroup, **loss_options) -> VocabParallelHead:
        """Take this rank's rows of a Hugging Face model's output layer (gathered once if ZeRO-3 partitioned it).

        Tied input embeddings are refused: the embedding lookup needs the whole matrix on every rank anyway,
        so slicing the shared tensor would gather it whole each step regardless and split one parameter's
        gradient between two owners. Untie them first (a separate output layer initialised from a copy of the
        embedding) or keep vocab_parallel_size 1.
        """
        output, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()
        if embedding is not None and output.weight is embedding.weight:
            raise ValueError(
                "vocabulary parallelism needs an output layer of its own, but this model ties it to the input "
                "embeddings: the embedding lookup needs the whole matrix on every rank, so slicing it saves "
                "nothing and would split one parameter's gradient between two owners. Untie them first (a separate "
                "output layer initialised from a copy of the embedding) or set loss.vocab_parallel_size: 1"
            )
        vocab_size = output.weight.ds_shape[0] if hasattr(output.weight, "ds_shape") else output.weight.shape[0]
        bounds = vocab_bounds(vocab_size, dist.get_world_size(group))
        rank = dist.get_rank(group)
        with _gathered(output.weight):
            weight_slice = output.weight.detach()[bounds[rank] : bounds[rank + 1]].clone()
        return cls(weight_slice, vocab_size, group, **loss_options)

    def forward(
        self,
        hidden_BTH: torch.Tensor,
        labels_BT: torch.Tensor,
        num_tokens: int | torch.Tensor | None = None,
        num_number_tokens: int | torch.Tensor | None = None,
        ntl_labels_BT: torch.Tensor | None = None,
    ) -> LossOutput:
        """This rank's loss share (every rank of the group must call it with the same shapes, and all with or all
        without `ntl_labels_BT`, as in `ce_ntl_loss`).

        loss: differentiable, sum CE / num_tokens + λ · sum NTL / num_number_tokens over this rank's positions (pass
        the global batch's counts; without them the sums are returned). Its backward gives this rank's hidden
        states the gradient of that share and the weight slice the gradient of the whole group's loss.
        ce, ntl, number_ce: this rank's detached sums; num_tokens, num_number_tokens: this rank's counts.
        """
        given_counts = num_tokens is not None
        if given_counts != (num_number_tokens is not None):
            raise ValueError("pass both num_tokens and num_number_tokens (the global batch's counts), or neither")
        hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        backend = resolve_backend(self.backend, hidden_BTH.device, hidden_BTH.dtype, "loss.backend")
        chunk_size = default_chunk_rows(self.widest, backend) if self.chunk_size is None else self.chunk_size
        group_hidden_MH = GatherPositions.apply(hidden_NH, self.group)
        group_labels_RT = self._group_rows(labels_BT)
        group_ntl_labels_RT = None if ntl_labels_BT is None else self._group_rows(ntl_labels_BT)
        rows = linear_ce_ntl_rows(
            group_hidden_MH.view(*group_labels_RT.shape, -1), self.weight.to(hidden_BTH.dtype), group_labels_RT,
            self.number_vocab, self.ntl, reduction="mean" if given_counts else "sum", chunk_size=chunk_size,
            group=self.group, vocab_start=self.vocab_start, num_tokens=num_tokens, num_number_tokens=num_number_tokens,
            transform=self.transform, ntl_labels=group_ntl_labels_RT, ignore_index=self.ignore_index, backend=backend,
        )  # fmt: skip
        rank, positions = dist.get_rank(self.group), hidden_NH.shape[0]
        own = slice(rank * positions, (rank + 1) * positions)
        ce, ntl = rows.ce_N[own].sum(), rows.ntl_N[own].sum()
        share = rows.ce_scale * ce + self.ntl.weight * rows.ntl_scale * ntl
        # The value is this rank's share (ranks sum to the global loss, as with a dense head); the gradient is the
        # group loss's, which the reduce-scatter turns into exactly the share's gradient for this rank's positions.
        loss = rows.loss - rows.loss.detach() + share
        number_ce = torch.where(rows.is_number_N[own], rows.ce_N[own], 0.0).sum()
        return LossOutput(loss, ce, ntl, rows.valid_N[own].sum(), rows.ntl_terms_N[own].sum(), number_ce)

    def _group_rows(self, labels_BT: torch.Tensor) -> torch.Tensor:
        """The group's labels [k·B, T], rows kept (the number-level loss reads numbers along them)."""
        labels_RT = labels_BT.reshape(-1, labels_BT.shape[-1]) if labels_BT.dim() else labels_BT.reshape(1, 1)
        group_labels_RT = labels_RT.new_empty(dist.get_world_size(self.group) * labels_RT.shape[0], labels_RT.shape[1])
        dist.all_gather_into_tensor(group_labels_RT, labels_RT.contiguous(), group=self.group)
        return group_labels_RT

    def average_gradients(self, data_parallel_size: int, replica_group: dist.ProcessGroup | None = None) -> None:
        """Make the slice's gradient what DeepSpeed gives a replicated parameter: summed over the ranks holding
        the same slice (`replica_group`, one rank per vocabulary group; None when there is one group) and divided
        by the data-parallel world size. Call once per step, after the last micro-batch's backward."""
        if self.weight.grad is None:
            return
        if replica_group is not None:
            dist.all_reduce(self.weight.grad, group=replica_group)
        self.weight.grad.div_(data_parallel_size)

    def full_weight(self) -> torch.Tensor:
        """The whole [V, H] output matrix, reassembled from the group's slices on every rank (for export)."""
        size = dist.get_world_size(self.group)
        bounds = vocab_bounds(self.vocab_size, size)
        longest = max(hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False))
        padded = self.weight.detach().new_zeros(longest, self.weight.shape[1])
        padded[: self.weight.shape[0]] = self.weight.detach()
        gathered = padded.new_empty(size * longest, self.weight.shape[1])
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        return torch.cat([gathered[r * longest : r * longest + bounds[r + 1] - bounds[r]] for r in range(size)])


def assemble_output_matrix(slices: dict[int, torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The [V, H] matrix from the slices one vocabulary group saved, keyed by their first row (`vocab_start`);
    for exporting a checkpoint offline, without a process group. Refuses gaps and overlaps."""
    rows, parts = 0, []
    for start in sorted(slices):
        if start != rows:
            raise ValueError(
                f"output-matrix slices must tile [0, {vocab_size}): expected a slice at row {rows}, got {start}"
            )
        parts.append(slices[start])
        rows += slices[start].shape[0]
    if rows != vocab_size:
        raise ValueError(f"output-matrix slices cover {rows} rows, the vocabulary has {vocab_size}")
    return torch.cat(parts)


def _gathered(weight: torch.Tensor):
    """A context in which a ZeRO-3 partitioned parameter holds its full value (a no-op for a plain tensor)."""
    if hasattr(weight, "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters([weight], modifier_rank=None)
    return torch.no_grad()
