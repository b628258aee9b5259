"""The hypotheses' effects along training (study/training_gains.py): each run read at the evaluation nearest each
tenth of its own schedule, so runs of different lengths are compared at the same share of training, and each
hypothesis's effect there computed as its verdict's."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ntl_pretrain.study import report
from ntl_pretrain.study.decision import DecisionRule, Effect, Hypothesis
from ntl_pretrain.study.report import write_report
from ntl_pretrain.study.runs import StudyRun
from ntl_pretrain.study.training_gains import effects_along_training_section

METRIC = "eval/regression_interpolation/log_mae"
LOG_ERROR = Effect(METRIC, higher_is_better=False)
RULE = DecisionRule((
    Hypothesis("short/ntl", "short/ce", LOG_ERROR, 0.02, 0.02, name="H1"),
    Hypothesis("long/ntl", "long/ce", LOG_ERROR, 0.02, 0.02, name="H2"),
    Hypothesis("short/ntl", "short/ce", LOG_ERROR, 0.03, 0.03, against=("long/ntl", "long/ce"), name="H3"),
))  # fmt: skip
# (max_steps, evaluation interval): "long" buys the same examples in 1.62× the steps, read every 16 steps
SCHEDULES = {"short": (100, 10), "long": (162, 16)}
SEEDS = (0, 1, 2, 3)


def log_error(variant: str, seed: int, step: int) -> float:
    """A made-up curve per run: falling with training, NTL lower early under "short" and late under "long"."""
    folder, arm = variant.split("/")
    fraction = step / SCHEDULES[folder][0]
    ntl_gain = 0.3 * (1 - fraction) if folder == "short" else 0.2 * fraction
    noise = 0.01 * ((seed * 7 + step) % 5)
    return 1.0 / (1 + 5 * fraction) + noise - (ntl_gain * (1 + 0.1 * seed) if arm == "ntl" else 0.0)


def evaluated_steps(folder: str) -> list[int]:
    length, every = SCHEDULES[folder]
    return sorted({*range(every, length + 1, every), length})  # the trainer also evaluates at its last step


def write_run(tmp_path: Path, variant: str, seed: int) -> StudyRun:
    folder = variant.split("/")[0]
    run = StudyRun(variant, seed, tmp_path / "recipes" / f"{variant}.yaml", tmp_path / f"{variant}-seed{seed}")
    run.run_dir.mkdir(parents=True)
    records = [{"step": step, "loss": 1.0} for step in (1, 2)]
    for step in evaluated_steps(folder):
        value: float | str = log_error(variant, seed, step)
        if (variant, seed, step) == ("short/ce", 2, 10):
            value = "nan"  # no answer had a number: the metrics file writes NaN as a string
        record = {"step": step, "split": "eval", METRIC: value, "eval/regression_interpolation/examples": 200.0}
        records.append(record)
    final = {"step": SCHEDULES[folder][0], "split": "eval", METRIC: 9.0, "model": str(run.run_dir)}  # not periodic
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*records, final]))
    (run.run_dir / "recipe.yaml").write_text(f"train: {{max_steps: {SCHEDULES[folder][0]}}}\n")
    final_results = {METRIC: 9.0, "eval/regression_interpolation/exact_match": 0.1,
                     "eval/regression_interpolation/examples": 1e3}  # fmt: skip
    (run.run_dir / "eval.json").write_text(json.dumps(final_results))
    (run.run_dir / "study.json").write_text(json.dumps({"train_s": 1.0, "eval_s": 1.0}))
    return run


def reference_value(variant: str, seed: int, fraction: float) -> float:
    """The run's log-error at the evaluation nearest the fraction, found by brute force; NaN where it was written so."""
    folder = variant.split("/")[0]
    length = SCHEDULES[folder][0]
    step = min(evaluated_steps(folder), key=lambda s: (abs(s - fraction * length), s))
    return math.nan if (variant, seed, step) == ("short/ce", 2, 10) else log_error(variant, seed, step)


def reference_gain(folder: str, seed: int, fraction: float) -> float:
    """CE's log-error minus NTL's at the evaluation nearest the fraction."""
    return reference_value(f"{folder}/ce", seed, fraction) - reference_value(f"{folder}/ntl", seed, fraction)


def expected_cell(effects: list[float]) -> str:
    effects = [effect for effect in effects if math.isfinite(effect)]
    return f"{statistics.fmean(effects):+.3f} ({sum(e > 0 for e in effects)}/{len(effects)})"


def test_each_hypothesis_is_read_at_the_same_share_of_every_runs_schedule(tmp_path: Path) -> None:
    runs = [write_run(tmp_path, v, seed) for v in ("short/ce", "short/ntl", "long/ce", "long/ntl") for seed in SEEDS]
    lines = effects_along_training_section(RULE, runs)
    header = lines.index("| hypothesis | 10% | 20% | 30% | 40% | 50% | 60% | 70% | 80% | 90% | 100% |")
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in lines[header + 2 :] if line}
    fractions = [tenth / 10 for tenth in range(1, 11)]
    short = [[reference_gain("short", seed, f) for seed in SEEDS] for f in fractions]
    long = [[reference_gain("long", seed, f) for seed in SEEDS] for f in fractions]
    assert rows["H1"] == [expected_cell(gains) for gains in short]
    assert rows["H2"] == [expected_cell(gains) for gains in long]
    assert rows["H3"] == [
        expected_cell([s - g for s, g in zip(a, b, strict=True)]) for a, b in zip(short, long, strict=True)
    ]
    assert rows["H1"][0].endswith("(3/3)")  # seed 2's CE had no number at step 10: left out, not counted as a loss
    assert rows["H1"][-1].startswith("+0.000") and rows["H2"][-1].startswith("+0.2")  # a faster start; a later gain
    # "long" read at 16, 32, 48, 64, 80, 96, 112, 128, 144, 162: furthest is 144 for 145.8, 1.1% of 162 steps
    assert "from the trainer's own evaluation of the first 200 questions" in lines[2]
    assert "at most 1.1% of a schedule away" in lines[2]

    metric_header = lines.index("| variant | 10% | 20% | 30% | 40% | 50% | 60% | 70% | 80% | 90% | 100% | last fifth |")
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in lines[metric_header + 2:]
            if line}  # fmt: skip
    assert list(rows) == ["long/ce", "long/ntl", "short/ce", "short/ntl"]
    for variant, cells in rows.items():
        values = [[reference_value(variant, seed, f) for seed in SEEDS] for f in fractions]
        means = [statistics.fmean(v for v in at if math.isfinite(v)) for at in values]
        assert cells[:-1] == [f"{mean:.3f}" for mean in means], variant
        late = [earlier - end for earlier, end in zip(values[7], values[9], strict=True)]  # lower is better
        assert cells[-1] == expected_cell(late), variant


def test_the_report_states_the_effects_along_training_after_the_verdicts(tmp_path: Path, monkeypatch) -> None:
    runs = [write_run(tmp_path, v, seed) for v in ("short/ce", "short/ntl", "long/ce", "long/ntl") for seed in SEEDS]
    assert effects_along_training_section(DecisionRule(()), runs) == []  # no hypothesis reads these runs
    monkeypatch.setattr(report, "setup_lines", lambda runs, overrides: [])  # they load real recipes; not tested here
    doc = tmp_path / "docs" / "study.md"
    write_report(runs, doc, doc.with_suffix(".png"), "ntl-pretrain study", [], rule=RULE)
    text = doc.read_text()
    decision = text.index("## Decision")
    along = text.index("## The hypotheses' effects along training (descriptive)")
    assert decision < along < text.index("## Results")
