"""`ntl-pretrain study`: train CE, CE+NTL-WAS and CE+NTL-MSE from scratch over several seeds, evaluate, report.

A variant is a recipe path relative to `--recipes` without `.yaml`; one in a subfolder (`3digit/ntl-was`) is an
axis of the study (another tokenizer, say) and is compared with the `ce` recipe of its own folder (`3digit/ce`).
Every (variant, seed) run is `ntl-pretrain train <recipes>/<variant>.yaml --nproc 1 seed=S` followed by
`ntl-pretrain eval <run> --log-metrics`, each in its own process; `--jobs` runs that many at once, splitting
the CPU threads between them. A run whose `study.json` exists is finished and is not repeated, so an
interrupted study continues where it stopped. The report (markdown table of mean ± std over seeds, per-run
figures, a plot) is written from whatever the runs measured: it states the comparison, not a conclusion
chosen in advance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ntl_pretrain.evaluation.answers import error_profile
from ntl_pretrain.plot import plot_runs, read_metrics

VARIANTS = ("ce", "ntl-was", "ntl-mse")
SEEDS = (0, 1, 2)
BASELINE = "ce"


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    higher_is_better: bool
    digits: int


# Per question/answer set `<set>` (the labels of the recipe's eval.qa_sets, e.g. `addition_interpolation`).
GENERATION_METRICS = (
    ("exact_match", "exact match", True, 3),
    ("mae", "MAE", False, 1),
    ("log_mae", "log10(1+AE)", False, 2),
    ("digit_accuracy", "digit acc.", True, 3),
    ("unparseable", "unparseable", False, 3),
)
VALIDATION_METRICS = (
    Metric("val_ce", "val CE", False, 3),
    Metric("val_number_ce", "val CE at number labels", False, 3),
    Metric("val_ntl_was", "val NTL-WAS", False, 3),
    Metric("val_ntl_number", "val NTL-number", False, 3),
)


def qa_sets(results: dict) -> list[str]:
    """The question/answer sets an evaluation scored, in its order (every set reports `eval/<set>/examples`)."""
    return [key.split("/")[1] for key in results if key.startswith("eval/") and key.endswith("/examples")]


def generation_metrics(sets: list[str]) -> list[Metric]:
    return [
        Metric(f"eval/{qa_set}/{name}", f"{qa_set} {title}", higher, digits)
        for qa_set in sets
        for name, title, higher, digits in GENERATION_METRICS
    ]


@dataclass(frozen=True)
class StudyRun:
    variant: str
    seed: int
    recipe: Path
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.variant.replace('/', '-')}-seed{self.seed}"

    @property
    def done_file(self) -> Path:
        return self.run_dir / "study.json"

    def results(self) -> dict:
        return json.loads((self.run_dir / "eval.json").read_text())

    def timing(self) -> dict:
        return json.loads(self.done_file.read_text())

    @property
    def answers_file(self) -> Path:
        return self.run_dir / "answers.jsonl"

    def answers(self) -> list[dict]:
        """Every question's record from `ntl-pretrain eval --answers`."""
        return [json.loads(line) for line in self.answers_file.read_text().splitlines() if line.strip()]


def plan(recipes: Path, variants: list[str], seeds: list[int], runs_dir: Path) -> list[StudyRun]:
    runs = []
    for variant in variants:
        recipe = recipes / f"{variant}.yaml"
        if not recipe.is_file():
            raise FileNotFoundError(f"{recipe}: no recipe for variant {variant!r}")
        runs += [StudyRun(variant, seed, recipe, runs_dir / f"{variant}-seed{seed}") for seed in seeds]
    return runs


def baseline_of(variant: str) -> str:
    """The CE variant an NTL variant is paired with: `ce` in the same recipe folder (same tokenizer, data, model)."""
    folder, _, _ = variant.rpartition("/")
    return f"{folder}/{BASELINE}" if folder else BASELINE


