"""The power tables of docs/study-v4-protocol.md, from study v3's archived runs (docs/study-v3/runs).

    python docs/study-v4/study_v4_power.py [--seeds 24] [--archive docs/study-v3/runs]

For each hypothesis of `--decide v4` (study_decision.RULES["v4"]), its per-seed effect measured on v3's 16 seeds
by the same code the rule applies (`Effect.per_seed`, with exact match per answer token class from
study/token_classes.py). v3 has no `3digit/ntl-digits-answer` arm, so H2 and H3 are measured on a proxy pair,
`3digit/ntl-was-answer` against `3digit/ce` (H2: exact match on all answers; H3: on the 3-digit-token answers): the
paired sd of two arms one loss apart. Each figure at the observed paired sd and at its one-sided 80% upper bound
(16 seeds estimate an sd to about ±20%; v3's protocol planned with an sd half the one it met). Normal theory with
n = `--seeds` (study/power.py), at α 0.05/3 (Holm's first step, the worst case) and α 0.05 (its last, the best):
1. the two-sided paired t-test: its power at several true effects and the smallest effect it detects with 0.8;
2. the rule's thresholds: the margin m (= min_gain) that the protocol's rule chooses, the smallest multiple of 0.005
   at which "no useful effect" has a chance of at least 0.5 at a true effect of 0 with the upper-bound sd (checked
   against RULES["v4"]); that chance, and the chance of "helps" (significant, mean >= m) at true effects m and 1.5 m.
Prints Markdown.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from ntl_pretrain.study.decision import RULES, Hypothesis
from ntl_pretrain.study.power import (
    detectable_effect,
    helps_probability,
    margin_for,
    paired_t_power,
    sd_upper_bound,
    within_margin_probability,
)
from ntl_pretrain.study.report import by_variant
from ntl_pretrain.study.runs import plan

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this script lives in docs/<study>/
V3_SEEDS = list(range(16))
V3_ARMS = ("3digit/ce", "3digit/ntl-was-answer")
EFFECTS = (0.05, 0.075, 0.10, 0.15)
ALPHAS = (0.05 / 3, 0.05)  # worst, best
MARGIN_STEP, NULL_CHANCE = 0.005, 0.5


def v3_results(archive: Path) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as nowhere:  # every run is archived: no run folder is read or written
        runs = plan(ROOT / "recipes" / "study", list(V3_ARMS), V3_SEEDS, Path(nowhere), archive)
        missing = [run.name for run in runs if not run.archived]
        if missing:
            raise SystemExit(f"{archive}: not archived: {', '.join(missing)}")
        return by_variant(runs, [run.measured() for run in runs])


def both_alphas(figure, digits: int = 2, alphas: tuple[float, float] = ALPHAS) -> str:
    """`figure(alpha)` at Holm's first α (0.05/3 for three hypotheses) and at α 0.05."""
    return " / ".join(f"{figure(alpha):.{digits}f}" for alpha in alphas)


def rule_margin(sd: float, seeds_measured: int, n: int) -> float:
    """The protocol's choice of m, by the rule of the module docstring."""
    upper = sd_upper_bound(sd, seeds_measured)
    return math.ceil(margin_for(NULL_CHANCE, upper, n) / MARGIN_STEP - 1e-9) * MARGIN_STEP


def power_row(h: Hypothesis, sd: float, label: str, n: int, effects: tuple[float, ...] = EFFECTS, alphas=ALPHAS) -> str:
    cells = [both_alphas(lambda alpha, e=effect: paired_t_power(e, sd, n, alpha), alphas=alphas) for effect in effects]
    cells.append(both_alphas(lambda alpha: detectable_effect(sd, n, alpha), digits=3, alphas=alphas))
    return f"| {h.name} | {sd:.3f} ({label}) | " + " | ".join(cells) + " |"


def rule_row(h: Hypothesis, sd: float, label: str, n: int, alphas=ALPHAS) -> str:
    m = h.no_effect_margin
    cells = [f"{m:g}", f"{within_margin_probability(m, sd, n):.2f}"]
    for effect in (m, 1.5 * m):
        probability = lambda alpha, e=effect: helps_probability(e, h.min_gain, sd, n, alpha)  # noqa: E731
        cells.append(both_alphas(probability, alphas=alphas))
    return f"| {h.name} | {sd:.3f} ({label}) | " + " | ".join(cells) + " |"


def tables(grouped: dict[str, list[dict]], n: int) -> list[str]:
    power = ["| hypothesis | sd | " + " | ".join(f"power at {effect:g}" for effect in EFFECTS)
             + " | detected with 0.8 |", "|---|---|" + "---:|" * (len(EFFECTS) + 1)]  # fmt: skip
    rule = ["| hypothesis | sd | m | P(no useful effect), effect 0 | P(helps), effect m | P(helps), effect 1.5 m |",
            "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    notes = []
    for h in RULES["v4"].hypotheses:
        # v3 has no digits arm: every hypothesis is measured on v3's NTL arm against CE (module docstring).
        effects = h.effect.per_seed(grouped[V3_ARMS[1]], grouped[V3_ARMS[0]])
        observed = statistics.stdev(effects)
        notes.append(f"- {h.name}, measured on v3 as `{V3_ARMS[1]}` − `{V3_ARMS[0]}`: mean "
                     f"{statistics.fmean(effects):+.3f}, paired sd {observed:.3f} over {len(effects)} seeds; m by the "
                     f"protocol's rule {rule_margin(observed, len(effects), n):g}, in RULES['v4'] "
                     f"{h.no_effect_margin:g} (min_gain {h.min_gain:g}).")  # fmt: skip
        for label, sd in (("observed", observed), ("80% upper", sd_upper_bound(observed, len(effects)))):
            power.append(power_row(h, sd, label, n))
            rule.append(rule_row(h, sd, label, n))
    return [f"n = {n} seeds; two figures in a cell: at α 0.05/3 / at α 0.05.", "", *notes, "", *power, "", *rule]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24, help="seeds per arm in the planned study")
    parser.add_argument("--archive", type=Path, default=ROOT / "docs" / "study-v3" / "runs")
    args = parser.parse_args()
    print("\n".join(tables(v3_results(args.archive), args.seeds)))


if __name__ == "__main__":
    main()
