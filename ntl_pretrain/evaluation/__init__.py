"""Number-aware evaluation: answer parsing, generation metrics on Q/A sets, validation loss of a model.

The names are imported on first use: the recipe schema imports `evaluation.config` without torch."""

import importlib

_HOMES = {
    "EvalConfig": "ntl_pretrain.evaluation.config",
    "QaSetConfig": "ntl_pretrain.evaluation.config",
    "generation_metrics": "ntl_pretrain.evaluation.generation",
    "validation_metrics": "ntl_pretrain.evaluation.validation",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