def execute(run: StudyRun, overrides: list[str], eval_args: list[str], threads: int, logs: Path) -> None:
    """Train from scratch (an unfinished earlier attempt is discarded), then evaluate the final checkpoint."""
    shutil.rmtree(run.run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{run.name}.log").open("w") as log:
        started = time.perf_counter()
        train = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(run.recipe), "--nproc", "1",
                 f"seed={run.seed}", f"train.output_dir={run.run_dir}", *overrides]  # fmt: skip
        subprocess.run(train, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        trained = time.perf_counter()
        evaluate = [sys.executable, "-m", "ntl_pretrain.evaluation", str(run.run_dir), "--log-metrics",
                    "--out", str(run.run_dir / "eval.json"), "--answers", str(run.answers_file),
                    *eval_args]  # fmt: skip
        subprocess.run(evaluate, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    timing = {"train_s": trained - started, "eval_s": time.perf_counter() - trained}
    run.done_file.write_text(json.dumps({"variant": run.variant, "seed": run.seed, **timing}) + "\n")


def run_all(runs: list[StudyRun], overrides: list[str], eval_args: list[str], jobs: int, logs: Path) -> None:
    pending = [run for run in runs if not run.done_file.is_file()]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(execute, run, overrides, eval_args, threads, logs) for run in pending]
        for run, future in zip(pending, futures, strict=True):
            future.result()
            print(f"study: {run.name} done", flush=True)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Over the finite values (MAE is NaN for a run none of whose answers parsed); NaN when there are none."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def by_variant(runs: list[StudyRun]) -> dict[str, list[dict]]:
    """Each variant's evaluation results, one per seed, with the run's `seed` added (to pair runs across variants)."""
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run.variant, []).append(run.results() | {"seed": run.seed})
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


def training_evaluations(run: StudyRun) -> dict[int, dict]:
    """The trainer's periodic generation metrics (`eval.every_steps`) by step; the final `ntl-pretrain eval`
    record (which names its `model`) is not one of them."""
    return {r["step"]: r for r in read_metrics(run.run_dir) if r.get("split") == "eval" and "model" not in r}


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
    if not all(run.answers_file.is_file() for run in runs):
        return []
    profiles: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        by_set: dict[str, list[dict]] = {}
        for record in run.answers():
            by_set.setdefault(record["set"], []).append(record)
        for qa_set, records in by_set.items():
            profiles.setdefault(qa_set, {}).setdefault(run.variant, []).append(error_profile(records))
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


def per_run_table(runs: list[StudyRun], metrics: list[Metric]) -> list[str]:
    lines = ["| run | " + " | ".join(metric.title for metric in metrics) + " | train s | eval s |"]
    lines.append("|---|" + "---:|" * (len(metrics) + 2))
    for run in runs:
        results, timing = run.results(), run.timing()
        cells = [_format(results[metric.key], metric.digits) for metric in metrics]
        cells += [f"{timing['train_s']:.0f}", f"{timing['eval_s']:.0f}"]
        lines.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return lines


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
    """Generation metrics per question set, validation CE and NTL, then per-source validation CE
    (`val/<source>/ce`): those that every run reports (runs evaluated by an older version lack newer metrics)."""
    keys = set.intersection(*(set(result) for results in grouped.values() for result in results))
    sources = sorted({key.split("/")[1] for key in keys if key.startswith("val/") and key.endswith("/ce")})
    extra = [Metric(f"val/{source}/ce", f"val CE {source}", False, 3) for source in sources]
    fixed = [*generation_metrics(qa_sets(next(iter(grouped.values()))[0])), *VALIDATION_METRICS]
    return [metric for metric in fixed if metric.key in keys] + extra


def setup_lines(runs: list[StudyRun], overrides: list[str]) -> list[str]:
    from ntl_pretrain.config import load_recipe

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
        + "; ".join(sorted({_describe_variant(run, overrides, recipe.tokenizer.path) for run in runs}))
        + f"; seeds {sorted({run.seed for run in runs})}.",
        _evaluation_line(runs[0].results(), recipe.eval.qa_sets),
    ]


def _recipes_folder(runs: list[StudyRun]) -> Path:
    run = runs[0]
    return Path(str(run.recipe)[: -len(f"{run.variant}.yaml")].rstrip("/") or ".")


def _evaluation_line(results: dict, asked_sets: list) -> str:
    """Which questions were asked: the sets the evaluation reports, with the files the recipe names for them."""
    paths = {qa.label: qa.path for qa in asked_sets}
    asked = [f"{int(results[f'eval/{name}/examples'])} of `{paths.get(name, name)}`" for name in qa_sets(results)]
    return f"- Evaluation: the final checkpoint (fp32), greedy decoding of the first {' and '.join(asked)}."


