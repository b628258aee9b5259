"""The study's paired statistics against scipy and brute force, and its decision rule on every branch."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
from scipy import stats as scipy_stats

from ntl_pretrain.study_decision import (
    HELPS,
    HURTS,
    INCONCLUSIVE,
    NO_EFFECT,
    RULES,
    DecisionRule,
    decide,
    verdict_lines,
)
from ntl_pretrain.study_stats import (
    bonferroni,
    holm,
    paired_gains,
    paired_stats,
    sign_flip_p,
    t_quantile,
    t_two_sided_p,
)


def test_t_quantiles_match_printed_tables() -> None:
    assert t_quantile(0.975, 5) == pytest.approx(2.570582, abs=1e-6)
    assert t_quantile(0.95, 15) == pytest.approx(1.753050, abs=1e-6)
    assert t_quantile(0.975, 15) == pytest.approx(2.131450, abs=1e-6)
    assert t_two_sided_p(2.131450, 15) == pytest.approx(0.05, abs=1e-6)


def test_paired_stats_match_scipys_paired_t_test() -> None:
    rng = random.Random(1)
    baseline = [rng.gauss(0.2, 0.05) for _ in range(16)]
    variant = [b - 0.02 + rng.gauss(0, 0.03) for b in baseline]
    ours = paired_stats([v - b for v, b in zip(variant, baseline, strict=True)])
    reference = scipy_stats.ttest_rel(variant, baseline)
    assert ours.n == 16
    assert ours.t == pytest.approx(reference.statistic, rel=1e-9)
    assert ours.p_t == pytest.approx(reference.pvalue, rel=1e-9)
    assert ours.ci95 == pytest.approx(tuple(reference.confidence_interval(0.95)), rel=1e-9)
    assert ours.ci90 == pytest.approx(tuple(reference.confidence_interval(0.90)), rel=1e-9)


def brute_force_sign_flip_p(differences: list) -> float:
    observed = abs(sum(differences))
    flips = list(itertools.product((1, -1), repeat=len(differences)))
    extreme = sum(abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed
                  for signs in flips)  # fmt: skip
    return extreme / len(flips)


def test_exact_sign_flip_p_counts_every_pattern() -> None:
    rng = random.Random(2)
    for n in (1, 3, 8, 12):
        differences = [rng.gauss(0.01, 0.02) for _ in range(n)]
        assert sign_flip_p(differences) == brute_force_sign_flip_p(differences)
    assert sign_flip_p([1.0, 1.0, 1.0]) == 2 / 8  # ties with the observed pattern count: +++ and ---
    # Ties reached by another order of float additions (naive float sums find 14 of the 16): exact rationals count
    # them, and so must the float sums.
    tied = ["0.3", "-0.1", "-0.1", "0.1", "0.2"]
    assert sign_flip_p([float(d) for d in tied]) == brute_force_sign_flip_p([Fraction(d) for d in tied]) == 16 / 32
    assert sign_flip_p([0.0] * 5) == 1.0 and math.isnan(sign_flip_p([]))


def test_sign_flip_p_samples_patterns_beyond_twenty_seeds() -> None:
    all_positive = sign_flip_p([0.05] * 25)
    assert all_positive == 1 / (1 + 100_000)  # only the observed pattern, among the samples, is as extreme
    symmetric = sign_flip_p([0.05, -0.05] * 12 + [0.0])  # mean 0: every pattern is at least as extreme
    assert symmetric == 1.0
    rng = random.Random(3)
    differences = [rng.gauss(0.004, 0.02) for _ in range(30)]
    # against the normal approximation of the sum of random signs, which is close at n = 30
    z = abs(sum(differences)) / math.sqrt(sum(d * d for d in differences))
    assert sign_flip_p(differences) == pytest.approx(2 * scipy_stats.norm.sf(z), abs=0.02)


def test_paired_stats_without_spread_or_pairs() -> None:
    constant = paired_stats([0.03, 0.03, 0.03])
    assert constant.t == math.inf and constant.p_t == 0.0 and constant.ci95 == (0.03, 0.03)
    nothing = paired_stats([0.0, 0.0])
    assert math.isnan(nothing.t) and math.isnan(nothing.p_t) and nothing.p_permutation == 1.0
    one = paired_stats([0.5])
    assert one.mean == 0.5 and math.isnan(one.p_t) and math.isnan(one.ci95[0])


def test_holm_step_down() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # 2 x 0.6 capped, then non-decreasing
    assert holm([math.nan, 0.01]) == pytest.approx([1.0, 0.02])
    assert bonferroni([0.01, 0.04, 0.5, math.nan]) == pytest.approx([0.04, 0.16, 1.0, 1.0])


def test_paired_gains_pair_by_seed_and_sign_so_plus_is_better() -> None:
    ce = [{"seed": 0, "m": 0.30}, {"seed": 1, "m": 0.20}, {"seed": 2, "m": 0.10}]
    ntl = [{"seed": 2, "m": 0.05}, {"seed": 0, "m": 0.35}, {"seed": 3, "m": 0.0}, {"seed": 1, "m": math.nan}]
    assert paired_gains(ntl, ce, "m", higher_is_better=False) == pytest.approx([-0.05, 0.05])  # seeds 0 and 2
    assert paired_gains(ntl, ce, "m", higher_is_better=True) == pytest.approx([0.05, -0.05])


RULE = DecisionRule()
PRIMARY, GUARD = RULE.primary, RULE.guard


def grouped_runs(gains: dict[str, list[float]], exact_gains: dict[str, list[float]] | None = None) -> dict:
    """CE runs with seed-dependent log-errors, and each variant's runs lower by its gain on that seed."""
    rng = random.Random(4)
    n = len(next(iter(gains.values())))
    ce_log = [0.15 + 0.03 * rng.random() for _ in range(n)]
    ce_exact = [0.5 + 0.1 * rng.random() for _ in range(n)]
    grouped = {"3digit/ce": [{"seed": s, PRIMARY: ce_log[s], GUARD: ce_exact[s]} for s in range(n)]}
    for variant, per_seed in gains.items():
        exact = (exact_gains or {}).get(variant, [0.0] * n)
        grouped[variant] = [{"seed": s, PRIMARY: ce_log[s] - g, GUARD: ce_exact[s] + e}
                            for s, (g, e) in enumerate(zip(per_seed, exact, strict=True))]  # fmt: skip
    return grouped


