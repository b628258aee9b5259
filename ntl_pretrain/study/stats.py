"""Paired statistics for a study: each variant's runs paired by seed with its baseline's, as pure functions.

For the per-seed differences d_1..d_n (variant − baseline, or signed so + is better: the caller chooses): the mean,
its confidence intervals from Student's t with n − 1 degrees of freedom, the paired t statistic and its two-sided
p, and the sign-flip permutation p (under "no effect" each d_i is as likely to be −d_i: the share of the 2^n sign
patterns whose mean is at least as far from 0 as the observed one, the observed pattern included). Holm's step-down
correction (or Bonferroni's) adjusts the p of a family of comparisons.

The t distribution is scipy's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

# Exact up to 2^32 sign patterns, counted half against half (2 x 2^16 sums); beyond that a seeded sample of patterns.
EXACT_PERMUTATION_MAX_N = 32
PERMUTATION_SAMPLES = 100_000  # study v3's GPU arm (docs/study-v3-protocol.md): 64 seeds


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
    return math.nan if math.isnan(t) else float(2.0 * scipy_stats.t.sf(abs(t), df))


def t_quantile(probability: float, df: float) -> float:
    """The `probability` quantile of Student's t (0.975 for a two-sided 95% interval)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    return float(scipy_stats.t.ppf(probability, df))


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided sign-flip permutation p of the mean difference: exact over all 2^n sign patterns (the observed
    one included) for n <= EXACT_PERMUTATION_MAX_N, else over the observed pattern and PERMUTATION_SAMPLES random
    ones (seed 0, so a report is reproducible). NaN without differences."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        return math.nan
    observed = abs(d.sum())
    slack = 1e-9 * np.abs(d).sum()  # the same |sum| reached in another order may differ in the last bits
    if d.size <= EXACT_PERMUTATION_MAX_N:
        return _exact_sign_flip_p(d, observed - slack)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(PERMUTATION_SAMPLES, d.size))
    extreme = int(np.sum(np.abs(signs @ d) >= observed - slack))
    return (1 + extreme) / (1 + PERMUTATION_SAMPLES)


def _exact_sign_flip_p(d: np.ndarray, threshold: float) -> float:
    """The share of all 2^n sign patterns whose |signed sum| >= threshold, counted without listing them: every
    pattern is a sum a + b of one signed sum of each half, so per a the b with a + b >= threshold or
    a + b <= -threshold are counted by binary search in the other half's sorted sums."""
    if threshold <= 0:
        return 1.0
    first, second = _signed_sums(d[: d.size // 2]), np.sort(_signed_sums(d[d.size // 2 :]))
    at_least = second.size - np.searchsorted(second, threshold - first, side="left")
    at_most = np.searchsorted(second, -threshold - first, side="right")
    return float((at_least.sum() + at_most.sum()) / (first.size * second.size))


def _signed_sums(values: np.ndarray) -> np.ndarray:
    """The 2^len(values) sums ±v_1 ± v_2 ..."""
    sums = np.zeros(1)
    for value in values:
        sums = np.concatenate([sums + value, sums - value])
    return sums


@dataclass(frozen=True)
class PairedStats:
    """Statistics of n paired differences; NaN where n is too small (t and its CIs need n >= 2) or the
    differences do not vary (all equal: no t, and a CI of width 0)."""

    n: int
    mean: float
    std: float
    ci95: tuple[float, float]
    ci90: tuple[float, float]
    t: float
    p_t: float
    p_permutation: float


def confidence_interval(mean: float, std: float, n: int, level: float) -> tuple[float, float]:
    if n < 2:
        return math.nan, math.nan
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return mean - half, mean + half


def paired_stats(differences: list[float]) -> PairedStats:
    n = len(differences)
    if n == 0:
        return PairedStats(0, math.nan, math.nan, (math.nan,) * 2, (math.nan,) * 2, math.nan, math.nan, math.nan)
    mean = statistics.fmean(differences)
    std = statistics.stdev(differences) if n > 1 else math.nan
    if n < 2 or std == 0.0:
        t = math.nan if n < 2 or mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / (std / math.sqrt(n))
    return PairedStats(
        n=n,
        mean=mean,
        std=std,
        ci95=confidence_interval(mean, std, n, 0.95),
        ci90=confidence_interval(mean, std, n, 0.90),
        t=t,
        p_t=t_two_sided_p(t, n - 1) if n > 1 else math.nan,
        p_permutation=sign_flip_p(differences),
    )


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p of a family, in the given order: the k-th smallest of m is multiplied by
    m − k + 1, then made non-decreasing in that order and capped at 1. A NaN p (no test) counts as 1."""
    m = len(p_values)
    filled = [1.0 if math.isnan(p) else p for p in p_values]
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: filled[i])):
        running = max(running, min(1.0, (m - rank) * filled[index]))
        adjusted[index] = running
    return adjusted


def bonferroni(p_values: list[float]) -> list[float]:
    """Each p multiplied by the family's size, capped at 1; a NaN p (no test) counts as 1."""
    return [1.0 if math.isnan(p) else min(1.0, len(p_values) * p) for p in p_values]


def paired_gains(results: list[dict], baseline: list[dict], key: str, higher_is_better: bool) -> list[float]:
    """Per seed that both lists of evaluation results (each with its run's `seed`) measured with a finite `key`,
    in seed order: variant − baseline, signed so that + is better (baseline − variant for a lower-is-better
    metric)."""
    return list(paired_gains_by_seed(results, baseline, key, higher_is_better).values())


def paired_gains_by_seed(results: list[dict], baseline: list[dict], key: str, higher_is_better: bool) -> dict:
    """`paired_gains` keyed by seed (in seed order), for effects that combine two metrics' gains seed by seed."""
    sign = 1.0 if higher_is_better else -1.0
    ours = {r["seed"]: r.get(key, math.nan) for r in results}
    theirs = {r["seed"]: r.get(key, math.nan) for r in baseline}
    gains = {seed: sign * (ours[seed] - theirs[seed]) for seed in sorted(ours.keys() & theirs.keys())}
    return {seed: gain for seed, gain in gains.items() if math.isfinite(gain)}
