"""Planning a study's seeds: what a paired two-sided t-test on n seeds can show, for a given paired sd.

Normal theory (the per-seed differences i.i.d. normal with standard deviation `sd`), as a protocol states it before
the runs: the power of the t-test at a true mean effect (the noncentral t distribution), the smallest effect it
detects with a given power, and for a decision rule (study/decision.py) the probability of its "helps" (significant
and a mean of at least min_gain) and of its "no useful effect" (the 90% CI of the mean within ±margin). The rule's
other condition, that the sign-flip permutation test agrees with the t-test, is left out: with 24 seeds the two
disagree only near the threshold. Study v3 planned with an sd guessed too small (0.025–0.033; it was 0.049–0.060), so a
protocol also states these at a pessimistic sd: `sd_upper_bound`.
"""

from __future__ import annotations

import math

from scipy import integrate, optimize
from scipy import stats as scipy_stats


def paired_t_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """P(two-sided paired t-test on n seeds rejects at `alpha`) when the differences have mean `effect`, sd `sd`."""
    df, noncentrality = n - 1, abs(effect) * math.sqrt(n) / sd
    critical = scipy_stats.t.ppf(1.0 - alpha / 2.0, df)
    same_side = float(scipy_stats.nct.sf(critical, df, noncentrality))
    opposite = float(scipy_stats.nct.cdf(-critical, df, noncentrality))
    # scipy returns NaN for the opposite tail far from the effect, where it is below 1e-25.
    return same_side + (0.0 if math.isnan(opposite) else opposite)


def detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest mean effect that the test detects with probability `power`."""
    # Grown from below rather than a fixed wide bracket: the noncentral t's tails are costly and fragile far out.
    high = sd / math.sqrt(n)
    while paired_t_power(high, sd, n, alpha) < power:
        high *= 2.0
    return float(optimize.brentq(lambda effect: paired_t_power(effect, sd, n, alpha) - power, 0.0, high))


def helps_probability(effect: float, min_gain: float, sd: float, n: int, alpha: float) -> float:
    """P(the t-test rejects at `alpha` with a positive mean of at least `min_gain`) at a true mean `effect`: the
    rule's "helps". The sample mean and sd are independent, so it is an integral over the sample variance (a scaled
    χ² with n − 1 degrees of freedom) of the normal probability that the mean clears both bars."""
    df, standard_error = n - 1, sd / math.sqrt(n)
    critical = scipy_stats.t.ppf(1.0 - alpha / 2.0, df)

    def given_chi2(q: float) -> float:
        bar = max(min_gain, critical * standard_error * math.sqrt(q / df))
        return scipy_stats.chi2.pdf(q, df) * scipy_stats.norm.sf(bar, loc=effect, scale=standard_error)

    # Below this χ² value min_gain is the higher bar, above it significance: integrated apart, the kink is exact.
    kink = df * (min_gain / (critical * standard_error)) ** 2
    return float(integrate.quad(given_chi2, 0.0, kink)[0] + integrate.quad(given_chi2, kink, math.inf)[0])


def within_margin_probability(margin: float, sd: float, n: int, effect: float = 0.0, level: float = 0.90) -> float:
    """P(the `level` CI of the mean difference lies within ±margin) at a true mean `effect`: the chance of reaching
    "no useful effect". Exact for normal differences: the sample mean and sd are independent, so it is an
    integral over the sample variance (a scaled χ² with n − 1 degrees of freedom) of the normal probability that
    the mean lies within ±(margin − the CI's half-width)."""
    df, standard_error = n - 1, sd / math.sqrt(n)
    t = scipy_stats.t.ppf(0.5 + level / 2.0, df)

    def given_chi2(q: float) -> float:
        room = margin - t * standard_error * math.sqrt(q / df)  # how far the mean may lie from 0
        mean_inside = scipy_stats.norm.cdf([-room, room], loc=effect, scale=standard_error)
        return scipy_stats.chi2.pdf(q, df) * (mean_inside[1] - mean_inside[0])

    # Beyond this χ² value the half-width alone exceeds the margin: no room is left.
    widest = df * (margin / (t * standard_error)) ** 2
    return float(integrate.quad(given_chi2, 0.0, widest, limit=200)[0]) if margin > 0 else 0.0


def sd_upper_bound(sd: float, n: int, confidence: float = 0.8) -> float:
    """One-sided `confidence` upper bound of the true sd from a sample sd of n values (χ² with n − 1 df)."""
    return sd * math.sqrt((n - 1) / scipy_stats.chi2.ppf(1.0 - confidence, n - 1))


def margin_for(probability: float, sd: float, n: int) -> float:
    """The margin at which "no useful effect" is reached with `probability` at a true effect of 0."""
    high = sd
    while within_margin_probability(high, sd, n) < probability:
        high *= 2.0
    return float(optimize.brentq(lambda margin: within_margin_probability(margin, sd, n) - probability, 0.0, high))
