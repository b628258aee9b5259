"""The `data:` section of a recipe: sources, mixture weights, packing, shuffling, workers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ntl_pretrain.data.source_config import SourceConfig

MAX_WORKERS = 64  # DataLoader processes per rank: more is a typo, and each holds a tokenizer and a shuffle buffer


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    """Training sources; each epoch of each source is read once per pass, mixed by `weight`."""
    validation: list[SourceConfig] = field(default_factory=list)
    """Held-out sources, read once in order (weights ignored); empty = no validation."""
    seq_len: int = 512
    """Packed sequence length in tokens (documents are joined with EOS and cut into blocks)."""
    shuffle_buffer: int = 1000
    """Documents held in the seeded shuffle buffer per reader; 0 or 1 keeps the stream order."""
    shuffle_buffer_tokens: int = 1_000_000
    """Tokens held in the shuffle buffer per reader, at most (plus one tokenizer call's worth): 4 bytes each, in
    memory and in the checkpoint. A document with more characters than this passes the buffer by and is tokenised
    piece by piece (docs/data.md)."""
    per_document_attention: bool = False
    """Reset position ids at document starts and drop the cross-document label after each EOS; transformers then
    also keeps attention inside each document with sdpa/eager (no cache, no mask: the trainer's forward), and
    with flash-attention 2 from the document boundaries the trainer passes (docs/data.md)."""
    num_workers: int = 0
    """DataLoader worker processes per rank, at most 64 (0 = read in the training process)."""
    tokenize_batch: int = 64
    """Documents tokenised per call of the fast tokenizer, at most."""
    tokenize_batch_chars: int = 1 << 16
    """Characters per call of the fast tokenizer, at most: a longer document is tokenised in pieces of about
    this size (same ids, see docs/data.md). A call needs ~400 bytes per character while it runs."""
    prefetch_batches: int = 4
    """Batches each worker prepares ahead (with `num_workers` > 0)."""

    @property
    def label_roles(self) -> bool:
        """Training batches carry `ntl_labels` apart from `labels` (some source restricts a loss to its answers)."""
        return any(source.answer_only for source in self.sources)

    @property
    def answer_labels(self) -> bool:
        """Validation batches carry `answer_mask` (some validation source is a Q/A source)."""
        return any(source.answer is not None for source in self.validation)

    def check(self) -> None:
        if not self.sources:
            raise ValueError("sources: at least one training source is required")
        if self.seq_len < 1:
            raise ValueError(f"seq_len: must be >= 1, got {self.seq_len}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer: must be >= 0, got {self.shuffle_buffer}")
        if not 0 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(
                f"num_workers: must be in [0, {MAX_WORKERS}] worker processes per rank, got {self.num_workers}"
            )
        if not math.isfinite(sum(source.weight for source in self.sources)):
            raise ValueError("sources: the weights add up to infinity; they are relative, write them small (e.g. 1, 3)")
        if self.tokenize_batch < 1:
            raise ValueError(f"tokenize_batch: must be >= 1, got {self.tokenize_batch}")
        if self.shuffle_buffer_tokens < 1:
            raise ValueError(f"shuffle_buffer_tokens: must be >= 1, got {self.shuffle_buffer_tokens}")
        if self.tokenize_batch_chars < 1:
            raise ValueError(f"tokenize_batch_chars: must be >= 1, got {self.tokenize_batch_chars}")
        if self.prefetch_batches < 1:
            raise ValueError(f"prefetch_batches: must be >= 1, got {self.prefetch_batches}")
        for index, source in enumerate(self.validation):
            if source.answer_only:
                raise ValueError(
                    f"validation.{index}: ce_labels/ntl_labels apply to training sources; validation scores all labels "
                    "(val_ce) and, for a Q/A source, its answer labels (val_answer_ce, val_answer_ntl_<kind>)"
                )
        labels = [source.label for source in self.sources]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"sources: several sources are labelled {duplicates}; give them distinct `name`s")
        # Last, as it opens files; the file readers load here, not with the schema (`ntl-pretrain --help`).
        from ntl_pretrain.data.probe import check_files_of

        check_files_of({"sources": self.sources, "validation": self.validation})


def validate_sources(cfg: DataConfig) -> None:
    """Fail before any process starts if a source file is missing or has an unknown format.

    The recipe loader runs the same checks through each section's `check()`; call this when building a
    `DataConfig` in code. Errors name the key (`sources.1`) and the path.
    """
    for section, sources in (("sources", cfg.sources), ("validation", cfg.validation)):
        for index, source in enumerate(sources):
            try:
                source.check()
            except ValueError as error:
                raise ValueError(f"{section}.{index}.{error}") from None
    cfg.check()
