"""Number-aware evaluation: answer parsing, generation metrics on Q/A sets, validation loss of a model.

The names are imported on first use: the recipe schema imports `evaluation.config` without torch."""

from ntl_pretrain.lazy_exports import lazy_getattr

_HOMES = {
    "EvalConfig": "ntl_pretrain.evaluation.config",
    "QaSetConfig": "ntl_pretrain.evaluation.config",
    "generation_metrics": "ntl_pretrain.evaluation.generation",
    "validation_metrics": "ntl_pretrain.evaluation.validation",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_getattr(__name__, _HOMES)