def noisy(mean: float, spread: float, n: int = 16, seed: int = 5) -> list[float]:
    rng = random.Random(seed)
    return [mean + rng.gauss(0, spread) for _ in range(n)]


def outcomes(grouped: dict) -> list[str]:
    return [verdict.outcome for verdict in decide(RULE, grouped)]


def test_decision_helps_hurts_and_no_useful_effect() -> None:
    grouped = grouped_runs({"3digit/ntl-was": noisy(0.04, 0.02), "3digit/ntl-was-answer": noisy(-0.04, 0.02, seed=6)})
    assert outcomes(grouped) == [HELPS, HURTS]
    grouped = grouped_runs({"3digit/ntl-was": noisy(0.0, 0.01), "3digit/ntl-was-answer": noisy(0.003, 0.005)})
    assert outcomes(grouped) == [NO_EFFECT, NO_EFFECT]
    lines = verdict_lines(RULE, decide(RULE, grouped))
    assert lines[-3].startswith("- `3digit/ntl-was` vs `3digit/ce`: **no useful effect** (the 90% CI lies within")


def test_decision_needs_the_exact_match_guard_to_help() -> None:
    """A clear gain in log-error, but exact match falls by 0.05 on every seed: not "helps"."""
    gains = {"3digit/ntl-was": noisy(0.04, 0.02), "3digit/ntl-was-answer": noisy(0.04, 0.02, seed=6)}
    verdicts = decide(RULE, grouped_runs(gains, {"3digit/ntl-was": noisy(-0.05, 0.01)}))
    assert [v.outcome for v in verdicts] == [INCONCLUSIVE, HELPS]
    assert "guard's 95% CI reaches" in verdicts[0].reason and verdicts[0].guard.ci95[0] < -0.03


def test_decision_is_inconclusive_with_a_wide_interval() -> None:
    grouped = grouped_runs({"3digit/ntl-was": noisy(0.03, 0.2), "3digit/ntl-was-answer": noisy(0.0, 0.01)})
    verdicts = decide(RULE, grouped)
    assert [v.outcome for v in verdicts] == [INCONCLUSIVE, NO_EFFECT]
    assert "not within ±0.02 and the difference is not significant" in verdicts[0].reason


def test_decision_is_inconclusive_when_the_tests_disagree() -> None:
    """Five seeds, all better by ~0.05: t is huge, but no sign-flip p can be below 2/32 = 0.0625."""
    gains = {"3digit/ntl-was": [0.05, 0.051, 0.049, 0.05, 0.052], "3digit/ntl-was-answer": [0.0] * 5}
    verdict = decide(RULE, grouped_runs(gains))[0]
    assert verdict.p_t_corrected < 0.001 and verdict.p_permutation_corrected == 2 * 2 / 32
    assert verdict.outcome == INCONCLUSIVE and "disagree" in verdict.reason


def test_decision_corrects_for_the_family() -> None:
    grouped = grouped_runs({"3digit/ntl-was": noisy(0.015, 0.03), "3digit/ntl-was-answer": noisy(0.01, 0.03, seed=7)})
    verdicts = decide(RULE, grouped)
    raw = [paired_stats(paired_gains(grouped[v], grouped["3digit/ce"], PRIMARY, False)) for v, _ in RULE.comparisons]
    assert [v.p_t_corrected for v in verdicts] == holm([stats.p_t for stats in raw])
    assert [v.p_permutation_corrected for v in verdicts] == holm([stats.p_permutation for stats in raw])
    assert [v.primary for v in verdicts] == raw


def test_the_gpu_arms_rule_decides_on_exact_match_with_bonferroni() -> None:
    """Three arms against `ce`, exact match primary (+0.08 helps, −0.08 hurts, ±0.01 no useful effect), no guard."""
    rule = RULES["v3-gpu"]
    rng = random.Random(8)
    ce = [{"seed": s, rule.primary: rng.uniform(0.1, 0.9)} for s in range(64)]
    grouped = {"ce": ce}
    for (variant, _), gain in zip(rule.comparisons, (0.08, -0.08, 0.0), strict=True):
        gains = noisy(gain, 0.04, n=64, seed=len(grouped))
        grouped[variant] = [
            {"seed": r["seed"], rule.primary: r[rule.primary] + g} for r, g in zip(ce, gains, strict=True)
        ]
    verdicts = decide(rule, grouped)
    assert [v.outcome for v in verdicts] == [HELPS, HURTS, NO_EFFECT]
    raw = [paired_stats(paired_gains(grouped[v], ce, rule.primary, True)) for v, _ in rule.comparisons]
    assert [v.p_t_corrected for v in verdicts] == bonferroni([stats.p_t for stats in raw])
    assert verdicts[0].primary.p_permutation == pytest.approx(1 / 100_001)  # sampled: n = 64 > 20
    assert "guard" not in verdict_lines(rule, verdicts)[-2]
