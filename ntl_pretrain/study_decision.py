"""A study's decision rule, fixed before the runs and applied by code: does each NTL variant help, hurt, or neither?

The defaults are study v3's rule (docs/study-v3-protocol.md): the primary metric is log10(1 + |error|) on the
held-out sums, `3digit/ntl-was` and `3digit/ntl-was-answer` are each compared with `3digit/ce` (paired by seed),
with a two-sided paired t-test Holm-corrected over the comparisons at α 0.05 and the sign-flip permutation p
(corrected the same way) beside it; RULES["v3-gpu"] is the protocol's GPU arm. In order:
1. inconclusive when the t-test and the permutation test disagree on significance (corrected p < α);
2. helps: significant, mean gain >= min_gain, and (where the rule has a guard) the 95% CI of the guard metric's
   gain (exact match, variant − CE) has its lower bound above guard_ci_floor;
3. hurts: significant, mean loss >= min_gain (a gain <= −min_gain);
4. no useful effect: the 90% CI of the primary gain lies within ±no_effect_margin;
5. otherwise inconclusive, with the CI.
Gains are signed so that + is better: CE's log-error minus the variant's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ntl_pretrain.study_stats import PairedStats, bonferroni, holm, paired_gains, paired_stats

HELPS, HURTS, NO_EFFECT, INCONCLUSIVE = "helps", "hurts", "no useful effect", "inconclusive"


@dataclass(frozen=True)
class DecisionRule:
    comparisons: tuple[tuple[str, str], ...] = (
        ("3digit/ntl-was", "3digit/ce"),
        ("3digit/ntl-was-answer", "3digit/ce"),
    )
    """(variant, baseline) pairs: the family that the correction spans."""
    primary: str = "eval/addition_interpolation/log_mae"
    primary_higher_is_better: bool = False
    correction: Literal["holm", "bonferroni"] = "holm"
    alpha: float = 0.05
    min_gain: float = 0.02
    """Smallest mean gain in the primary metric that counts as helping (or, negated, hurting)."""
    guard: str | None = "eval/addition_interpolation/exact_match"
    guard_higher_is_better: bool = True
    guard_ci_floor: float = -0.03
    """"Helps" also needs the 95% CI of the guard metric's gain (when there is a guard) to lie above this."""
    no_effect_margin: float = 0.02
    """"No useful effect": the 90% CI of the primary gain lies within ±this."""

    def variants(self) -> set[str]:
        return {name for pair in self.comparisons for name in pair}


@dataclass(frozen=True)
class Verdict:
    variant: str
    baseline: str
    outcome: str
    primary: PairedStats
    p_t_corrected: float
    p_permutation_corrected: float
    guard: PairedStats
    reason: str


def decide(rule: DecisionRule, grouped: dict[str, list[dict]]) -> list[Verdict]:
    """One verdict per comparison of `rule`, from each variant's evaluation results (one per seed, with `seed`)."""
    primaries, guards = [], []
    for variant, baseline in rule.comparisons:
        primaries.append(paired_stats(paired_gains(grouped[variant], grouped[baseline], rule.primary,
                                                   rule.primary_higher_is_better)))  # fmt: skip
        guard_gains = [] if rule.guard is None else paired_gains(grouped[variant], grouped[baseline], rule.guard,
                                                                 rule.guard_higher_is_better)  # fmt: skip
        guards.append(paired_stats(guard_gains))
    correct = holm if rule.correction == "holm" else bonferroni
    corrected_t = correct([stats.p_t for stats in primaries])
    corrected_permutation = correct([stats.p_permutation for stats in primaries])
    comparisons = zip(rule.comparisons, primaries, corrected_t, corrected_permutation, guards, strict=True)
    verdicts = []
    for (variant, baseline), primary, p_t, p_permutation, guard in comparisons:
        outcome, reason = _outcome(rule, primary, p_t, p_permutation, guard)
        verdicts.append(Verdict(variant, baseline, outcome, primary, p_t, p_permutation, guard, reason))
    return verdicts


