"""Number-aware evaluation: answer parsing, generation metrics on Q/A sets, validation loss of a model."""

from ntl_pretrain.evaluation.config import EvalConfig, QaSetConfig
from ntl_pretrain.evaluation.generation import generation_metrics
from ntl_pretrain.evaluation.validation import validation_metrics

__all__ = ["EvalConfig", "QaSetConfig", "generation_metrics", "validation_metrics"]