def _describe_variant(run: StudyRun, overrides: list[str], tokenizer: str | None) -> str:
    """`variant = loss`, and the tokenizer where it is not the first run's (`tokenizer`)."""
    from ntl_pretrain.config import load_recipe

    recipe = load_recipe(run.recipe, overrides)
    ntl = recipe.loss.ntl
    loss = "CE" if ntl.kind is None else f"CE + {ntl.weight:g} · NTL-{ntl.kind.upper()}"
    other_tokenizer = f" with tokenizer `{recipe.tokenizer.path}`" if recipe.tokenizer.path != tokenizer else ""
    return f"{run.variant} = {loss}{other_tokenizer}"


def write_report(
    runs: list[StudyRun],
    doc: Path,
    plot: Path,
    command: str,
    overrides: list[str],
    title: str = "CE vs CE + NTL",
    protocol: Path | None = None,
) -> None:
    """`protocol`: a Markdown file fixed before the runs (task, grid, seeds, decision rules), quoted verbatim."""
    grouped = by_variant(runs)
    metrics = present_metrics(grouped)
    notes = low_accuracy_notes(grouped)
    seeds = len({run.seed for run in runs})
    plot_runs([run.run_dir for run in runs], plot, labels=[run.name for run in runs], groups=[r.variant for r in runs])
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
        f"## Results: mean ± std over {seeds} seeds" if seeds > 1 else "## Results: one seed",
        "",
        *results_table(grouped, metrics),
        "",
        "Exact match, digit accuracy: higher is better. MAE, log10(1 + absolute error), validation CE and NTL: lower "
        "is better. MAE and log-error are over the answers that contain a number. The last columns are differences "
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
        *(["Caveats:", "", *notes, ""] if notes else []),
        f"![training curves and final metrics per run]({os.path.relpath(plot, doc.parent)})",
        "",
        *learning_curve_section(runs),
        *error_profile_section(runs),
        "## Per run",
        "",
        *per_run_table(runs, metrics),
        "",
    ]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))


def _protocol_lines(protocol: Path | None, doc: Path) -> list[str]:
    if protocol is None:
        return []
    link = os.path.relpath(protocol, doc.parent)
    return [f"## Protocol (fixed before the runs: [{protocol.name}]({link}))", "", protocol.read_text().strip(), ""]


def _wall_clock(runs: list[StudyRun]) -> float:
    """Seconds during which at least one run was in progress, from each run's start (the trainer writes
    recipe.yaml first) to its end: a study resumed days later does not count the days in between."""
    spans = sorted(((run.run_dir / "recipe.yaml").stat().st_mtime, run.done_file.stat().st_mtime) for run in runs)
    busy, covered_until = 0.0, -math.inf
    for start, end in spans:
        busy += max(0.0, end - max(start, covered_until))
        covered_until = max(covered_until, end)
    return busy


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("study", help="CE vs CE+NTL: train every variant x seed, evaluate, report")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run, e.g. train.max_steps=50")
    parser.add_argument("--recipes", type=Path, default=Path("recipes/study"), help="folder of <variant>.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/study"))
    parser.add_argument("--doc", type=Path, default=Path("docs/study.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/study.png"))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each gets cpu_count/jobs threads)")
    parser.add_argument("--max-examples", type=int, default=1000, help="questions per evaluation set")
    parser.add_argument("--title", default="CE vs CE + NTL on two-digit addition, from scratch")
    parser.add_argument("--protocol", type=Path, help="Markdown written before the runs, quoted in the report")
    parser.set_defaults(func=run_study)


def run_study(args: argparse.Namespace) -> int:
    runs = plan(args.recipes, args.variants, args.seeds, args.runs_dir)
    eval_args = ["--max-examples", str(args.max_examples)]
    run_all(runs, args.overrides, eval_args, args.jobs, args.runs_dir / "logs")
    command = shlex.join(["ntl-pretrain", "study", *(sys.argv[2:] if sys.argv[1:2] == ["study"] else sys.argv[1:])])
    write_report(runs, args.doc, args.plot, command.strip(), args.overrides, args.title, args.protocol)
    print(args.doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ntl_pretrain.study")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["study", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
