"""The `data:` section of a recipe: sources, mixture weights, packing, shuffling, workers."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field
from typing import Literal

from ntl_pretrain.data.files import resolve_files, source_format

Format = Literal["auto", "jsonl", "json", "parquet", "txt", "arrow", "hub"]
LabelSet = Literal["all", "answer"]
MAX_WORKERS = 64  # DataLoader processes per rank: more is a typo, and each holds a tokenizer and a shuffle buffer


@dataclass
class SourceConfig:
    path: str = ""
    """File, glob (`data/*.jsonl`), folder (all files in it), `pkg:<package>/<path>`, remote URL
    (`s3://...`, `https://...`, read through fsspec) or, with `format: hub`, a hub dataset name."""
    format: Format = "auto"
    """`auto` infers it from the file suffix (`.jsonl`, `.json`, `.parquet`, `.txt`, `.arrow`, optionally
    compressed with `.gz`/`.bz2`/`.xz`/`.zst` for jsonl and txt); `hub` streams a dataset from the HF hub."""
    text_field: str = "text"
    """Record field holding the document text (ignored when `template` is set, and for txt)."""
    template: str | None = None
    """Builds the document from several fields, e.g. `"{question} {answer}"` for Q/A records."""
    weight: float = 1.0
    """Relative sampling weight in the training mixture (normalised over all sources)."""
    name: str | None = None
    """Label in metrics; null = `<folder>/<file name without suffix>` (or the hub name)."""
    sample_by: Literal["line", "paragraph", "document"] = "paragraph"
    """txt only: one document per line, per blank-line-separated paragraph, or per file."""
    hub_config: str | None = None
    """`format: hub` only: the dataset configuration name."""
    hub_split: str = "train"
    """`format: hub` only: the split to stream."""
    hub_revision: str | None = None
    """`format: hub` only: the commit (or branch, tag) to list the files at; null = the latest. A resume needs the
    files the run was reading: one that finds them changed is refused, naming the commit to pin here."""
    answer_field: str | None = None
    """The `template` field that holds a Q/A record's answer; null = `answer` when the template has an `{answer}`
    field. Its tokens and the EOS after them are the record's *answer labels* (docs/data.md, "Which labels carry
    which loss"); validation reports `val_answer_ce` and `val_answer_ntl_<kind>` on them."""
    ce_labels: LabelSet = "all"
    """Training sources: which labels carry cross-entropy: `all`, or only the `answer` labels (loss on completions
    only)."""
    ntl_labels: LabelSet = "all"
    """Training sources: which labels carry NTL: `all` number labels, or only those in the `answer`."""

    def check(self) -> None:
        if not self.path:
            raise ValueError("path: required")
        if self.weight <= 0:
            raise ValueError(f"weight: must be > 0, got {self.weight}")
        if self.template is not None:
            fields = [name for _, name, _, _ in string.Formatter().parse(self.template) if name]
            if not fields:
                raise ValueError(f"template: {self.template!r} names no field (write fields as {{name}})")
        if self.format != "hub" and self.hub_config is not None:
            raise ValueError("hub_config: only for format: hub")
        self._check_answer()
        if self.format != "hub" and self.hub_revision is not None:
            raise ValueError("hub_revision: only for format: hub")
        if self.format != "hub" and self.hub_split != "train":
            raise ValueError(f"hub_split: only for format: hub, got {self.hub_split!r}")
        formats = {source_format(self, path) for path in resolve_files(self)}
        if len(formats) > 1:
            raise ValueError(f"path: {self.path!r} mixes formats {sorted(formats)}; use one source per format")
        self._check_keys_apply(formats.pop() if formats else self.format)
        # The file readers load when a source is checked, not with the schema (`ntl-pretrain --help`).
        from ntl_pretrain.data.probe import probe_source

        probe_source(self)

    def _check_keys_apply(self, file_format: str) -> None:
        """A key set for another format would be ignored silently: txt reads no records, records no paragraphs."""
        if file_format == "txt" and (self.template is not None or self.text_field != "text"):
            key = "template" if self.template is not None else "text_field"
            raise ValueError(f"{key}: a txt source has no record fields (its documents are lines, paragraphs or "
                             f"files: sample_by)")  # fmt: skip
        if file_format != "txt" and self.sample_by != "paragraph":
            raise ValueError(f"sample_by: only for txt sources; {self.path!r} is {file_format}")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.format == "hub":
            return self.path
        *_, folder, name = ["", *self.path.rstrip("/").replace("pkg:", "").split("/")]
        return f"{folder}/{name.split('.', 1)[0]}".lstrip("/")

    def _check_answer(self) -> None:
        if self.answer_field is not None and (self.template or "").count("{" + self.answer_field + "}") != 1:
            raise ValueError(
                f"answer_field: the template must hold {{{self.answer_field}}} exactly once, without a format spec "
                f"(template: {self.template!r})"
            )
        for key in ("ce_labels", "ntl_labels"):
            if getattr(self, key) == "answer" and self.answer is None:
                raise ValueError(
                    f"{key}: 'answer' needs a Q/A source: a `template` with an {{answer}} field, or `answer_field` "
                    f"naming the template's answer field (template: {self.template!r})"
                )

    @property
    def answer(self) -> str | None:
        """The template field holding the answer (`answer_field`, or `answer` where the template has it), or None."""
        if self.template is None:
            return None
        if self.answer_field is not None:
            return self.answer_field
        return "answer" if self.template.count("{answer}") == 1 else None

    @property
    def answer_only(self) -> bool:
        """Some loss is restricted to the answer labels."""
        return "answer" in (self.ce_labels, self.ntl_labels)

    @property
    def template_fields(self) -> list[str]:
        if self.template is None:
            return [self.text_field]
        return [name for _, name, _, _ in string.Formatter().parse(self.template) if name]


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


def validate_sources(cfg: DataConfig) -> None:
    """Fail before any process starts if a source file is missing or has an unknown format.

    The recipe loader runs the same checks through `check()`; call this when building a `DataConfig` in
    code. Errors name the key (`sources.1`) and the path.
    """
    cfg.check()
    for section, sources in (("sources", cfg.sources), ("validation", cfg.validation)):
        for index, source in enumerate(sources):
            try:
                source.check()
            except ValueError as error:
                raise ValueError(f"{section}.{index}.{error}") from None
