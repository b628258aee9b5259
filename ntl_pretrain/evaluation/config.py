"""The `eval:` section of a recipe: question/answer sets for generation metrics, and how to decode them."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.package_files import resolve_path

CORPUS = "pkg:ntl_pretrain/corpus"


@dataclass
class QaSetConfig:
    path: str = ""
    """jsonl of `{"question": str, "answer": str}` records (`pkg:` paths allowed); each answer one number (signs,
    thousands commas and decimals allowed), checked when the recipe is loaded."""
    name: str | None = None
    """Metric prefix; null = `<folder>_<file stem>`, e.g. `arithmetic_interpolation`."""

    def check(self) -> None:
        if not self.path:
            raise ValueError("path: required")
        from ntl_pretrain.evaluation.answers import read_qa_file

        path = resolve_path(self.path)
        if not path.is_file():
            raise ValueError(f"path: no such file {self.path!r}")
        try:
            read_qa_file(path)  # a bad reference would otherwise fail the first generation eval, deep into a run
        except ValueError as error:
            raise ValueError(f"path: {error}") from None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        path = Path(self.path.removeprefix("pkg:"))
        return f"{path.parent.name}_{path.stem}".lstrip("_")


def _default_qa_sets() -> list[QaSetConfig]:
    return [
        QaSetConfig(path=f"{CORPUS}/arithmetic/interpolation.jsonl"),
        QaSetConfig(path=f"{CORPUS}/arithmetic/extrapolation.jsonl"),
    ]


@dataclass
class EvalConfig:
    every_steps: int | None = None
    """Run the generation metrics every N training steps (and after the last); null = never during training."""
    qa_sets: list[QaSetConfig] = field(default_factory=_default_qa_sets)
    """Question/answer sets scored by greedy generation (default: the embedded arithmetic interpolation and
    extrapolation splits)."""
    prompt_template: str = "{question}"
    """Prompt built from a record; must be the training template's text before the answer (the model writes the
    separating space itself, as it learned to)."""
    chat_template: Literal["none", "auto"] | None = None
    """`auto`: each prompt goes to the model as a user message in its tokenizer's chat template, where the tokenizer
    has one (an Instruct or chat model: asked raw text, it often ends its turn at once); `none`: the prompt
    as text after an EOS, as pretraining showed it; null (the default): `auto` for an Instruct or chat model, one
    whose end-of-sequence token ends a turn of its chat template (SmolLM2-Instruct's `<|im_end|>`), else `none`:
    base models' tokenizers often carry a chat template too (Llama 3, Qwen 2.5, SmolLM2), but their end-of-sequence
    token ends a text, not a turn, and a base model answers the raw prompt."""
    max_examples: int | None = 256
    """First N records of each set (in file order, so every evaluation sees the same ones); null = all."""
    max_new_tokens: int = 16
    """Generation stops at EOS or after this many tokens."""
    batch_size: int = 64
    """Prompts per generate call (per rank)."""
    validation: list[SourceConfig] = field(default_factory=list)
    """`ntl-pretrain eval` only: held-out sources for CE, perplexity and NTL; empty = the run's
    `data.validation` (the trainer already reports validation CE/NTL on those)."""
    max_validation_batches: int | None = None
    """`ntl-pretrain eval` only: the cap `train.eval_max_batches` is, so the same weights give the trainer's
    `val_ce`: N micro-batches per rank of the run that saved the checkpoint, i.e. the first N ×
    `train.micro_batch_size` × its ranks packed sequences of the split, its sources in order, however many processes
    evaluate (of an HF folder, N × 8 sequences); null = the whole split."""

    def check(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError("every_steps: must be >= 1")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"prompt_template: {self.prompt_template!r} must contain {{question}}")
        try:
            fields = {field for _, field, _, _ in string.Formatter().parse(self.prompt_template) if field is not None}
        except ValueError as error:
            raise ValueError(f"prompt_template: {self.prompt_template!r}: {error} (write {{{{ for a brace)") from error
        if fields - {"question"}:
            extra = ", ".join(f"{{{field}}}" for field in sorted(fields - {"question"}))
            raise ValueError(f"prompt_template: {self.prompt_template!r} may hold only {{question}}, not {extra} (the "
                             f"answer must not be in the prompt; write {{{{ for a brace)")  # fmt: skip
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        if self.batch_size < 1:
            raise ValueError("batch_size: must be >= 1")
        labels = [qa.label for qa in self.qa_sets]
        if len(set(labels)) != len(labels):
            raise ValueError(f"qa_sets: several sets are labelled {labels}; give them distinct `name`s")
        from ntl_pretrain.data.probe import check_files_of  # opens files: last, and loaded only here

        check_files_of({"validation": self.validation})
