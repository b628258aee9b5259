"""Streaming corpora: sources, tokenisation, packing, rank sharding, mixtures and exact resume.

The trainer needs `build_dataloader` and `validate_sources`; `DataConfig` is the recipe's `data:` section. The names
are imported on first use: the recipe schema imports `data.config` without torch (`ntl-pretrain --help` starts at
once), and `from ntl_pretrain.data import build_dataloader` still works.
"""

from ntl_pretrain.lazy_exports import lazy_getattr

_HOMES = {
    "DataConfig": "ntl_pretrain.data.config",
    "SourceConfig": "ntl_pretrain.data.source_config",
    "validate_sources": "ntl_pretrain.data.config",
    "PackedLoader": "ntl_pretrain.data.loader",
    "build_dataloader": "ntl_pretrain.data.loader",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_getattr(__name__, _HOMES)
