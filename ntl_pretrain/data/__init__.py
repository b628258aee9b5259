"""Streaming corpora: sources, tokenisation, packing, rank sharding, mixtures and exact resume.

The trainer needs `build_dataloader` and `validate_sources`; `DataConfig` is the recipe's `data:` section.
"""

from ntl_pretrain.data.config import DataConfig, SourceConfig, validate_sources
from ntl_pretrain.data.loader import PackedLoader, build_dataloader

__all__ = ["DataConfig", "PackedLoader", "SourceConfig", "build_dataloader", "validate_sources"]
