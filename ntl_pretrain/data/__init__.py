"""Streaming corpora: sources, tokenisation, packing, rank sharding, mixtures and exact resume.

The trainer needs `build_dataloader` and `validate_sources`; `DataConfig` is the recipe's `data:` section. The names
are imported on first use: the recipe schema imports `data.config` without torch (`ntl-pretrain --help` starts at
once), and `from ntl_pretrain.data import build_dataloader` still works.
"""

import importlib

_HOMES = {
    "DataConfig": "ntl_pretrain.data.config",
    "SourceConfig": "ntl_pretrain.data.config",
    "validate_sources": "ntl_pretrain.data.config",
    "PackedLoader": "ntl_pretrain.data.loader",
    "build_dataloader": "ntl_pretrain.data.loader",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
