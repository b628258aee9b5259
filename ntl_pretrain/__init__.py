"""ntl_pretrain: pretraining and continued pretraining of decoder LMs with CE + λ·NTL on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"
