"""The study's report: Markdown tables of what the runs measured, paired statistics, verdicts, plot, runs.csv.

Every NTL variant is compared with the CE run of the same seed in its own recipe folder (`study_runs.baseline_of`).
The report states the comparison; a conclusion comes only from a decision rule fixed before the runs
(`study_decision.DecisionRule`, applied by code when given).
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ntl_pretrain.outputs import write_file, write_text
from ntl_pretrain.plot import plot_runs
from ntl_pretrain.study.decision import DecisionRule, decide, verdict_lines
from ntl_pretrain.study.provenance import describe
from ntl_pretrain.study.regime import regime_section
from ntl_pretrain.study.runs import BASELINE, StudyRun, baseline_of
from ntl_pretrain.study.stats import paired_gains, paired_stats
from ntl_pretrain.study.token_classes import class_title, labels_in
from ntl_pretrain.study.training_gains import effects_along_training_section, training_evaluations

if TYPE_CHECKING:
    from ntl_pretrain.config.recipe import Recipe


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    higher_is_better: bool
    digits: int
    paired: bool = True
    """False for a count the same in every run (questions per answer class): no paired statistics."""


# Per question/answer set `<set>` (the labels of the recipe's eval.qa_sets, e.g. `addition_interpolation`).
GENERATION_METRICS = (
    ("exact_match", "exact match", True, 3),
    ("mae", "MAE", False, 3),
    ("log_mae", "log10(1+AE)", False, 3),
    ("r2", "R²", True, 3),
    ("digit_accuracy", "digit acc.", True, 3),
    ("unparseable", "unparseable", False, 3),
)
VALIDATION_METRICS = (
    Metric("val_ce", "val CE", False, 3),
    Metric("val_number_ce", "val CE at number labels", False, 3),
    Metric("val_ntl_was", "val NTL-WAS", False, 3),
    Metric("val_ntl_digits", "val NTL-digits", False, 3),
    Metric("val_ntl_number", "val NTL-number", False, 3),
    Metric("val_answer_ce", "val CE at answer labels", False, 3),
    Metric("val_answer_ntl_was", "val NTL-WAS at answer labels", False, 3),
    Metric("val_answer_ntl_digits", "val NTL-digits at answer labels", False, 3),
)
# Per question set, from each run's answers (`error_profile`): how close the wrong last digits came (higher is
# better), and the size of the errors robust to a few wild answers (lower is better).
ERROR_METRICS = (
    Metric("errors/{set}/last_digit_off_by_one", "{set} wrong last digits off by 1", True, 3),
    Metric("errors/{set}/median_ae", "{set} median AE", False, 3),
    Metric("errors/{set}/trimmed_mae", "{set} MAE of the best 90%", False, 3),
)


def qa_sets(results: dict) -> list[str]:
    """The question/answer sets an evaluation scored, in its order (every set reports `eval/<set>/examples`)."""
    return [key.split("/")[1] for key in results if key.startswith("eval/") and key.endswith("/examples")]


def token_class_metrics(qa_set: str, keys: set[str]) -> list[Metric]:
    """Exact match per class of the answer's token (study/token_classes.py) that `keys` hold for `qa_set`, each
    beside its number of questions."""
    metrics = []
    for label in labels_in(keys, qa_set):
        title = f"{qa_set} {class_title(label)} answers"
        metrics.append(Metric(f"eval/{qa_set}/exact_match_{label}_token", f"{title}: exact match", True, 3))
        metrics.append(Metric(f"eval/{qa_set}/examples_{label}_token", f"{title}: count", True, 0, paired=False))
    return metrics


def generation_metrics(sets: list[str]) -> list[Metric]:
    metrics = []
    for qa_set in sets:
        metrics += [Metric(f"eval/{qa_set}/{name}", f"{qa_set} {title}", higher, digits)
                    for name, title, higher, digits in GENERATION_METRICS]  # fmt: skip
        metrics += [replace(metric, key=metric.key.format(set=qa_set), title=metric.title.format(set=qa_set))
                    for metric in ERROR_METRICS]  # fmt: skip
    return metrics


def mean_std(values: list[float]) -> tuple[float, float]:
    """Over the finite values (MAE is NaN for a run none of whose answers parsed); NaN when there are none."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def by_variant(runs: list[StudyRun], measured: list[dict]) -> dict[str, list[dict]]:
    """Each variant's measurements (`StudyRun.measured`, in the order of `runs`), one per seed, with the run's
    `seed` added (to pair runs across variants)."""
    grouped: dict[str, list[dict]] = {}
    for run, results in zip(runs, measured, strict=True):
        grouped.setdefault(run.variant, []).append(results | {"seed": run.seed})
    return grouped


