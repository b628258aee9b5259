"""The study's paired statistics against scipy and brute force, and its decision rule on every branch."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ntl_pretrain.study.decision import (
    HELPS,
    HURTS,
    INCONCLUSIVE,
    NO_EFFECT,
    RULES,
    Effect,
    decide,
    verdict_lines,
)
from ntl_pretrain.study.power import (
    detectable_effect,
    helps_probability,
    margin_for,
    paired_t_power,
    sd_upper_bound,
    within_margin_probability,
)
from ntl_pretrain.study.runs import plan
from ntl_pretrain.study.stats import (
    bonferroni,
    holm,
    paired_gains,
    paired_stats,
    sign_flip_p,
    t_quantile,
    t_two_sided_p,
)

REPO = Path(__file__).resolve().parent.parent


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


def test_sign_flip_p_is_exact_to_32_seeds_and_samples_patterns_beyond() -> None:
    assert sign_flip_p([0.05] * 24) == 2 / 2**24  # study v4's 24 seeds: only +...+ and -...- are as extreme
    assert sign_flip_p([0.05] * 32) == 2 / 2**32
    all_positive = sign_flip_p([0.05] * 33)
    assert all_positive == 1 / (1 + 100_000)  # only the observed pattern, among the samples, is as extreme
    symmetric = sign_flip_p([0.05, -0.05] * 12 + [0.0])  # mean 0: every pattern is at least as extreme
    assert symmetric == 1.0
    rng = random.Random(4)
    differences = [rng.gauss(0.01, 0.02) for _ in range(15)]
    assert sign_flip_p(differences) == brute_force_sign_flip_p(differences)  # an odd n: halves of 7 and 8
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


RULE = RULES["v3"]
PRIMARY, GUARD = RULE.hypotheses[0].effect.metric, RULE.hypotheses[0].guard.metric


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
    ce = grouped["3digit/ce"]
    raw = [paired_stats(paired_gains(grouped[h.variant], ce, PRIMARY, False)) for h in RULE.hypotheses]
    assert [v.p_t_corrected for v in verdicts] == holm([stats.p_t for stats in raw])
    assert [v.p_permutation_corrected for v in verdicts] == holm([stats.p_permutation for stats in raw])
    assert [v.primary for v in verdicts] == raw


def test_the_gpu_arms_rule_decides_on_exact_match_with_bonferroni() -> None:
    """Three arms against `ce`, exact match primary (+0.08 helps, −0.08 hurts, ±0.01 no useful effect), no guard."""
    rule = RULES["v3-gpu"]
    primary = rule.hypotheses[0].effect.metric
    rng = random.Random(8)
    ce = [{"seed": s, primary: rng.uniform(0.1, 0.9)} for s in range(64)]
    grouped = {"ce": ce}
    for h, gain in zip(rule.hypotheses, (0.08, -0.08, 0.0), strict=True):
        gains = noisy(gain, 0.04, n=64, seed=len(grouped))
        grouped[h.variant] = [{"seed": r["seed"], primary: r[primary] + g} for r, g in zip(ce, gains, strict=True)]
    verdicts = decide(rule, grouped)
    assert [v.outcome for v in verdicts] == [HELPS, HURTS, NO_EFFECT]
    raw = [paired_stats(paired_gains(grouped[h.variant], ce, primary, True)) for h in rule.hypotheses]
    assert [v.p_t_corrected for v in verdicts] == bonferroni([stats.p_t for stats in raw])
    assert verdicts[0].primary.p_permutation == pytest.approx(1 / 100_001)  # sampled: n = 64 > 20
    assert "guard" not in verdict_lines(rule, verdicts)[-2]


V4 = RULES["v4"]
EXACT = "eval/addition_interpolation/exact_match"
EXACT_2, EXACT_3 = f"{EXACT}_2digit_token", f"{EXACT}_3digit_token"
SHARE_2 = 0.41  # of the 1,000 interpolation answers, 410 are 2-digit tokens under tiny-tokenizer-3digit


def v4_runs(gains: dict[str, tuple[float, float]], n: int = 24) -> dict[str, list[dict]]:
    """CE runs with seed-dependent exact match per answer class, and each arm's runs better by its (2-digit, 3-digit)
    gains plus a little noise; exact match over all answers is the 41/59 mix of the two, as in the real split."""
    rng = random.Random(9)
    ce = [(0.6 + 0.2 * rng.random(), 0.3 + 0.2 * rng.random()) for _ in range(n)]
    grouped = {}
    for variant, (gain_2, gain_3) in {"3digit/ce": (0.0, 0.0), **gains}.items():
        noise = 0.0 if variant == "3digit/ce" else 0.01
        runs = []
        for seed, (exact_2, exact_3) in enumerate(ce):
            two, three = exact_2 + gain_2 + rng.gauss(0, noise), exact_3 + gain_3 + rng.gauss(0, noise)
            runs.append({"seed": seed, EXACT_2: two, EXACT_3: three, EXACT: SHARE_2 * two + (1 - SHARE_2) * three})
        grouped[variant] = runs
    return grouped


def test_v4_decides_each_hypothesis_on_its_own_effect() -> None:
    """By construction: NTL-WAS gains 0.20 on 2-digit answers and nothing on 3-digit ones (H1 helps); NTL-digits
    gains 0.20 on 2-digit answers and loses 0.139 on 3-digit ones, which leaves all answers unchanged (H2, 0.41 x
    0.20 = 0.59 x 0.139: no useful effect) and 3-digit answers 0.139 worse than NTL-WAS's (H3 hurts)."""
    grouped = v4_runs({"3digit/ntl-was-answer": (0.20, 0.0), "3digit/ntl-digits-answer": (0.20, -0.139)})
    verdicts = decide(V4, grouped)
    assert [v.hypothesis.name for v in verdicts] == ["H1", "H2", "H3"]
    assert [v.outcome for v in verdicts] == [HELPS, NO_EFFECT, HURTS]
    assert [v.primary.mean for v in verdicts] == pytest.approx([0.20, 0.0, -0.139], abs=0.01)
    pairs = [("3digit/ntl-was-answer", "3digit/ce"), ("3digit/ntl-digits-answer", "3digit/ce"),
             ("3digit/ntl-digits-answer", "3digit/ntl-was-answer")]  # fmt: skip
    assert [(v.variant, v.baseline) for v in verdicts] == pairs
    raw = [paired_stats(h.effect.per_seed(grouped[h.variant], grouped[h.baseline])) for h in V4.hypotheses]
    assert [v.p_t_corrected for v in verdicts] == holm([stats.p_t for stats in raw])  # Holm over the three
    lines = verdict_lines(V4, verdicts)
    assert "Holm-corrected over the hypotheses (3) at α 0.05" in lines[2]
    assert lines[4].startswith(f"- H1, `3digit/ntl-was-answer` vs `3digit/ce` on the gain in `{EXACT_2}` minus the "
                               f"gain in `{EXACT_3}`")  # fmt: skip
    assert "minimum 0.11, margin ±0.11: **helps**" in lines[4] and "**hurts**" in lines[6]