def _outcome(
    rule: DecisionRule, primary: PairedStats, p_t: float, p_permutation: float, guard: PairedStats
) -> tuple[str, str]:
    """(outcome, why) by the steps of the module docstring, from corrected p values."""
    t_significant, permutation_significant = p_t < rule.alpha, p_permutation < rule.alpha
    if t_significant != permutation_significant:
        return INCONCLUSIVE, f"the t-test and the permutation test disagree on significance at α {rule.alpha:g}"
    if t_significant and primary.mean >= rule.min_gain:
        if rule.guard is None or guard.ci95[0] > rule.guard_ci_floor:
            guarded = "" if rule.guard is None else f", guard CI above {_signed(rule.guard_ci_floor)}"
            return HELPS, f"significant, mean gain >= {rule.min_gain:g}{guarded}"
        floor = _signed(rule.guard_ci_floor)
        return INCONCLUSIVE, f"the guard's 95% CI reaches {_signed(guard.ci95[0])}, not above {floor}"
    if t_significant and primary.mean <= -rule.min_gain:
        return HURTS, f"significant, mean loss >= {rule.min_gain:g}"
    low, high = primary.ci90
    if -rule.no_effect_margin <= low and high <= rule.no_effect_margin:
        return NO_EFFECT, f"the 90% CI lies within ±{rule.no_effect_margin:g}"
    return INCONCLUSIVE, f"90% CI [{_signed(low)}, {_signed(high)}] is not within ±{rule.no_effect_margin:g}" + (
        "" if t_significant else f" and the difference is not significant at α {rule.alpha:g}"
    )


def _signed(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.3f}".replace("-", "−")


def verdict_lines(rule: DecisionRule, verdicts: list[Verdict]) -> list[str]:
    """The report's section: the rule's parameters, then one line per comparison."""
    guard = f" and the 95% CI of the `{rule.guard}` gain above {_signed(rule.guard_ci_floor)}" if rule.guard else ""
    lines = ["## Decision (computed by the protocol's rule)", "",
             f"Primary: `{rule.primary}`, gain signed so + is better; paired two-sided t-test and sign-flip "
             f"permutation test, each {rule.correction.capitalize()}-corrected over the comparisons "
             f"({len(rule.comparisons)}) at α {rule.alpha:g}. Helps: both significant, mean gain >= "
             f"{rule.min_gain:g}{guard}; hurts: both significant, mean loss >= {rule.min_gain:g}; no useful effect: "
             f"90% CI within ±{rule.no_effect_margin:g}; otherwise inconclusive.", ""]  # fmt: skip
    for v in verdicts:
        stats = v.primary
        low, high = (_signed(bound) for bound in v.guard.ci95)
        guarded = f"; guard gain 95% CI [{low}, {high}]" if rule.guard else ""
        lines.append(
            f"- `{v.variant}` vs `{v.baseline}`: **{v.outcome}** ({v.reason}). Mean gain {_signed(stats.mean)}, "
            f"95% CI [{_signed(stats.ci95[0])}, {_signed(stats.ci95[1])}], 90% CI [{_signed(stats.ci90[0])}, "
            f"{_signed(stats.ci90[1])}], corrected p(t) {v.p_t_corrected:.3g}, p(perm) "
            f"{v.p_permutation_corrected:.3g}, n {stats.n}{guarded}."
        )
    return [*lines, ""]


# The protocol's rules by name (`ntl-pretrain study --decide NAME`).
RULES = {
    "v3": DecisionRule(),
    "v3-gpu": DecisionRule(
        comparisons=(("ntl-was-lambda0.1", "ce"), ("ntl-was-lambda1", "ce"), ("ntl-was-answer", "ce")),
        primary="eval/addition_interpolation/exact_match",
        primary_higher_is_better=True,
        correction="bonferroni",
        min_gain=0.05,
        guard=None,
        no_effect_margin=0.05,
    ),
}