def _format(value: float, digits: int) -> str:
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 1e5:
        return f"{value:.3g}"
    return f"{value:,.{digits}f}"


def _mean_std_cell(values: list[float], digits: int, seeds: int) -> str:
    """`mean ± std` of one table cell; the mean alone for one seed, "n/a" when no value is finite."""
    mean, std = mean_std(values)
    spread = f" ± {_format(std, digits)}" if seeds > 1 and math.isfinite(mean) else ""
    return _format(mean, digits) + spread


def results_table(grouped: dict[str, list[dict]], metrics: list[Metric]) -> list[str]:
    """One row per metric: mean ± std per variant, then each NTL variant's difference from its CE baseline."""
    others = [v for v in grouped if baseline_of(v) != v and baseline_of(v) in grouped]
    header = ["metric", *grouped, *(f"{variant} − {baseline_of(variant)}" for variant in others)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for metric in metrics:
        cells = []
        for results in grouped.values():
            cells.append(_mean_std_cell([result[metric.key] for result in results], metric.digits, len(results)))
        cells += [_compare(metric, grouped[variant], grouped[baseline_of(variant)]) for variant in others]
        lines.append(f"| {metric.title} | " + " | ".join(cells) + " |")
    return lines


def learning_curve_table(curves: dict[str, list[dict[int, dict]]], key: str, digits: int = 3) -> list[str]:
    """`key` at every step the trainer evaluated, mean ± std over each variant's seeds (`curves`: variant ->
    `training_evaluations` per seed); [] when it never did."""
    steps = sorted({step for per_seed in curves.values() for evaluations in per_seed for step in evaluations})
    if not steps:
        return []
    lines = ["| variant | " + " | ".join(f"step {step}" for step in steps) + " |", "|---|" + "---:|" * len(steps)]
    for variant, per_seed in curves.items():
        cells = []
        for step in steps:
            values = [e[step][key] for e in per_seed if step in e and key in e[step]]
            cells.append(_mean_std_cell(values, digits, len(per_seed)))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def learning_curve_section(runs: list[StudyRun]) -> list[str]:
    """Exact match of each question set during training: when the final numbers tie, how fast each loss got there."""
    curves: dict[str, list[dict[int, dict]]] = {}
    for run in runs:
        curves.setdefault(run.variant, []).append(training_evaluations(run))
    evaluations = [e for per_seed in curves.values() for per_run in per_seed for e in per_run.values()]
    if not evaluations:
        return []
    sets = qa_sets(runs[0].results())
    lines = ["## During training: exact match", "",
             f"The trainer's own evaluation (`eval.every_steps`) on the first "
             f"{_format(evaluations[0].get(f'eval/{sets[0]}/examples', math.nan), 0)} questions of each set, "
             "mean ± std over seeds.", ""]  # fmt: skip
    for qa_set in sets:
        lines += [f"{qa_set}:", "", *learning_curve_table(curves, f"eval/{qa_set}/exact_match"), ""]
    return lines


# `error_profile`'s keys, their column titles and decimals.
ERROR_PROFILE = (
    ("exact", "exact", 3),
    ("last_digit_wrong", "last digit wrong", 3),
    ("higher_digit_wrong", "last digit right, answer wrong", 3),
    ("last_digit_off_by_one", "wrong last digits off by 1", 3),
    ("last_digit_distance", "mean |Δ| of wrong last digits", 2),
)


def error_profile_section(runs: list[StudyRun]) -> list[str]:
    """Per question set, each variant's `error_profile` (mean ± std over seeds); [] unless every run saved its
    answers (runs evaluated before `--answers` existed did not)."""
    per_run = [run.error_profiles() for run in runs]
    if not all(per_run):
        return []
    profiles: dict[str, dict[str, list[dict]]] = {}
    for run, by_set in zip(runs, per_run, strict=True):
        for qa_set, profile in by_set.items():
            profiles.setdefault(qa_set, {}).setdefault(run.variant, []).append(profile)
    lines = ["## How the answers were wrong", "",
             "From each run's `answers.jsonl` (`ntl-pretrain eval --answers`): shares of all questions, then how far "
             "the wrong last digits were from the right ones; mean ± std over seeds.", ""]  # fmt: skip
    for qa_set, by_variant_profiles in profiles.items():
        lines += [f"{qa_set}:", "", "| variant | " + " | ".join(title for _, title, _ in ERROR_PROFILE) + " |"]
        lines.append("|---|" + "---:|" * len(ERROR_PROFILE))
        for variant, per_seed in by_variant_profiles.items():
            cells = [
                _mean_std_cell([profile[key] for profile in per_seed], digits, len(per_seed))
                for key, _, digits in ERROR_PROFILE
            ]
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def per_run_table(runs: list[StudyRun], measured: list[dict], metrics: list[Metric]) -> list[str]:
    lines = ["| run | " + " | ".join(metric.title for metric in metrics) + " | train s | eval s | code | device |"]
    lines.append("|---|" + "---:|" * (len(metrics) + 2) + "---|---|")
    for run, results in zip(runs, measured, strict=True):
        timing = run.timing()
        cells = [_format(results[metric.key], metric.digits) for metric in metrics]
        cells += [f"{timing['train_s']:.0f}", f"{timing['eval_s']:.0f}", describe(timing.get("code")),
                  timing.get("device", "not recorded")]  # fmt: skip
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return lines


def paired_section(grouped: dict[str, list[dict]], metrics: list[Metric]) -> list[str]:
    """Per NTL variant, every metric's paired statistics against its CE baseline (`study_stats.paired_stats`)."""
    compared = [v for v in grouped if baseline_of(v) != v and baseline_of(v) in grouped]
    metrics = [metric for metric in metrics if metric.paired]
    if not compared:
        return []
    lines = ["## Paired differences", "",
             "Per seed, the variant's run minus the CE run of the same seed (same initialisation and data order), "
             "signed so that + is better (CE minus the variant for the lower-is-better metrics); over the seeds where "
             "both runs measured the metric: the mean, its 95% confidence interval (t, n − 1 degrees of freedom), the "
             "paired t statistic and its two-sided p, and the two-sided sign-flip permutation p (exact over all 2^n "
             "sign patterns up to n = 20, else a seeded sample of 100,000). Uncorrected for the many metrics: only "
             "the protocol's primary comparison decides anything.", ""]  # fmt: skip
    for variant in compared:
        header = "| metric | mean gain | 95% CI | t | p(t) | p(perm) | n |"
        lines += [f"{variant} − {baseline_of(variant)}:", "", header, "|---|" + "---:|" * 6]
        for metric in metrics:
            gains = paired_gains(grouped[variant], grouped[baseline_of(variant)], metric.key, metric.higher_is_better)
            stats = paired_stats(gains)
            low, high = (_signed(value, metric.digits) for value in stats.ci95)
            cells = [_signed(stats.mean, metric.digits), f"[{low}, {high}]", _signed(stats.t, 2), _p(stats.p_t),
                     _p(stats.p_permutation), str(stats.n)]  # fmt: skip
            lines.append(f"| {metric.title} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _signed(value: float, digits: int) -> str:
    if math.isnan(value):
        return "n/a"
    return ("+" if value >= 0 else "−") + (_format(abs(value), digits) if math.isfinite(value) else "∞")


def _p(p: float) -> str:
    return "n/a" if math.isnan(p) else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def write_runs_csv(runs: list[StudyRun], measured: list[dict], path: Path) -> None:
    """One row per run: variant, seed, every evaluation result and error-profile key any run has, timing, and the
    code that ran it (study/provenance.py)."""
    keys = list(dict.fromkeys(key for results in measured for key in results))

    def write(partial: Path) -> None:
        with partial.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["run", "variant", "seed", *keys, "train_s", "eval_s", "code", "device"])
            for run, results in zip(runs, measured, strict=True):
                timing = run.timing()
                values = [results.get(key, "") for key in keys]
                code, device = describe(timing.get("code")), timing.get("device", "not recorded")
                writer.writerow([run.name, run.variant, run.seed, *values, timing["train_s"], timing["eval_s"], code,
                                 device])  # fmt: skip

    write_file(path, write)


def _compare(metric: Metric, results: list[dict], baseline: list[dict]) -> str:
    """Difference of means from the baseline (+ is better), and on how many of the seeds where they differ the
    variant beat the baseline run of the same seed: the same initialisation and data order, so each pair differs
    only in the loss."""
    sign = 1.0 if metric.higher_is_better else -1.0
    ours = {r["seed"]: sign * r.get(metric.key, math.nan) for r in results}
    base = {r["seed"]: sign * r.get(metric.key, math.nan) for r in baseline}
    finite_ours = [value for value in ours.values() if math.isfinite(value)]
    finite_base = [value for value in base.values() if math.isfinite(value)]
    if not finite_ours or not finite_base:
        return "n/a"
    gain = statistics.fmean(finite_ours) - statistics.fmean(finite_base)
    pairs = [(ours[seed], base[seed]) for seed in ours.keys() & base.keys()]
    # Ties (both 0% on a set nobody learned) say nothing either way: left out, as in a sign test.
    pairs = [(mine, theirs) for mine, theirs in pairs if math.isfinite(mine - theirs) and mine != theirs]
    wins = f" ({sum(mine > theirs for mine, theirs in pairs)}/{len(pairs)})" if len(pairs) > 1 else ""
    return f"{'+' if gain >= 0 else '−'}{_format(abs(gain), metric.digits)}{wins}"


def low_accuracy_notes(grouped: dict[str, list[dict]], threshold: float = 0.05) -> list[str]:
    """Say so when no variant answers more than `threshold` of a set exactly: differences in exact match are then
    a handful of questions, and the error and digit metrics carry what signal there is."""
    notes = []
    first = next(iter(grouped.values()))[0]
    for qa_set in qa_sets(first):
        key = f"eval/{qa_set}/exact_match"
        best = max((mean_std([r[key] for r in results])[0] for results in grouped.values()), default=math.nan)
        if math.isfinite(best) and best < threshold:
            notes.append(
                f"- {qa_set}: the best variant's mean exact match is {best:.1%} (of "
                f"{int(first[f'eval/{qa_set}/examples'])} questions): at this budget the "
                "models have not learned the task, so exact-match differences are a few questions; compare the error "
                "and digit metrics instead."
            )
    return notes


def present_metrics(grouped: dict[str, list[dict]]) -> list[Metric]:
    """Generation metrics per question set (exact match per answer token class after each set's own), validation
    CE and NTL, then per-source validation CE (`val/<source>/ce`): those that every run reports (runs evaluated by
    an older version lack newer metrics)."""
    keys = set.intersection(*(set(result) for results in grouped.values() for result in results))
    sources = sorted({key.split("/")[1] for key in keys if key.startswith("val/") and key.endswith("/ce")})
    extra = [Metric(f"val/{source}/ce", f"val CE {source}", False, 3) for source in sources]
    per_set = []
    for qa_set in qa_sets(next(iter(grouped.values()))[0]):
        per_set += [*generation_metrics([qa_set]), *token_class_metrics(qa_set, keys)]
    return [metric for metric in [*per_set, *VALIDATION_METRICS] if metric.key in keys] + extra


def setup_lines(runs: list[StudyRun], overrides: list[str]) -> list[str]:
    from ntl_pretrain.config.loading import load_recipe

    recipe = load_recipe(runs[0].recipe, overrides)
    model, train, data = recipe.model, recipe.train, recipe.data
    architecture = ", ".join(f"{key} {value}" for key, value in model.config.items())
    if recipe.init_from is None:
        start = f"`{model.model_type}` from scratch ({architecture}); tokenizer `{recipe.tokenizer.path}`"
    else:
        start = f"continued pretraining from `{recipe.init_from}` (its own tokenizer)"
    sequences = train.global_batch_size or (train.global_batch_tokens or 0) // data.seq_len
    return [
        f"- Model: {start}.",
        f"- Training: {train.max_steps} steps x {sequences} sequences x {data.seq_len} tokens "
        f"= {train.max_steps * sequences * data.seq_len:,} tokens, AdamW lr {recipe.optimizer.lr:g}, "
        f"{recipe.schedule.kind} schedule, {train.precision}, one rank.",
        f"- Data: {', '.join(f'`{source.path}`' for source in data.sources)}.",
        f"- Validation (CE, and NTL-WAS for every variant, also the CE-only one): "
        f"{', '.join(f'`{source.path}`' for source in data.validation)}.",
        f"- Variants (`{_recipes_folder(runs)}/<variant>.yaml`): "
        + "; ".join(sorted({_describe_variant(run, overrides, recipe) for run in runs}))
        + f"; seeds {sorted({run.seed for run in runs})}.",
        _evaluation_line(runs[0].results(), recipe.eval.qa_sets),
        _code_line(runs),
        _device_line(runs),
    ]


def _code_line(runs: list[StudyRun]) -> str:
    """Which code ran the runs, from each run's `study.json` (study/provenance.py), with how many runs each."""
    counts: dict[str, int] = {}
    for run in runs:
        code = describe(run.timing().get("code"))
        counts[code] = counts.get(code, 0) + 1
    if len(counts) == 1:
        return f"- Code: every run at `{next(iter(counts))}` (the `code` field of each run's study.json)."
    each = "; ".join(f"`{code}` {count} run{'s' * (count != 1)}" for code, count in counts.items())
    return f"- Code (the `code` field of each run's study.json): {each}."


def _device_line(runs: list[StudyRun]) -> str:
    """Where the runs ran, from each run's `study.json` (`device`; runs of studies before v6 have none)."""
    counts: dict[str, int] = {}
    for run in runs:
        device = run.timing().get("device", "not recorded")
        counts[device] = counts.get(device, 0) + 1
    return (
        "- Device (the `device` field of each run's study.json): "
        + "; ".join(f"{device} {count} run{'s' * (count != 1)}" for device, count in counts.items())
        + "."
    )


def _recipes_folder(runs: list[StudyRun]) -> Path:
    run = runs[0]
    return Path(str(run.recipe)[: -len(f"{run.variant}.yaml")].rstrip("/") or ".")


def _evaluation_line(results: dict, asked_sets: list) -> str:
    """Which questions were asked: the sets the evaluation reports, with the files the recipe names for them."""
    paths = {qa.label: qa.path for qa in asked_sets}
    asked = [f"{int(results[f'eval/{name}/examples'])} of `{paths.get(name, name)}`" for name in qa_sets(results)]
    return f"- Evaluation: the final checkpoint (fp32), greedy decoding of the first {' and '.join(asked)}."


def _describe_variant(run: StudyRun, overrides: list[str], first: Recipe) -> str:
    """`variant = loss`, and its tokenizer, steps and training data where they are not the first run's (`first`, whose
    are the setup's lines)."""
    from ntl_pretrain.config.loading import load_recipe

    recipe = load_recipe(run.recipe, overrides)
    ntl = recipe.loss.ntl
    loss = "CE" if ntl.kind is None else f"CE + {ntl.weight:g} · NTL-{ntl.kind.upper()}"
    differences = []
    if recipe.tokenizer.path != first.tokenizer.path:
        differences.append(f"tokenizer `{recipe.tokenizer.path}`")
    if recipe.train.max_steps != first.train.max_steps:
        differences.append(f"{recipe.train.max_steps:,} steps")
    sources = [source.path for source in recipe.data.sources]
    if sources != [source.path for source in first.data.sources]:
        differences.append("data " + ", ".join(f"`{path}`" for path in sources))
    return f"{run.variant} = {loss}" + (f" with {', '.join(differences)}" if differences else "")


def write_report(
    runs: list[StudyRun],
    doc: Path,
    plot: Path,
    command: str,
    overrides: list[str],
    title: str = "CE vs CE + NTL",
    protocol: Path | None = None,
    rule: DecisionRule | None = None,
    runs_csv: Path | None = None,
) -> None:
    """`protocol`: a Markdown file fixed before the runs (task, grid, seeds, decision rules), quoted verbatim;
    `rule`: its decision rule, whose verdicts the report states; `runs_csv`: where every run's figures go (default:
    `<doc stem>-runs.csv` beside the doc)."""
    measured = [run.measured() for run in runs]
    grouped = by_variant(runs, measured)
    metrics = present_metrics(grouped)
    notes = low_accuracy_notes(grouped)
    seeds = len({run.seed for run in runs})
    plot_runs([run.folder for run in runs], plot, labels=[run.name for run in runs], groups=[r.variant for r in runs])
    write_runs_csv(runs, measured, runs_csv or doc.with_name(f"{doc.stem}-runs.csv"))
    total = sum(run.timing()["train_s"] + run.timing()["eval_s"] for run in runs)
    lines = [
        f"# Study: {title}",
        "",
        f"Generated by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; do not edit by hand "
        "(re-run the command). How the metrics are defined: [evaluation.md](evaluation.md).",
        "",
        *_protocol_lines(protocol, doc),
        "## Setup",
        "",
        *setup_lines(runs, overrides),
        f"- Compute: {len(runs)} runs, {total / 60:.1f} min of run time in total; {_wall_clock(runs) / 60:.1f} min "
        "of wall-clock time with at least one run in progress.",
        "",
        *(verdict_lines(rule, decide(rule, grouped)) if rule is not None else []),
        *(effects_along_training_section(rule, runs) if rule is not None else []),
        *(regime_section(rule, runs) if rule is not None else []),
        f"## Results: mean ± std over {seeds} seeds" if seeds > 1 else "## Results: one seed",
        "",
        *results_table(grouped, metrics),
        "",
        "Exact match, R², digit accuracy, the share of wrong last digits off by one: higher is better. MAE, log10(1 + "
        "absolute error), the median absolute error, the MAE of the 90% best answers, validation CE and NTL: lower "
        "is better. The error metrics and R² are over the answers that contain a number. The last columns are "
        "differences "
        f"of means from {BASELINE} (of the variant's own recipe folder), signed so that + is better"
        + (
            f"; (k/n): better than the {BASELINE} run of the same seed (same initialisation and data order) on k of "
            "the n seeds where the two differ. Were the losses equivalent, each seed would be a coin flip: n/n or "
            f"0/n then happens with probability 2^(1-n) ({2.0 ** (1 - seeds):.2g} for n = {seeds}; two-sided sign "
            "test), anything in between more often."
            if seeds > 1
            else "; with one seed, a difference says nothing about its spread over seeds."
        ),
        "",
        *_token_class_note(metrics),
        *(["Caveats:", "", *notes, ""] if notes else []),
        f"![training curves and final metrics per run]({os.path.relpath(plot, doc.parent)})",
        "",
        *paired_section(grouped, metrics),
        *learning_curve_section(runs),
        *error_profile_section(runs),
        "## Per run",
        "",
        *per_run_table(runs, measured, metrics),
        "",
    ]
    write_text(doc, "\n".join(lines))


def _token_class_note(metrics: list[Metric]) -> list[str]:
    if not any(metric.key.endswith("_token") for metric in metrics):
        return []
    return ["`k-digit-token answers`: the questions whose reference answer the run's tokenizer spells as one number "
            "token of k digits (`multi-token`: anything else), exact match among them from each run's answers, and "
            "how many there are (study/token_classes.py).", ""]  # fmt: skip


def _protocol_lines(protocol: Path | None, doc: Path) -> list[str]:
    if protocol is None:
        return []
    link = os.path.relpath(protocol, doc.parent)
    return [f"## Protocol (fixed before the runs: [{protocol.name}]({link}))", "", protocol.read_text().strip(), ""]


def _wall_clock(runs: list[StudyRun]) -> float:
    """Seconds during which at least one run was in progress, from each run's start to its end: a study resumed
    days later does not count the days in between."""
    spans = sorted(_span(run) for run in runs)
    busy, covered_until = 0.0, -math.inf
    for start, end in spans:
        busy += max(0.0, end - max(start, covered_until))
        covered_until = max(covered_until, end)
    return busy


def _span(run: StudyRun) -> tuple[float, float]:
    """(start, end) in seconds since the epoch, from study.json; for a run finished before it recorded them, from
    file times (the trainer writes recipe.yaml first, the study study.json last)."""
    timing = run.timing()
    if "started" in timing:
        return timing["started"], timing["finished"]
    return (run.folder / "recipe.yaml").stat().st_mtime, (run.folder / "study.json").stat().st_mtime