def test_v4_h1_is_the_2_digit_gain_minus_the_3_digit_gain() -> None:
    """The same gains swapped between the classes turn H1 around; a seed missing a class's figure is left out."""
    grouped = v4_runs({"3digit/ntl-was-answer": (0.0, 0.20), "3digit/ntl-digits-answer": (0.0, 0.0)})
    h1 = V4.hypotheses[0]
    ce, was = grouped["3digit/ce"], grouped["3digit/ntl-was-answer"]
    expected = [(w[EXACT_2] - c[EXACT_2]) - (w[EXACT_3] - c[EXACT_3]) for w, c in zip(was, ce, strict=True)]
    assert h1.effect.per_seed(was, ce) == pytest.approx(expected)
    assert decide(V4, grouped)[0].outcome == HURTS
    del was[3][EXACT_3]
    assert len(h1.effect.per_seed(was, ce)) == 23
    two_digit_gains = [w[EXACT_2] - c[EXACT_2] for w, c in zip(was, ce, strict=True)]
    assert Effect(EXACT_2).per_seed(was, ce) == pytest.approx(two_digit_gains)  # a one-metric effect keeps seed 3


def test_v4_is_inconclusive_between_its_margin_and_significance() -> None:
    """H2 gains 0.05 over CE on every class with an sd of 0.15: neither shown nor within ±0.065."""
    grouped = v4_runs({"3digit/ntl-was-answer": (0.0, 0.0), "3digit/ntl-digits-answer": (0.0, 0.0)})
    for run, gain in zip(grouped["3digit/ntl-digits-answer"], noisy(0.05, 0.15, n=24), strict=True):
        run[EXACT] += gain
    verdict = decide(V4, grouped)[1]
    assert verdict.outcome == INCONCLUSIVE and "not within ±0.065" in verdict.reason


