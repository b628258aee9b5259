"""A study's regime read-out (study/regime.py): passes over the training data from the loader's own count, each
run's best validation step, and each hypothesis's effect at it, computed apart here by brute force."""

from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path

import pytest

from ntl_pretrain.study.decision import DecisionRule, Effect, Hypothesis
from ntl_pretrain.study.regime import regime_section
from ntl_pretrain.study.runs import StudyRun
from ntl_pretrain.study.stats import holm, paired_stats

METRIC = "eval/regression_interpolation/log_mae"
RULE = DecisionRule(
    (Hypothesis("a/ntl", "a/ce", Effect(METRIC, higher_is_better=False), 0.05, 0.05, name="H1"),
     Hypothesis("b/ntl", "b/ce", Effect(METRIC, higher_is_better=False), 0.05, 0.05, name="H2")),
    early_stopping="val_answer_ce",
)  # fmt: skip
SEEDS = (0, 1, 2, 3, 4)
STEPS = range(10, 101, 10)
RECORDS = {"a": 40, "b": 25}  # training records per folder: a's in a gzip file, b's in plain jsonl


def validation(variant: str, seed: int, step: int) -> float:
    """Falls, then rises after a turning step of its own (ties at the turn for seed 0 of a/ce)."""
    turn = 30 + 10 * ((seed + len(variant)) % 5)
    if (variant, seed) == ("a/ce", 0) and step in (30, 40):
        return 1.0  # two lowest values: the earlier step is the best
    return 1.0 + abs(step - turn) / 100


def best(variant: str, seed: int) -> int:
    return min(STEPS, key=lambda step: (validation(variant, seed, step), step))


def log_error(variant: str, seed: int, step: int) -> float:
    return 1.0 - step / 200 + 0.01 * seed - (0.1 + 0.02 * seed if variant.endswith("ntl") else 0.0)


def training_file(tmp_path: Path, folder: str) -> Path:
    lines = "".join(json.dumps({"question": f"q{i}", "answer": "1"}) + "\n" for i in range(RECORDS[folder]))
    if folder == "a":
        path = tmp_path / "train-a.jsonl.gz"
        path.write_bytes(gzip.compress(lines.encode() + b"\n"))  # a blank line is no record
    else:
        path = tmp_path / "train-b.jsonl"
        path.write_text(lines)
    return path


def write_run(tmp_path: Path, variant: str, seed: int) -> StudyRun:
    folder = variant.split("/")[0]
    run = StudyRun(variant, seed, tmp_path / f"{variant}.yaml", tmp_path / "runs" / f"{variant}-seed{seed}")
    run.run_dir.mkdir(parents=True)
    records = []
    for step in STEPS:
        records.append({"step": step, "loss": 1.0, "data/documents": 7.0 * step + seed})
        records.append({"step": step, "split": "validation", "val_answer_ce": validation(variant, seed, step)})
        records.append({"step": step, "split": "eval", METRIC: log_error(variant, seed, step)})
    records.append({"step": 100, "split": "eval", METRIC: 9.0, "model": str(run.run_dir)})  # the final eval: not read
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = training_file(tmp_path, folder)
    (run.run_dir / "recipe.yaml").write_text(f"train: {{max_steps: 100}}\ndata: {{sources: [{{path: '{source}'}}]}}\n")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[StudyRun]:
    tmp_path = tmp_path_factory.mktemp("regime")
    return [write_run(tmp_path, v, seed) for v in ("a/ce", "a/ntl", "b/ce", "b/ntl") for seed in SEEDS]


def table(lines: list[str], header_start: str) -> dict[str, list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_passes_and_best_validation_steps_per_variant(runs: list[StudyRun]) -> None:
    rows = table(regime_section(RULE, runs), "| variant |")
    for variant in ("a/ce", "a/ntl", "b/ce", "b/ntl"):
        documents = statistics.fmean(700.0 + seed for seed in SEEDS)
        records = RECORDS[variant[0]]
        bests = [best(variant, seed) / 100 for seed in SEEDS]
        there = statistics.fmean(log_error(variant, seed, best(variant, seed)) for seed in SEEDS)
        end = statistics.fmean(log_error(variant, seed, 100) for seed in SEEDS)
        assert rows[variant] == [f"{documents:,.0f}", f"{records:,}", f"{documents / records:.2f}",
                                 f"{statistics.fmean(bests):.0%} ({min(bests):.0%}–{max(bests):.0%})",
                                 f"{there:.3f}", f"{end:.3f}"], variant  # fmt: skip
    assert best("a/ce", 0) == 30  # the tie went to the earlier step


def test_each_hypothesis_is_read_at_every_runs_best_validation_step(runs: list[StudyRun]) -> None:
    rows = table(regime_section(RULE, runs), "| hypothesis |")
    effects = {
        name: [log_error(f"{folder}/ce", s, best(f"{folder}/ce", s)) - log_error(f"{folder}/ntl", s,
               best(f"{folder}/ntl", s)) for s in SEEDS]
        for name, folder in (("H1", "a"), ("H2", "b"))
    }  # fmt: skip
    stats = {name: paired_stats(values) for name, values in effects.items()}
    p_t = holm([s.p_t for s in stats.values()])
    p_permutation = holm([s.p_permutation for s in stats.values()])
    for (name, s), pt, pp in zip(stats.items(), p_t, p_permutation, strict=True):
        assert rows[name] == [f"{s.mean:+.3f}", f"[{s.ci95[0]:+.3f}, {s.ci95[1]:+.3f}]", f"{pt:.3g}", f"{pp:.3g}",
                              f"{sum(e > 0 for e in effects[name])}/{len(SEEDS)}"]  # fmt: skip
    assert len({tuple(rows["H1"]), tuple(rows["H2"])}) == 2  # the best steps differ by variant: so do the effects


def test_a_rule_without_an_early_stopping_metric_has_no_regime_section(runs: list[StudyRun]) -> None:
    assert regime_section(dataclasses.replace(RULE, early_stopping=None), runs) == []
