"""The runs of a study: one per (variant, seed), named, paired with a CE baseline, read from their folders.

A run's results are read from its archived copy (`--archive`, study/archive.py) when that is complete, else from
its run folder, so the report, `runs.csv` and the statistics work alike from either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.evaluation.answers import error_profile
from ntl_pretrain.reporting.metrics import written_records
from ntl_pretrain.study.archive import is_complete, read_answers
from ntl_pretrain.study.token_classes import exact_match_by_class, trained_tokenizer

BASELINE = "ce"


@dataclass(frozen=True)
class StudyRun:
    variant: str
    seed: int
    recipe: Path
    run_dir: Path
    archive: Path | None = None
    """The folder that holds (or will hold) this run's archived result files; None without `--archive`."""

    @property
    def name(self) -> str:
        return f"{self.variant.replace('/', '-')}-seed{self.seed}"

    @property
    def done_file(self) -> Path:
        return self.run_dir / "study.json"

    @property
    def archived(self) -> bool:
        return self.archive is not None and is_complete(self.archive)

    @property
    def done(self) -> bool:
        return self.archived or self.done_file.is_file()

    @property
    def folder(self) -> Path:
        """Where the finished run's results are read: its archived copy when complete, else its run folder."""
        return self.archive if self.archive is not None and self.archived else self.run_dir

    def results(self) -> dict:
        return json.loads((self.folder / "eval.json").read_text())

    def timing(self) -> dict:
        return json.loads((self.folder / "study.json").read_text())

    def answers(self) -> list[dict] | None:
        """Every question's record from `ntl-pretrain eval --answers`; None for a run evaluated without them."""
        return read_answers(self.folder)

    def error_profiles(self) -> dict[str, dict[str, float]]:
        """`error_profile` of each question set's answers ({} without answers)."""
        by_set: dict[str, list[dict]] = {}
        for record in self.answers() or []:
            by_set.setdefault(record["set"], []).append(record)
        return {qa_set: error_profile(records) for qa_set, records in by_set.items()}

    def max_steps(self) -> int:
        """The run's schedule length, `train.max_steps` of the recipe the trainer wrote beside its results."""
        return int(yaml.safe_load((self.folder / "recipe.yaml").read_text())["train"]["max_steps"])

    def progress(self) -> float:
        """The share of `train.max_steps` trained: 1 when done, else the last training step in metrics.jsonl over
        the max_steps of the recipe the trainer wrote (0 before either exists). No result, only how far."""
        if self.done:
            return 1.0
        recipe, metrics = self.run_dir / "recipe.yaml", self.run_dir / "metrics.jsonl"
        if not recipe.is_file() or not metrics.is_file():
            return 0.0
        steps = [record.get("step", 0) for record in written_records(metrics) if "loss" in record]
        return min(max(steps, default=0) / self.max_steps(), 1.0)

    def exact_match_by_class(self) -> dict[str, float]:
        """Exact match per class of the answer's token under the run's tokenizer (study/token_classes.py); {}
        without answers or without a tokenizer named in the run's recipe."""
        answers, tokenizer = self.answers(), trained_tokenizer(self.folder / "recipe.yaml")
        return {} if not answers or tokenizer is None else exact_match_by_class(answers, *tokenizer)

    def measured(self) -> dict:
        """Everything the run measured: its evaluation results, exact match per answer token class, then
        `errors/<set>/<key>` from its answers."""
        profiles = self.error_profiles()
        errors = {f"errors/{qa_set}/{key}": value for qa_set, p in profiles.items() for key, value in p.items()}
        return self.results() | self.exact_match_by_class() | errors


def plan(
    recipes: Path, variants: list[str], seeds: list[int], runs_dir: Path, archive: Path | None = None
) -> list[StudyRun]:
    runs = []
    for variant in variants:
        recipe = recipes / f"{variant}.yaml"
        if not recipe.is_file():
            raise RecipeError(f"{recipe}: no recipe for variant {variant!r}")
        for seed in seeds:
            run = StudyRun(variant, seed, recipe, runs_dir / f"{variant}-seed{seed}")
            runs.append(replace(run, archive=archive / run.name) if archive is not None else run)
    return runs


def baseline_of(variant: str) -> str:
    """The CE variant an NTL variant is paired with: `ce` in the same recipe folder (same tokenizer, data, model)."""
    folder, _, _ = variant.rpartition("/")
    return f"{folder}/{BASELINE}" if folder else BASELINE
