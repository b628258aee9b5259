"""The power tables and thresholds of docs/study-v6-protocol.md, from study v6's exploratory pilot
(docs/study-v6-pilot/, seeds 40 and 41) at the main study's length.

    python docs/study-v6/study_v6_power.py --length 2x [--seeds 12] [--archive docs/study-v6-pilot]

The primary metric is `eval/regression_interpolation/log_mae`, mean log10(1 + |error|) over the 1,000 held-out
answers, lower is better. Each hypothesis's per-seed effect is measured on the pilot's runs of `--length` by the code
`--decide v6` applies (`Hypothesis.per_seed`). Two seeds estimate an sd on one degree of freedom, so the plan pools:
- a gain (H1–H4: NTL-WAS vs CE under one tokenizer and noise level): the pooled within-condition sd of the four
  conditions' per-seed gains (4 degrees of freedom);
- a difference of two gains (H5: between the tokenizers, H6: between the noise levels): the gains of two
  independently trained pairs, so √2 × it.
Each also at the pooled sd's one-sided 80% upper bound (4 degrees of freedom: × 1.56), and beside it at study v5's
24-seed sd where the effect is v5's (H1, H2, and H5 = v5's H3; v5 ran single digits on 0.6× the examples, 1,000
steps). Normal theory with n = `--seeds` (study/power.py), at α 0.05/6 (Holm's first step over the six hypotheses)
and α 0.05 (its last): the t-test's power and the smallest effect it detects with 0.8; each threshold m (= min_gain
= margin) by study v4's rule, the smallest multiple of 0.005 at which "no useful effect" has a chance of at least
0.5 at a true effect of 0 with the upper-bound sd (checked against RULES["v6"] once it exists); and the compute the
design costs, from the pilot's run times. Prints Markdown.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "study-v4"))  # study v4's power rule, reused
from study_v4_power import power_row, rule_margin, rule_row  # noqa: E402

from ntl_pretrain.study.decision import LOG_ERROR, RULES, Hypothesis
from ntl_pretrain.study.power import sd_upper_bound
from ntl_pretrain.study.report import by_variant
from ntl_pretrain.study.runs import StudyRun, plan

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this script lives in docs/<study>/
PILOT_SEEDS = [40, 41]
V5_SEEDS = list(range(40, 64))
ALPHAS = (0.05 / 6, 0.05)
EFFECTS = (0.02, 0.05, 0.10, 0.15)
BUDGET_S = 12 * 3600 * 2  # issue 58: about 12 hours of this machine at two jobs
NOISY, EXACT = ("regression/", "regression-1digit/"), ("regression-exact/", "regression-exact-1digit/")
# (name, NTL arm's folder, the second pair's folder or None): each NTL arm is `<folder>ntl-was-answer`, its
# baseline `<folder>ce` (recipes/study/v6/); H5 and H6 are the first pair's gain minus the second pair's.
PLANNED = (
    ("H1", "regression/", None),
    ("H2", "regression-1digit/", None),
    ("H3", "regression-exact/", None),
    ("H4", "regression-exact-1digit/", None),
    ("H5", "regression/", "regression-1digit/"),
    ("H6", "regression/", "regression-exact/"),
)
V5_NAME = {"H1": "H1", "H2": "H2", "H5": "H3"}  # the same effect in study v5 (docs/study-v5-protocol.md)


def hypothesis(name: str, folder: str, other: str | None) -> Hypothesis:
    """The planned comparison, thresholds left at 0: they are what this script chooses."""
    against = None if other is None else (f"{other}ntl-was-answer", f"{other}ce")
    return Hypothesis(f"{folder}ntl-was-answer", f"{folder}ce", LOG_ERROR, 0.0, 0.0, name=name, against=against)


def pilot_runs(archive: Path, length: str, nowhere: Path) -> list[StudyRun]:
    """The pilot's runs of `length`, every arm; exits naming any that is not archived."""
    runs = []
    for folders, tokenizer in ((NOISY[:1] + EXACT[:1], "3digit"), (NOISY[1:] + EXACT[1:], "1digit")):
        variants = [f"{folder}{arm}" for folder in folders for arm in ("ce", "ntl-was-answer")]
        archived = archive / f"{length}-{tokenizer}" / "runs"
        runs += plan(ROOT / "recipes" / "study", variants, PILOT_SEEDS, nowhere, archived)
    missing = [f"{run.archive}" for run in runs if not run.archived]
    if missing:
        raise SystemExit("not archived: " + ", ".join(missing))
    return runs


def v5_sds() -> dict[str, float]:
    """Study v5's 24-seed sd of each effect that v6 asks again, by v6's name."""
    with tempfile.TemporaryDirectory() as nowhere:
        rule = RULES["v5"]
        runs = plan(ROOT / "recipes" / "study", sorted(rule.variants()), V5_SEEDS, Path(nowhere),
                    ROOT / "docs" / "study-v5" / "runs")  # fmt: skip
        grouped = by_variant(runs, [run.measured() for run in runs])
    by_name = {h.name: statistics.stdev(h.per_seed(grouped)) for h in rule.hypotheses}
    return {v6: by_name[v5] for v6, v5 in V5_NAME.items()}


