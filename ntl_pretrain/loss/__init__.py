"""The objective: fused CE + NTL on logits (dense or vocabulary-parallel)."""

from ntl_pretrain.loss.ce_ntl import KINDS, LossOutput, ce_ntl_loss

__all__ = ["KINDS", "LossOutput", "ce_ntl_loss"]
