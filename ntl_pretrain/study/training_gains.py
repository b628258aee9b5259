"""A decision rule's effects along training: is a gain at the end a better end point, or only a faster start?

The trainer evaluates the first questions of each set every `eval.every_steps` (`training_evaluations`). For each
hypothesis of a rule, its per-seed effect (the same code the verdict applies, `Hypothesis.per_seed`) is computed
again at each tenth of training: every run is read at its evaluation nearest that fraction of its own
`train.max_steps`. Runs whose schedules buy the same examples in different numbers of steps (study v6's two
tokenizers) are so compared at equal examples all along. Descriptive only: no test, no verdict.
"""

from __future__ import annotations

import statistics

import yaml

from ntl_pretrain.plot import read_metrics
from ntl_pretrain.reporting.metrics import numeric
from ntl_pretrain.study.decision import DecisionRule, Hypothesis
from ntl_pretrain.study.runs import StudyRun

FRACTIONS = tuple(tenth / 10 for tenth in range(1, 11))


def training_evaluations(run: StudyRun) -> dict[int, dict]:
    """The trainer's periodic generation metrics (`eval.every_steps`) by step; the final `ntl-pretrain eval`
    record (which names its `model`) is not one of them. A metric that was not finite (no answer had a number) is
    NaN."""
    records = read_metrics(run.folder)
    return {r["step"]: numeric(r) for r in records if r.get("split") == "eval" and "model" not in r}


def max_steps(run: StudyRun) -> int:
    """The run's schedule length, from the recipe the trainer wrote beside its results."""
    return int(yaml.safe_load((run.folder / "recipe.yaml").read_text())["train"]["max_steps"])


def nearest(evaluations: dict[int, dict], step: float) -> int | None:
    """The evaluated step nearest `step` (the earlier one on a tie); None when there is none."""
    return min(evaluations, key=lambda evaluated: (abs(evaluated - step), evaluated), default=None)


def at_fraction(runs: list[StudyRun], curves: list[dict[int, dict]], lengths: list[int], fraction: float):
    """({variant: [evaluation | seed]}, the largest distance of a read step from its target, as a share of its
    run's schedule) for the runs' evaluations nearest `fraction` of their schedules."""
    grouped: dict[str, list[dict]] = {}
    off = 0.0
    for run, curve, length in zip(runs, curves, lengths, strict=True):
        step = nearest(curve, fraction * length)
        if step is None:
            continue
        off = max(off, abs(step - fraction * length) / length)
        grouped.setdefault(run.variant, []).append(curve[step] | {"seed": run.seed})
    return grouped, off


def _cell(effects: list[float]) -> str:
    if not effects:
        return "–"
    better = sum(effect > 0 for effect in effects)
    return f"{statistics.fmean(effects):+.3f} ({better}/{len(effects)})"


def _row(h: Hypothesis, tables: list[dict[str, list[dict]]]) -> str:
    cells = []
    for grouped in tables:
        pairs = (h.variant, h.baseline, *(h.against or ()))
        cells.append(_cell(h.per_seed(grouped) if all(name in grouped for name in pairs) else []))
    return f"| {h.name or h.compared()} | " + " | ".join(cells) + " |"


def effects_along_training_section(rule: DecisionRule, runs: list[StudyRun]) -> list[str]:
    """The report's section: per hypothesis, the mean per-seed effect and on how many seeds it was positive, at each
    tenth of training; [] when the runs have no periodic evaluations."""
    runs = [run for run in runs if run.variant in rule.variants()]
    curves = [training_evaluations(run) for run in runs]
    if not any(curves):
        return []
    lengths = [max_steps(run) for run in runs]
    tables, off = [], 0.0
    for fraction in FRACTIONS:
        grouped, distance = at_fraction(runs, curves, lengths, fraction)
        tables.append(grouped)
        off = max(off, distance)
    questions = next((f"{value:.0f} " for curve in curves for record in curve.values()
                      for key, value in record.items() if key.endswith("/examples")), "")  # fmt: skip
    return [
        "## The hypotheses' effects along training (descriptive)",
        "",
        f"Each hypothesis's per-seed effect, computed as its verdict's, from the trainer's own evaluation of the "
        f"first {questions}questions (not the final evaluation of all of them), at each tenth of every run's "
        f"own schedule: runs of different lengths are read at the same share of their training, the evaluated step "
        f"nearest it (at most {off:.1%} of a schedule away). Cell: the mean effect, + is better, and (k/n) the "
        "seeds on which it was positive. A gain that is large early and shrinks is a faster start; one that stays "
        "or grows is a better end point.",
        "",
        "| hypothesis | " + " | ".join(f"{fraction:.0%}" for fraction in FRACTIONS) + " |",
        "|---|" + "---:|" * len(FRACTIONS),
        *(_row(h, tables) for h in rule.hypotheses),
        "",
    ]
