"""A decision rule's effects along training: is a gain at the end a better end point, or only a faster start?

The trainer evaluates the first questions of each set every `eval.every_steps` (`training_evaluations`). For each
hypothesis of a rule, its per-seed effect (the same code the verdict applies, `Hypothesis.per_seed`) is computed
again at each tenth of training: every run is read at its evaluation nearest that fraction of its own
`train.max_steps`. Runs whose schedules buy the same examples in different numbers of steps (study v6's two
tokenizers) are so compared at equal examples all along. Descriptive only: no test, no verdict.
"""

from __future__ import annotations

import math
import statistics

from ntl_pretrain.plot import read_metrics
from ntl_pretrain.reporting.metrics import numeric
from ntl_pretrain.study.decision import DecisionRule, Effect, Hypothesis
from ntl_pretrain.study.runs import StudyRun

FRACTIONS = tuple(tenth / 10 for tenth in range(1, 11))


def training_evaluations(run: StudyRun) -> dict[int, dict]:
    """The trainer's periodic generation metrics (`eval.every_steps`) by step; the final `ntl-pretrain eval`
    record (which names its `model`) is not one of them. A metric that was not finite (no answer had a number) is
    NaN."""
    records = read_metrics(run.folder)
    return {r["step"]: numeric(r) for r in records if r.get("split") == "eval" and "model" not in r}


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


def _by_seed(records: list[dict], key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in records if isinstance(r.get(key), float) and math.isfinite(r[key])}


def _metric_row(variant: str, effect: Effect, tables: list[dict[str, list[dict]]]) -> str:
    """The variant's mean of the effect's metric at each tenth, then its change over the last fifth of training
    (80% to 100%, seed by seed, + is better) with the seeds on which it improved."""
    at = [_by_seed(grouped.get(variant, []), effect.metric) for grouped in tables]
    cells = [f"{statistics.fmean(values.values()):.3f}" if values else "–" for values in at]
    sign = 1.0 if effect.higher_is_better else -1.0
    end, fifth_before = at[-1], at[FRACTIONS.index(0.8)]
    late = [sign * (end[seed] - fifth_before[seed]) for seed in end if seed in fifth_before]
    return f"| {variant} | " + " | ".join(cells) + f" | {_cell(late)} |"


def effects_along_training_section(rule: DecisionRule, runs: list[StudyRun]) -> list[str]:
    """The report's section: per hypothesis, the mean per-seed effect and on how many seeds it was positive, at each
    tenth of training; then each variant's primary metric there and how much it still improved over the last fifth;
    [] when the runs have no periodic evaluations."""
    runs = [run for run in runs if run.variant in rule.variants()]
    curves = [training_evaluations(run) for run in runs]
    if not any(curves):
        return []
    lengths = [run.max_steps() for run in runs]
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
        *_metric_lines(rule, tables),
    ]


def _metric_lines(rule: DecisionRule, tables: list[dict[str, list[dict]]]) -> list[str]:
    """Per primary metric of the rule, each variant's mean at each tenth: had it stopped improving at the end?"""
    lines = []
    for effect in dict.fromkeys(h.effect for h in rule.hypotheses):
        lines += [
            f"`{effect.metric}` of each variant at the same tenths (mean over seeds), and its change over the last "
            "fifth of training (80% to 100%, + is better; (k/n) the seeds on which it improved): a variant that "
            "still improves there had not reached its end point.",
            "",
            "| variant | " + " | ".join(f"{fraction:.0%}" for fraction in FRACTIONS) + " | last fifth |",
            "|---|" + "---:|" * (len(FRACTIONS) + 1),
            *(_metric_row(variant, effect, tables) for variant in sorted(rule.variants())),
            "",
        ]
    return lines