def test_power_of_the_paired_t_test_against_simulation() -> None:
    """Normal theory against 20,000 simulated studies of 24 seeds (each figure within 0.015 of the simulation)."""
    rng = np.random.default_rng(0)
    n, sd, alpha = 24, 0.11, 0.05 / 3
    assert paired_t_power(0.0, sd, n, alpha) == pytest.approx(alpha)
    assert paired_t_power(detectable_effect(sd, n, alpha), sd, n, alpha) == pytest.approx(0.8)
    critical = scipy_stats.t.ppf(1 - alpha / 2, n - 1)
    for effect, margin in ((0.0, 0.065), (0.08, 0.065), (0.03, 0.075)):
        d = rng.normal(effect, sd, size=(20_000, n))
        mean, std = d.mean(axis=1), d.std(axis=1, ddof=1)
        half = scipy_stats.t.ppf(0.95, n - 1) * std / math.sqrt(n)
        within = np.mean((mean - half >= -margin) & (mean + half <= margin))
        helps = np.mean((mean / (std / math.sqrt(n)) > critical) & (mean >= margin))
        assert within_margin_probability(margin, sd, n, effect) == pytest.approx(within, abs=0.015)
        assert helps_probability(effect, margin, sd, n, alpha) == pytest.approx(helps, abs=0.015)
    assert within_margin_probability(margin_for(0.5, sd, n), sd, n) == pytest.approx(0.5)
    # 16 seeds put the true sd below 1.206 x the sample's with 80% confidence (χ² with 15 df)
    assert sd_upper_bound(0.1, 16) == pytest.approx(0.1 * math.sqrt(15 / scipy_stats.chi2.ppf(0.2, 15)))


V5 = RULES["v5"]
LOG_ERROR = "eval/regression_interpolation/log_mae"
UNPARSEABLE = "eval/regression_interpolation/unparseable"


def v5_runs(gains: dict[str, float], n: int = 24) -> dict[str, list[dict]]:
    """CE runs of both tokenizers with seed-dependent log-error, and each NTL arm's runs lower by its gain plus a
    little noise; no unparseable answers unless a test adds them."""
    rng = random.Random(5)
    grouped = {}
    for folder in ("regression", "regression-1digit"):
        ce = [0.9 + 0.2 * rng.random() for _ in range(n)]
        grouped[f"{folder}/ce"] = [{"seed": s, LOG_ERROR: e, UNPARSEABLE: 0.0} for s, e in enumerate(ce)]
        gain = gains[f"{folder}/ntl-was-answer"]
        grouped[f"{folder}/ntl-was-answer"] = [{"seed": s, LOG_ERROR: e - gain + rng.gauss(0, 0.01), UNPARSEABLE: 0.0}
                                               for s, e in enumerate(ce)]  # fmt: skip
    return grouped


