"""Pre-flight of how the run starts, decided as its ranks will decide it: which checkpoint it resumes (passing over
damaged ones as `auto` does, verified as the ranks verify them) and at which step (the one its manifest records,
whatever the folder is named), and whether the recipe may resume it (the ranks' resume guard,
`train/resume_guard.py`, run here on one process, also for a run that has nothing left to train), or whether it
starts from `init_from`'s weights or from scratch; and whether NTL has anything to learn: a tokenizer without number
tokens is refused, and a corpus whose first records hold no number label is said (a note, not a refusal: numbers
may come later in the stream)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.data.label_bits import NO_NTL, TOKEN_BITS
from ntl_pretrain.preflight.data import read_here, whole_files
from ntl_pretrain.preflight.world import existing_checkpoint

if TYPE_CHECKING:
    from ntl_pretrain.numbers import NumberVocab

SAMPLED_DOCUMENTS = 64  # per training source: enough for a corpus with numbers, a fraction of a second to tokenise
SAMPLED_CHARS = 1 << 20  # per source, for sources whose documents are whole files


@dataclass(frozen=True)
class RunStart:
    """Where a run starts: the checkpoint it resumes (and its step), else `init_from`'s weights, else scratch; and a
    note when the first records give NTL nothing to learn (`no_number_labels_note`)."""

    output_dir: str
    max_steps: int
    resume_from: Path | None
    step: int | None
    init_from: str | None
    numbers_note: str | None = None
    passed_over: tuple[tuple[str, str], ...] = ()
    """(folder, its first problem) of each damaged checkpoint `auto` passes over."""

    @property
    def finished(self) -> bool:
        return self.step is not None and self.step >= self.max_steps

    def describe(self) -> str:
        """What the run will do, in the words of the ranks' first line."""
        if self.resume_from is not None:
            what = f"resumes {self.resume_from} (step {self.step}) and trains to step {self.max_steps}"
            if self.init_from is not None:
                what += f"; init_from {self.init_from} is not loaded"
            for damaged, problem in self.passed_over:
                what += f"; passes over the damaged {damaged} ({problem}), which the run moves to {damaged}.damaged"
        elif self.init_from is not None:
            what = f"starts from the weights of init_from {self.init_from} and trains {self.max_steps} steps"
        else:
            what = f"starts from scratch and trains {self.max_steps} steps"
        return f"{self.output_dir}: {what}"


def check_start(recipe: Recipe, global_batch: int, world_size: int, tokenizer) -> RunStart:
    """The run's start; refuses what its ranks would refuse before step 1: a tokenizer without number tokens while
    NTL is on, a checkpoint trained with another recipe (the resume guard), output-layer slices of another layout.
    A finished run is not launched, but its folder is still refused to another recipe: "nothing to train" would
    say that this recipe's run is done. `tokenizer`: the one `preflight.world.check_tokenizer` loaded (None: the
    checkpoint's)."""
    from ntl_pretrain.model.build import number_vocabulary
    from ntl_pretrain.train import resume_guard

    point = resume_point(recipe)
    folder = point.folder
    passed_over = tuple((entry["checkpoint"], entry["problems"][0]) for entry in point.skipped)
    start = RunStart(recipe.train.output_dir, recipe.train.max_steps, folder,
                     None if folder is None else checkpoint.step_held(folder), recipe.init_from,
                     passed_over=passed_over)  # fmt: skip
    if tokenizer is None and folder is not None:
        tokenizer = _checkpoint_tokenizer(folder, recipe)
    if tokenizer is None:
        return start
    numbers = number_vocabulary(recipe, tokenizer)
    if folder is not None:
        found = resume_guard.resume_differences(folder, recipe, tokenizer, global_batch)
        resume_guard.refuse_differences(folder, [(str(difference), difference.key) for difference in found])
        resume_guard.check_head_layout(folder, recipe, world_size)
    if numbers is None or start.finished:  # nothing is launched (`ntl-pretrain train` says so): no data is read
        return start
    return replace(start, numbers_note=no_number_labels_note(recipe, tokenizer, numbers))


def resume_point(recipe: Recipe) -> checkpoint.ResumePoint:
    """The checkpoint the ranks will resume, judged as they judge it (`checkpoint.choose_resume`, verified in the
    recipe's `checkpoint.verify` mode: checksums unless `size`), so that what is read here (its recipe, config,
    tokenizer, data fingerprint) is what its manifest vouches for, and the dry run names the checkpoint the ranks
    will load. That reads the checkpoint once before launch, as the ranks do again. A damaged explicit resume, or
    an `auto` with no intact checkpoint, is refused here."""
    existing_checkpoint(recipe)  # a train.resume that names no checkpoint: refused as the recipe's error

    def problems(folder: Path) -> list[str]:
        return [str(problem) for problem in manifest.verify(folder, recipe.checkpoint.verify) or []]

    return checkpoint.choose_resume(recipe.train.resume, recipe.train.output_dir, problems)


def _checkpoint_tokenizer(folder: Path, recipe: Recipe):
    from ntl_pretrain.tokenizer import load_tokenizer

    saved = folder / checkpoint.TOKENIZER
    return load_tokenizer(str(saved), trust_remote_code=recipe.tokenizer.trust_remote_code) if saved.is_dir() else None


def no_number_labels_note(recipe: Recipe, tokenizer, numbers: NumberVocab) -> str | None:
    """A note when the first records of every training source read here hold no label NTL acts on (none is one of
    the `numbers`, or they all lie where `ntl_labels: answer` turns NTL off); None when one does, or when no source
    is read here (hub datasets, remote and columnar files, txt files read whole as one document each)."""
    import torch

    is_number = numbers.classes >= 0
    read = [source for source in recipe.data.sources if read_here(source) and not whole_files(source)]
    sampled = [(source, _sampled_labels(source, tokenizer)) for source in read]
    sampled = [(source, labels) for source, labels in sampled if labels is not None]
    if not sampled or any(bool(is_number[torch.from_numpy(labels)].any()) for _, labels in sampled):
        return None
    names = ", ".join(source.label for source, _ in sampled)
    return (f"loss.ntl: no label in the first {SAMPLED_DOCUMENTS} records of {names} is a number token NTL acts on, "
            f"so NTL (weight {recipe.loss.ntl.weight:g}) has nothing to learn from them; `ntl-pretrain data preview` "
            f"shows the number tokens, loss.ntl.kind: null trains with CE alone")  # fmt: skip


def _sampled_labels(source, tokenizer):
    """The token ids NTL would take as labels in the source's first documents (int64 numpy array); None where the
    tokenizer cannot encode them as the data pipeline does (no EOS token: the ranks say so)."""
    import numpy as np

    from ntl_pretrain.data.encoding import DocumentEncoder
    from ntl_pretrain.data.sources import QAText, SourceStream

    stream = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=Counter())
    documents, chars = [], 0
    for document in itertools.islice(iter(stream.next_document, None), SAMPLED_DOCUMENTS):
        if not isinstance(document, QAText):  # a Q/A record is short; its answer's offsets must stay whole
            document = document[: SAMPLED_CHARS - chars]
        documents.append(document)
        chars += len(document)
        if chars >= SAMPLED_CHARS:
            break
    try:
        encoded = DocumentEncoder(tokenizer)(documents)
    except ValueError:
        return None
    tokens = np.concatenate([np.zeros(0, dtype=np.int32), *encoded]).astype(np.int64)
    return tokens[(tokens & NO_NTL) == 0] & TOKEN_BITS
