"""A study's decision rule, fixed before the runs and applied by code: does each NTL variant help, hurt, or neither?

The defaults are study v3's rule (docs/study-v3-protocol.md): the primary metric is log10(1 + |error|) on the
held-out sums, `3digit/ntl-was` and `3digit/ntl-was-answer` are each compared with `3digit/ce` (paired by seed),
with a two-sided paired t-test Holm-corrected over the comparisons at α 0.05 and the sign-flip permutation p
(Holm-corrected the same way) beside it. In order:
1. inconclusive when the t-test and the permutation test disagree on significance (Holm-adjusted p < α);
2. helps: significant, mean gain >= min_gain, and the 95% CI of the guard metric's gain (exact match, variant − CE)
   has its lower bound above guard_ci_floor;
3. hurts: significant, mean loss >= min_gain (a gain <= −min_gain);
4. no useful effect: the 90% CI of the primary gain lies within ±no_effect_margin;
5. otherwise inconclusive, with the CI.
Gains are signed so that + is better: CE's log-error minus the variant's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ntl_pretrain.study_stats import PairedStats, holm, paired_gains, paired_stats

HELPS, HURTS, NO_EFFECT, INCONCLUSIVE = "helps", "hurts", "no useful effect", "inconclusive"


@dataclass(frozen=True)
class DecisionRule:
    comparisons: tuple[tuple[str, str], ...] = (
        ("3digit/ntl-was", "3digit/ce"),
        ("3digit/ntl-was-answer", "3digit/ce"),
    )
    """(variant, baseline) pairs: the family that Holm's correction spans."""
    primary: str = "eval/addition_interpolation/log_mae"
    primary_higher_is_better: bool = False
    alpha: float = 0.05
    min_gain: float = 0.02
    """Smallest mean gain in the primary metric that counts as helping (or, negated, hurting)."""
    guard: str = "eval/addition_interpolation/exact_match"
    guard_higher_is_better: bool = True
    guard_ci_floor: float = -0.03
    """"Helps" also needs the 95% CI of the guard metric's gain to have its lower bound above this."""
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
    p_t_holm: float
    p_permutation_holm: float
    guard: PairedStats
    reason: str


def decide(rule: DecisionRule, grouped: dict[str, list[dict]]) -> list[Verdict]:
    """One verdict per comparison of `rule`, from each variant's evaluation results (one per seed, with `seed`)."""
    primaries, guards = [], []
    for variant, baseline in rule.comparisons:
        primaries.append(paired_stats(paired_gains(grouped[variant], grouped[baseline], rule.primary,
                                                   rule.primary_higher_is_better)))  # fmt: skip
        guards.append(paired_stats(paired_gains(grouped[variant], grouped[baseline], rule.guard,
                                                rule.guard_higher_is_better)))  # fmt: skip
    holm_t = holm([stats.p_t for stats in primaries])
    holm_permutation = holm([stats.p_permutation for stats in primaries])
    comparisons = zip(rule.comparisons, primaries, holm_t, holm_permutation, guards, strict=True)
    verdicts = []
    for (variant, baseline), primary, p_t, p_permutation, guard in comparisons:
        outcome, reason = _outcome(rule, primary, p_t, p_permutation, guard)
        verdicts.append(Verdict(variant, baseline, outcome, primary, p_t, p_permutation, guard, reason))
    return verdicts


def _outcome(
    rule: DecisionRule, primary: PairedStats, p_t: float, p_permutation: float, guard: PairedStats
) -> tuple[str, str]:
    """(outcome, why) by the steps of the module docstring, from Holm-adjusted p values."""
    t_significant, permutation_significant = p_t < rule.alpha, p_permutation < rule.alpha
    if t_significant != permutation_significant:
        return INCONCLUSIVE, f"the t-test and the permutation test disagree on significance at α {rule.alpha:g}"
    if t_significant and primary.mean >= rule.min_gain:
        if guard.ci95[0] > rule.guard_ci_floor:
            return HELPS, f"significant, mean gain >= {rule.min_gain:g}, guard CI above {_signed(rule.guard_ci_floor)}"
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
    lines = ["## Decision (computed by the protocol's rule)", "",
             f"Primary: `{rule.primary}`, gain signed so + is better; paired two-sided t-test and sign-flip "
             f"permutation test, each Holm-corrected over the comparisons ({len(rule.comparisons)}) at α "
             f"{rule.alpha:g}. Helps: both significant, mean gain >= {rule.min_gain:g} and the 95% CI of the "
             f"`{rule.guard}` gain above {_signed(rule.guard_ci_floor)}; hurts: both significant, mean loss >= "
             f"{rule.min_gain:g}; no useful effect: 90% CI within ±{rule.no_effect_margin:g}; otherwise inconclusive.",
             ""]  # fmt: skip
    for v in verdicts:
        stats = v.primary
        lines.append(
            f"- `{v.variant}` vs `{v.baseline}`: **{v.outcome}** ({v.reason}). Mean gain {_signed(stats.mean)}, "
            f"95% CI [{_signed(stats.ci95[0])}, {_signed(stats.ci95[1])}], 90% CI [{_signed(stats.ci90[0])}, "
            f"{_signed(stats.ci90[1])}], Holm-adjusted p(t) {v.p_t_holm:.3g}, p(perm) {v.p_permutation_holm:.3g}, "
            f"n {stats.n}; guard gain 95% CI [{_signed(v.guard.ci95[0])}, {_signed(v.guard.ci95[1])}]."
        )
    return [*lines, ""]
