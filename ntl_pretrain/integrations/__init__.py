"""Number Token Loss in trainers other than ntl-pretrain's: `apply_ntl(model_or_trainer, tokenizer, kind, ntl_weight)`
patches a transformers causal LM (and a transformers `Trainer`'s counting and logging) so that its loss is
CE + λ·NTL through the chunked head (docs/loss.md, "NTL in your own trainer")."""

from ntl_pretrain.integrations.drop_in import NtlPatch, apply_ntl

__all__ = ["NtlPatch", "apply_ntl"]