def pooled_gain_sd(gains: list[list[float]]) -> tuple[float, int]:
    """(the pooled within-condition sd, its degrees of freedom) of per-seed gains measured in several conditions."""
    df = sum(len(values) - 1 for values in gains)
    variance = sum((len(values) - 1) * statistics.variance(values) for values in gains) / df
    return math.sqrt(variance), df


def compute_lines(runs: list[StudyRun], n: int) -> list[str]:
    """What a seed of all eight arms costs at this length, and the seeds the budget buys. The pilot ran beside other
    work (a CI run, the 4x runs), so per tokenizer the fastest run's seconds a step stand for an idle machine at two
    jobs (a step's cost depends on the vocabulary, not on the loss), beside the median of all."""
    fastest: dict[bool, float] = {}
    steps: dict[str, int] = {}
    seconds: list[float] = []
    for run in runs:
        timing, single = run.timing(), "1digit" in run.variant
        steps[run.variant] = run.max_steps()
        fastest[single] = min(fastest.get(single, math.inf), timing["train_s"] / steps[run.variant])
        seconds.append(timing["train_s"] + timing["eval_s"])
    per_seed = sum(fastest["1digit" in variant] * count for variant, count in steps.items())
    median_seed = statistics.median(seconds) * len(steps)
    return [f"Compute: a seed of all {len(steps)} arms is {per_seed / 3600:.2f} h of run time at the fastest pilot "
            f"run's seconds a step ({fastest[False]:.3f} s under 1–3-digit tokens, {fastest[True]:.3f} s under single "
            f"digits; at the median run {median_seed / 3600:.2f} h); {n} seeds are {n * per_seed / 3600:.1f} h of run "
            f"time, {n * per_seed / 7200:.1f} h of wall-clock time at two jobs; the budget ({BUDGET_S / 7200:.0f} h "
            f"at two jobs) buys {int(BUDGET_S // per_seed)} seeds. The sign-flip permutation test's smallest p on n "
            f"seeds is 2/2^n: {2 / 2**n:.4f}, below α 0.05/6 = {0.05 / 6:.4f} only from n = 8."]  # fmt: skip


def tables(runs: list[StudyRun], n: int) -> list[str]:
    grouped = by_variant(runs, [run.measured() for run in runs])
    planned = [hypothesis(*row) for row in PLANNED]
    effects = {h.name: h.per_seed(grouped) for h in planned}
    gain_sd, df = pooled_gain_sd([effects[name] for name in ("H1", "H2", "H3", "H4")])
    v5 = v5_sds()
    defined = {h.name: h for h in RULES["v6"].hypotheses} if "v6" in RULES else {}
    notes, power, rule = [], [], []
    power_header = ("| hypothesis | sd | " + " | ".join(f"power at {effect:g}" for effect in EFFECTS)
                    + " | detected with 0.8 |")  # fmt: skip
    for h in planned:
        values = effects[h.name]
        sd = gain_sd * (1.0 if h.against is None else math.sqrt(2.0))
        m = rule_margin(sd, df + 1, n)
        check = f"; in RULES['v6'] {defined[h.name].no_effect_margin:g}" if h.name in defined else ""
        notes.append(f"- {h.name}, {h.compared()}: per seed {', '.join(f'{v:+.3f}' for v in values)} (mean "
                     f"{statistics.fmean(values):+.3f}); planning sd {sd:.3f}; m by the protocol's rule "
                     f"{m:g}{check}.")  # fmt: skip
        at_m = Hypothesis(h.variant, h.baseline, h.effect, m, m, name=h.name, against=h.against)
        rows = [("pooled", sd), ("80% upper", sd_upper_bound(sd, df + 1))]
        rows += [("v5, 24 seeds", v5[h.name])] if h.name in v5 else []
        for label, planned_sd in rows:
            power.append(power_row(at_m, planned_sd, label, n, EFFECTS, alphas=ALPHAS))
            rule.append(rule_row(at_m, planned_sd, label, n, alphas=ALPHAS))
    return [
        f"n = {n} seeds; two figures in a cell: at α 0.05/6 / at α 0.05. The pooled sd of a gain: {gain_sd:.3f} "
        f"on {df} degrees of freedom (80% upper bound {sd_upper_bound(gain_sd, df + 1):.3f}).",
        "",
        *notes,
        "",
        power_header,
        "|---|---|" + "---:|" * (len(EFFECTS) + 1),
        *power,
        "",
        "| hypothesis | sd | m | P(no useful effect), effect 0 | P(helps), effect m | P(helps), effect 1.5 m |",
        "|---|---|---:|---:|---:|---:|",
        *rule,
        "",
        *compute_lines(runs, n),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", required=True, choices=["1x", "2x", "4x"], help="the main study's length")
    parser.add_argument("--seeds", type=int, default=12, help="seeds per arm in the planned study")
    parser.add_argument("--archive", type=Path, default=ROOT / "docs" / "study-v6-pilot")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as nowhere:  # every run is archived: no run folder is read or written
        print("\n".join(tables(pilot_runs(args.archive, args.length, Path(nowhere)), args.seeds)))


if __name__ == "__main__":
    main()