def test_v5_h3_is_the_gain_under_one_tokenizer_minus_the_gain_under_the_other() -> None:
    """NTL cuts log-error by 0.10 under 1–3-digit tokens and by 0.02 under single digits: H1 helps, H2 is within its
    margin, H3 (the first gain minus the second, seed by seed, Holm over the three) helps; swapped, H3 hurts."""
    grouped = v5_runs({"regression/ntl-was-answer": 0.10, "regression-1digit/ntl-was-answer": 0.0})
    three, one = V5.hypotheses[0], V5.hypotheses[1]
    per_seed_h1 = three.per_seed(grouped)
    per_seed_h2 = one.per_seed(grouped)
    expected = [a - b for a, b in zip(per_seed_h1, per_seed_h2, strict=True)]
    h3 = V5.hypotheses[2]
    assert h3.per_seed(grouped) == pytest.approx(expected) and len(expected) == 24
    assert V5.variants() == {"regression/ce", "regression/ntl-was-answer", "regression-1digit/ce",
                             "regression-1digit/ntl-was-answer"}  # fmt: skip
    verdicts = decide(V5, grouped)
    assert [v.outcome for v in verdicts] == [HELPS, NO_EFFECT, HELPS]
    assert [v.primary.mean for v in verdicts] == pytest.approx([0.10, 0.0, 0.10], abs=0.01)
    raw = [paired_stats(h.per_seed(grouped)) for h in V5.hypotheses]
    assert [v.p_t_corrected for v in verdicts] == holm([stats.p_t for stats in raw])
    line = verdict_lines(V5, verdicts)[6]
    assert line.startswith("- H3, `regression/ntl-was-answer` vs `regression/ce` minus "
                           "`regression-1digit/ntl-was-answer` vs `regression-1digit/ce` on")  # fmt: skip
    swapped = v5_runs({"regression/ntl-was-answer": 0.0, "regression-1digit/ntl-was-answer": 0.10})
    assert [v.outcome for v in decide(V5, swapped)] == [NO_EFFECT, HELPS, HURTS]
    del swapped["regression-1digit/ce"][7][LOG_ERROR]  # a seed without a figure is left out of H2 and H3 alike
    assert len(V5.hypotheses[2].per_seed(swapped)) == 23


def test_v5_helps_only_when_the_answers_without_a_number_do_not_grow() -> None:
    """Log-error is over the answers that contain a number: an arm that gains it by leaving 3% of its answers
    without one is not called helping (the guard's 95% CI must lie above −0.01)."""
    grouped = v5_runs({"regression/ntl-was-answer": 0.10, "regression-1digit/ntl-was-answer": 0.10})
    for run in grouped["regression/ntl-was-answer"]:
        run[UNPARSEABLE] = 0.03 + 0.001 * (run["seed"] % 3)
    h1, h2, _ = decide(V5, grouped)
    assert h1.outcome == INCONCLUSIVE and "guard" in h1.reason and h2.outcome == HELPS


V6 = RULES["v6"]
V6_FOLDERS = ("regression", "regression-1digit", "regression-exact", "regression-exact-1digit")


def v6_runs(gains: dict[str, float], n: int) -> dict[str, list[dict]]:
    """Each folder's CE runs with seed-dependent log-error, and its NTL arm's lower by the folder's gain plus a little
    noise; no unparseable answers."""
    rng = random.Random(6)
    grouped = {}
    for folder in V6_FOLDERS:
        ce = [0.6 + 0.4 * rng.random() for _ in range(n)]
        grouped[f"{folder}/ce"] = [{"seed": 64 + s, LOG_ERROR: e, UNPARSEABLE: 0.0} for s, e in enumerate(ce)]
        grouped[f"{folder}/ntl-was-answer"] = [
            {"seed": 64 + s, LOG_ERROR: e - gains[folder] + rng.gauss(0, 0.002), UNPARSEABLE: 0.0}
            for s, e in enumerate(ce)
        ]
    return grouped


