"""One corpus source of a recipe (`data.sources`, `data.validation`, `eval.validation`): the fields and the checks
that need no file. What its files hold is checked by `probe.check_source_files` (the `data:` section runs it), so
that the modules that read files may name this type without importing it back."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

Format = Literal["auto", "jsonl", "json", "parquet", "txt", "arrow", "hub"]
LabelSet = Literal["all", "answer"]


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
            try:
                fields = self.template_fields
            except ValueError as error:  # `{question {answer}`: str.format's own words, under the key's name
                raise ValueError(f"template: {self.template!r}: {error}") from error
            if not fields:
                raise ValueError(f"template: {self.template!r} names no field (write fields as {{name}})")
        if self.format != "hub" and self.hub_config is not None:
            raise ValueError("hub_config: only for format: hub")
        self._check_answer()
        if self.format != "hub" and self.hub_revision is not None:
            raise ValueError("hub_revision: only for format: hub")
        if self.format != "hub" and self.hub_split != "train":
            raise ValueError(f"hub_split: only for format: hub, got {self.hub_split!r}")

    def check_keys_apply(self, file_format: str) -> None:
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
