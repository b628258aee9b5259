"""`loss.head: dense`: the output layer materialises the [B, T, V] logits, then the fused CE + NTL runs on them.

The projection is the model's own `lm_head` module, called as a submodule so that ZeRO-3 gathers its weight (and
bias) as usual; autograd keeps the logits and their gradient, B·T·V elements each (the Triton backend forms the
gradient in forward and keeps it instead of the logits: `ce_ntl_training_loss`). The choice for tiny
vocabularies and for debugging (docs/recipes.md); `chunked` never holds them.
"""

from __future__ import annotations

import torch
from torch import nn

from ntl_pretrain.config.recipe import NtlConfig
from ntl_pretrain.heads.base import HeadOutput, OutputHead
from ntl_pretrain.loss.backend import resolve_backend
from ntl_pretrain.loss.ce_ntl import ce_ntl_training_loss
from ntl_pretrain.loss.logit_transform import IDENTITY, LogitTransform
from ntl_pretrain.numbers import NumberVocab


class DenseHead(OutputHead):
    def __init__(
        self,
        projection: nn.Module,
        number_vocab: NumberVocab | None,
        ntl: NtlConfig,
        transform: LogitTransform = IDENTITY,
        backend: str = "auto",
    ):
        super().__init__()
        self.projection = projection
        self.number_vocab = number_vocab
        self.ntl = ntl
        self.transform = transform
        self.backend = backend  # loss.backend

    def forward(
        self,
        hidden_BTH: torch.Tensor,
        labels_BT: torch.Tensor,
        num_tokens: float | None = None,
        num_number_tokens: float | None = None,
        ntl_labels_BT: torch.Tensor | None = None,
    ) -> HeadOutput:
        logits_BTV = self.transform(self.projection(hidden_BTH))
        backend = resolve_backend(self.backend, logits_BTV.device, logits_BTV.dtype, "loss.backend")
        out = ce_ntl_training_loss(
            logits_BTV,
            labels_BT,
            self.number_vocab,
            kind=self.ntl.kind,
            ntl_weight=self.ntl.weight,
            reweigh=self.ntl.reweigh,
            float_level=self.ntl.float_level,
            ntl_labels=ntl_labels_BT,
            num_tokens=num_tokens,
            num_number_tokens=num_number_tokens,
            backend=backend,
        )
        return HeadOutput(out.loss, out.ce, out.ntl, out.num_tokens, out.num_number_tokens, out.number_ce)
