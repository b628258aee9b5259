"""A study's regime, read out: how often training saw its data, where each run's validation was best, and the
hypotheses' effects read there (study v7's secondary read-out: early stopping).

A run trained for a fixed number of steps may have passed its best some time before its end (study v6's CE runs
over 7,000 questions, 65 passes: best validation at 36–43% of the run). So each run is also read at its best
validation step: the trainer's validation record (`split: validation`) with the lowest value of the rule's
`early_stopping` metric, earliest on a tie, and the trainer's evaluation of the first questions at the evaluated step
nearest it. Each hypothesis's per-seed effect there is computed as its verdict's (`Hypothesis.per_seed`), with the
paired tests each corrected over the rule's family as the verdicts' are: pre-registered as secondary, it gets no
verdict. Passes: the training documents the run read (the loader's `data/documents` at the last step) over the
records of its training files.
"""

from __future__ import annotations

import functools
import gzip
import math
import statistics

import yaml

from ntl_pretrain.package_files import resolve_path
from ntl_pretrain.plot import read_metrics
from ntl_pretrain.reporting.metrics import numeric
from ntl_pretrain.study.decision import DecisionRule
from ntl_pretrain.study.runs import StudyRun
from ntl_pretrain.study.stats import bonferroni, holm, paired_stats
from ntl_pretrain.study.training_gains import nearest, training_evaluations


def validation_curve(run: StudyRun, key: str) -> dict[int, float]:
    """{step: the trainer's validation value of `key`}, finite values only."""
    curve = {}
    for record in read_metrics(run.folder):
        value = numeric(record).get(key) if record.get("split") == "validation" else None
        if isinstance(value, float) and math.isfinite(value):
            curve[record["step"]] = value
    return curve


def best_step(curve: dict[int, float]) -> int | None:
    """The step of the lowest value, the earliest on a tie; None for an empty curve."""
    return min(curve, key=lambda step: (curve[step], step), default=None)


@functools.cache
def training_records(spec: str) -> int:
    """Non-empty lines of a training file (jsonl, txt; gzip by its name): one document each."""
    path = resolve_path(spec)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def passes(run: StudyRun) -> tuple[float, int] | None:
    """(training documents read, records of the training files) of a run; None when it logged no `data/documents`
    or names a training file that is not here."""
    read = [r["data/documents"] for r in read_metrics(run.folder) if "data/documents" in r and "split" not in r]
    recipe = yaml.safe_load((run.folder / "recipe.yaml").read_text())
    try:
        records = sum(training_records(source["path"]) for source in recipe["data"]["sources"])
    except (OSError, KeyError, ValueError):
        return None
    return (float(read[-1]), records) if read and records else None


def _early_stopped(run: StudyRun, key: str) -> tuple[int, int, dict] | None:
    """(best validation step, the run's schedule, the trainer's evaluation nearest that step), or None."""
    step = best_step(validation_curve(run, key))
    evaluations = training_evaluations(run)
    evaluated = None if step is None else nearest(evaluations, step)
    return None if evaluated is None else (step, run.max_steps(), evaluations[evaluated])


def regime_section(rule: DecisionRule, runs: list[StudyRun]) -> list[str]:
    """The report's section (empty when the rule names no `early_stopping` metric): per variant the passes and the
    best validation step, then per hypothesis its effect at each run's best validation step."""
    key = rule.early_stopping
    runs = [run for run in runs if run.variant in rule.variants()]
    if key is None or not runs:
        return []
    stopped = {run: _early_stopped(run, key) for run in runs}
    return [
        "## The regime: passes over the training data, each run's best validation step, and the effects there",
        "",
        f"Passes: training documents read over the records of the run's training files. Best validation step: the "
        f"trainer's validation with the lowest `{key}` (the earliest on a tie), as a share of the run's schedule "
        "(mean, and the range over seeds). At it, each run is read at the trainer's own evaluation of the first "
        "questions nearest that step, as an early-stopped model would be; the primary metric there is beside its "
        "value at the end of the same evaluations.",
        "",
        *_variant_table(rule, runs, stopped),
        "",
        *_effect_lines(rule, runs, stopped),
    ]


def _variant_table(rule: DecisionRule, runs: list[StudyRun], stopped: dict) -> list[str]:
    metric = rule.hypotheses[0].effect.metric
    lines = [f"| variant | documents read | training records | passes | best validation step | `{metric}` there | "
             "at the end |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for variant in sorted(rule.variants()):
        mine = [run for run in runs if run.variant == variant]
        read = [p for p in map(passes, mine) if p is not None]
        documents = statistics.fmean(r for r, _ in read) if read else math.nan
        records = read[0][1] if read else 0
        shares = [s[0] / s[1] for s in (stopped[run] for run in mine) if s is not None]
        there = [s[2].get(metric, math.nan) for s in (stopped[run] for run in mine) if s is not None]
        ends = [_last(training_evaluations(run), metric) for run in mine]
        passed = documents / records if records else math.nan
        lines.append(f"| {variant} | {documents:,.0f} | {records:,} | {passed:.2f} | {_share(shares)} | "
                     f"{_mean(there)} | {_mean(ends)} |")  # fmt: skip
    return lines


def _effect_lines(rule: DecisionRule, runs: list[StudyRun], stopped: dict) -> list[str]:
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        if stopped[run] is not None:
            grouped.setdefault(run.variant, []).append(stopped[run][2] | {"seed": run.seed})
    hypotheses = [h for h in rule.hypotheses if all(name in grouped for name in (h.variant, h.baseline,
                                                                                    *(h.against or ())))]  # fmt: skip
    effects = [paired_stats(h.per_seed(grouped)) for h in hypotheses]
    correct = holm if rule.correction == "holm" else bonferroni
    p_t, p_permutation = correct([e.p_t for e in effects]), correct([e.p_permutation for e in effects])
    rows = [f"| {h.name or h.compared()} | {e.mean:+.3f} | [{e.ci95[0]:+.3f}, {e.ci95[1]:+.3f}] | {pt:.3g} | "
            f"{pp:.3g} | {sum(d > 0 for d in h.per_seed(grouped))}/{e.n} |"
            for h, e, pt, pp in zip(hypotheses, effects, p_t, p_permutation, strict=True)]  # fmt: skip
    return [
        "Each hypothesis's effect at every run's best validation step (secondary, no verdict): the mean per-seed "
        f"effect, + is better, its 95% CI, the paired t-test's and the permutation test's p, each "
        f"{rule.correction.capitalize()}-corrected over these {len(hypotheses)}, and the seeds on which it was "
        "positive.",
        "",
        "| hypothesis | mean | 95% CI | p(t) | p(perm) | seeds + |",
        "|---|---:|---|---:|---:|---:|",
        *rows,
        "",
    ]


def _last(curve: dict[int, dict], metric: str) -> float:
    return curve[max(curve)].get(metric, math.nan) if curve else math.nan


def _mean(values: list[float]) -> str:
    finite = [value for value in values if isinstance(value, float) and math.isfinite(value)]
    return f"{statistics.fmean(finite):.3f}" if finite else "–"


def _share(shares: list[float]) -> str:
    return f"{statistics.fmean(shares):.0%} ({min(shares):.0%}–{max(shares):.0%})" if shares else "–"
