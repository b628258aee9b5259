"""`loss.head: chunked` (the default): output layer + CE + NTL a chunk of positions at a time, inside the DeepSpeed
engine's forward, so that the [B, T, V] logits never exist (`linear_ce_ntl_loss`, loss/chunked.py).

The output layer's `forward` is never called: the head multiplies by its weight itself. Under ZeRO-3 a parameter is
gathered only for the forward of the module that owns it, so the weight is registered as an external parameter of
this head (`deepspeed.zero.register_external_parameter`, DeepSpeed's documented way for a parameter used outside
its module): ZeRO-3 gathers it for this head's forward and backward and releases it after, and its gradient, which
the kernel forms in forward and hands to autograd in backward, reaches DeepSpeed's reduce-scatter like any other.
With tied embeddings the output layer's weight is the input embedding: the same parameter, gathered the same way.

Memory per micro-batch of N positions: one [R, V] chunk (R = `loss.chunk_size`, or 2^26 / V positions in fp32 with
`loss.backend` torch, 2^28 / V in the logits' dtype with triton) besides the [V, H] weight gradient, instead of
[N, V] logits and their gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.heads.base import HeadOutput, OutputHead
from ntl_pretrain.loss.backend import resolve_backend
from ntl_pretrain.loss.chunked import linear_ce_ntl_rows
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberVocab

IGNORE_INDEX = -100


class ChunkedHead(OutputHead):
    def __init__(
        self,
        output_layer: nn.Module,
        number_vocab: NumberVocab | None,
        ntl: NtlConfig,
        transform: LogitTransform = IDENTITY,
        chunk_size: int | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        if getattr(output_layer, "bias", None) is not None:
            raise ValueError(
                "loss.head: chunked multiplies by the output layer's weight and this model's output layer also has a "
                "bias; set loss.head: dense"
            )
        self.output_layer = output_layer  # a submodule for its weight (optimised, checkpointed); never called
        self.number_vocab, self.ntl, self.transform, self.chunk_size = number_vocab, ntl, transform, chunk_size
        self.backend = backend  # loss.backend
        if hasattr(output_layer.weight, "ds_id"):
            import deepspeed

            deepspeed.zero.register_external_parameter(self, output_layer.weight)

    def forward(
        self,
        hidden_BTH: torch.Tensor,
        labels_BT: torch.Tensor,
        num_tokens: float | None = None,
        num_number_tokens: float | None = None,
        ntl_labels_BT: torch.Tensor | None = None,
    ) -> HeadOutput:
        given_counts = num_tokens is not None
        backend = resolve_backend(self.backend, hidden_BTH.device, hidden_BTH.dtype, "loss.backend")
        rows = linear_ce_ntl_rows(
            hidden_BTH, self.output_layer.weight, labels_BT, self.number_vocab, self.ntl,
            reduction="mean" if given_counts else "sum", chunk_size=self.chunk_size, num_tokens=num_tokens,
            num_number_tokens=num_number_tokens, transform=self.transform, ntl_labels=ntl_labels_BT,
            ignore_index=IGNORE_INDEX, backend=backend,
        )  # fmt: skip
        number_ce = torch.where(rows.is_number_N, rows.ce_N, 0.0).sum()
        return HeadOutput(rows.loss, rows.ce_N.sum(), rows.ntl_N.sum(), rows.valid_N.sum(), rows.ntl_terms_N.sum(),
                          number_ce)  # fmt: skip