def test_v6_asks_four_gains_and_two_differences_of_them_over_the_v6_recipes(tmp_path: Path) -> None:
    """H1–H4: NTL-WAS against CE in each folder of recipes/study/v6, with v5's guard on answers without a number;
    H5: the noisy 1–3-digit gain minus the noisy single-digit one; H6: the noisy 1–3-digit gain minus the noise-free
    one; Holm over the six. Gains of 3 m under 1–3-digit tokens (noisy and not) and 0 under single digits: H1 and H3
    help, H2 and H4 show no useful effect, H5 helps, H6 (3 m − 3 m) shows none."""
    assert V6.variants() == {f"{folder}/{arm}" for folder in V6_FOLDERS for arm in ("ce", "ntl-was-answer")}
    plan(REPO / "recipes" / "study" / "v6", sorted(V6.variants()), [64], tmp_path)  # every variant has its recipe
    gain_m, difference_m = (V6.hypotheses[0].min_gain, V6.hypotheses[4].min_gain)
    assert [h.min_gain for h in V6.hypotheses] == [h.no_effect_margin for h in V6.hypotheses]
    assert [h.min_gain for h in V6.hypotheses] == [gain_m] * 4 + [difference_m] * 2
    assert [h.guard for h in V6.hypotheses] == [Effect(UNPARSEABLE, higher_is_better=False)] * 4 + [None] * 2
    n = 12
    gains = {"regression": 3 * gain_m, "regression-exact": 3 * gain_m, "regression-1digit": 0.0,
             "regression-exact-1digit": 0.0}  # fmt: skip
    grouped = v6_runs(gains, n)
    per_seed = {h.name: h.per_seed(grouped) for h in V6.hypotheses}
    assert per_seed["H5"] == pytest.approx([a - b for a, b in zip(per_seed["H1"], per_seed["H2"], strict=True)])
    assert per_seed["H6"] == pytest.approx([a - b for a, b in zip(per_seed["H1"], per_seed["H3"], strict=True)])
    verdicts = decide(V6, grouped)
    assert [v.outcome for v in verdicts] == [HELPS, NO_EFFECT, HELPS, NO_EFFECT, HELPS, NO_EFFECT]
    raw = [paired_stats(per_seed[h.name]) for h in V6.hypotheses]
    assert [v.p_permutation_corrected for v in verdicts] == holm([stats.p_permutation for stats in raw])
    assert raw[0].n == n and min(v.p_permutation_corrected for v in verdicts) == pytest.approx(6 * 2 / 2**n)


def test_v7_asks_v6s_four_gains_over_the_v7_recipes_and_reads_each_run_early_stopped(tmp_path: Path) -> None:
    """docs/study-v7-protocol.md: H1–H4 are v6's gains (NTL-WAS against CE per folder, v5's guard on answers without a
    number) over recipes/study/v7, one m for all four, Holm over the four, and each run's best validation answer-CE
    read as well. Gains of 3 m under 1–3-digit tokens and 0 under single digits: H1 and H3 help, H2 and H4 show no
    useful effect; the smallest corrected permutation p is 4 × 2/2^12."""
    v7 = RULES["v7"]
    assert v7.variants() == {f"{folder}/{arm}" for folder in V6_FOLDERS for arm in ("ce", "ntl-was-answer")}
    plan(REPO / "recipes" / "study" / "v7", sorted(v7.variants()), [76], tmp_path)  # every variant has its recipe
    m = v7.hypotheses[0].min_gain
    assert m > 0 and {(h.min_gain, h.no_effect_margin) for h in v7.hypotheses} == {(m, m)}
    assert [h.name for h in v7.hypotheses] == ["H1", "H2", "H3", "H4"] and v7.early_stopping == "val_answer_ce"
    assert [h.guard for h in v7.hypotheses] == [Effect(UNPARSEABLE, higher_is_better=False)] * 4
    assert [(h.variant, h.baseline) for h in v7.hypotheses] == [(h.variant, h.baseline) for h in V6.hypotheses[:4]]
    n = 12
    gains = {"regression": 3 * m, "regression-exact": 3 * m, "regression-1digit": 0.0, "regression-exact-1digit": 0.0}
    verdicts = decide(v7, v6_runs(gains, n))
    assert [v.outcome for v in verdicts] == [HELPS, NO_EFFECT, HELPS, NO_EFFECT]
    assert min(v.p_permutation_corrected for v in verdicts) == pytest.approx(4 * 2 / 2**n)
