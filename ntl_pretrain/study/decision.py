"""A study's decision rule, fixed before the runs and applied by code: for each pre-registered hypothesis, does the
variant help, hurt, or neither?

A hypothesis compares a variant with a baseline, paired by seed, on one effect per seed (`Effect`): the gain in one
metric (variant − baseline, or baseline − variant for a lower-is-better metric, so + is better), or the gain in one
metric minus the gain in another (study v4's H1: the gain on answers that are 2-digit tokens minus the gain on those
that are 3-digit tokens). Per hypothesis, a two-sided paired t-test and the sign-flip permutation test, their p
each corrected over the rule's hypotheses (Holm or Bonferroni) at α. In order:
1. inconclusive when the t-test and the permutation test disagree on significance (corrected p < α);
2. helps: significant, mean effect >= min_gain, and (where the hypothesis has a guard) the 95% CI of the guard's
   effect (exact match, variant − CE) has its lower bound above guard_ci_floor;
3. hurts: significant, mean effect <= −min_gain;
4. no useful effect: the 90% CI of the mean effect lies within ±no_effect_margin;
5. otherwise inconclusive, with the CI.

RULES: `v3` (docs/study-v3-protocol.md: log-error, `3digit/ntl-was` and `3digit/ntl-was-answer` against
`3digit/ce`, with an exact-match guard), `v3-gpu` (its GPU arm: exact match, Bonferroni), `v4`
(docs/study-v4-protocol.md: three hypotheses, each on its own exact-match effect), `v5`
(docs/study-v5-protocol.md: log-error under two tokenizers, and the difference of the two gains, `against`), `v6`
(docs/study-v6-protocol.md: log-error at the end of a longer training under two tokenizers with and without label
noise, and the differences between the tokenizers and between the noise levels) and `v7` (docs/study-v7-protocol.md:
v6's four gains where each training question is seen about once or twice, with each run's best validation step read
too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ntl_pretrain.study.stats import PairedStats, bonferroni, holm, paired_gains_by_seed, paired_stats

HELPS, HURTS, NO_EFFECT, INCONCLUSIVE = "helps", "hurts", "no useful effect", "inconclusive"


@dataclass(frozen=True)
class Effect:
    """What a hypothesis measures on each seed, signed so that + is better."""

    metric: str
    higher_is_better: bool = True
    minus: str | None = None
    """When set, the effect is the gain in `metric` minus the gain in `minus` (both signed alike): whether the
    variant gains more on one part of the answers than on another."""

    def per_seed(self, results: list[dict], baseline: list[dict]) -> list[float]:
        """The effect on each seed where both lists measured every metric it needs, in seed order."""
        return list(self.by_seed(results, baseline).values())

    def by_seed(self, results: list[dict], baseline: list[dict]) -> dict[int, float]:
        """{seed: effect} over the seeds where both lists measured every metric it needs, in seed order."""
        gains = paired_gains_by_seed(results, baseline, self.metric, self.higher_is_better)
        if self.minus is None:
            return gains
        other = paired_gains_by_seed(results, baseline, self.minus, self.higher_is_better)
        return {seed: gain - other[seed] for seed, gain in gains.items() if seed in other}

    def describe(self) -> str:
        if self.minus is None:
            return f"`{self.metric}`"
        return f"the gain in `{self.metric}` minus the gain in `{self.minus}`"


@dataclass(frozen=True)
class Hypothesis:
    variant: str
    baseline: str
    effect: Effect
    min_gain: float
    """Smallest mean effect that counts as helping (or, negated, hurting)."""
    no_effect_margin: float
    """"No useful effect": the 90% CI of the mean effect lies within ±this."""
    guard: Effect | None = None
    guard_ci_floor: float = -0.03
    """"Helps" also needs the 95% CI of the guard's effect (when there is a guard) to lie above this."""
    name: str = ""
    """How the protocol calls it (`H1`); the report names it so."""
    meaning: str = ""
    """What a positive effect says, in words, for the report."""
    against: tuple[str, str] | None = None
    """(variant, baseline) of a second pair: when set, the effect per seed is the effect on this hypothesis's pair
    minus the same effect on that pair (study v5's H3: NTL's gain under one tokenizer minus its gain under another)."""

    def terms(self) -> tuple:
        """Everything but the pair it compares: hypotheses with equal terms share one line of the report."""
        return self.effect, self.min_gain, self.no_effect_margin, self.guard, self.guard_ci_floor, self.against

    def per_seed(self, grouped: dict[str, list[dict]]) -> list[float]:
        """The effect on each seed, in seed order, from each variant's results (one per seed, with `seed`)."""
        effects = self.effect.by_seed(grouped[self.variant], grouped[self.baseline])
        if self.against is None:
            return list(effects.values())
        other = self.effect.by_seed(grouped[self.against[0]], grouped[self.against[1]])
        return [effect - other[seed] for seed, effect in effects.items() if seed in other]

    def compared(self) -> str:
        """The comparison in words: `variant` vs `baseline`, minus the second pair's where there is one."""
        pair = f"`{self.variant}` vs `{self.baseline}`"
        return pair if self.against is None else f"{pair} minus `{self.against[0]}` vs `{self.against[1]}`"


@dataclass(frozen=True)
class DecisionRule:
    hypotheses: tuple[Hypothesis, ...]
    """The family that the correction spans."""
    correction: Literal["holm", "bonferroni"] = "holm"
    alpha: float = 0.05
    early_stopping: str | None = None
    """The trainer's validation metric whose lowest value marks each run's best step, where the report reads the
    hypotheses again (study/regime.py, secondary, no verdict); None: no such read-out."""

    def variants(self) -> set[str]:
        return {name for h in self.hypotheses for name in (h.variant, h.baseline, *(h.against or ()))}


def same_effect_rule(
    comparisons: tuple[tuple[str, str], ...],
    effect: Effect,
    min_gain: float,
    no_effect_margin: float,
    guard: Effect | None = None,
    guard_ci_floor: float = -0.03,
    correction: Literal["holm", "bonferroni"] = "holm",
) -> DecisionRule:
    """Every (variant, baseline) pair judged on the same effect with the same thresholds (studies v3 and v3-gpu)."""
    hypotheses = tuple(Hypothesis(variant, baseline, effect, min_gain, no_effect_margin, guard, guard_ci_floor)
                       for variant, baseline in comparisons)  # fmt: skip
    return DecisionRule(hypotheses, correction)


@dataclass(frozen=True)
class Verdict:
    hypothesis: Hypothesis
    outcome: str
    primary: PairedStats
    p_t_corrected: float
    p_permutation_corrected: float
    guard: PairedStats
    reason: str

    @property
    def variant(self) -> str:
        return self.hypothesis.variant

    @property
    def baseline(self) -> str:
        return self.hypothesis.baseline


def decide(rule: DecisionRule, grouped: dict[str, list[dict]]) -> list[Verdict]:
    """One verdict per hypothesis of `rule`, from each variant's evaluation results (one per seed, with `seed`)."""
    primaries, guards = [], []
    for h in rule.hypotheses:
        results, baseline = grouped[h.variant], grouped[h.baseline]
        primaries.append(paired_stats(h.per_seed(grouped)))
        guards.append(paired_stats([] if h.guard is None else h.guard.per_seed(results, baseline)))
    correct = holm if rule.correction == "holm" else bonferroni
    corrected_t = correct([stats.p_t for stats in primaries])
    corrected_permutation = correct([stats.p_permutation for stats in primaries])
    verdicts = []
    for h, primary, p_t, p_permutation, guard in zip(rule.hypotheses, primaries, corrected_t, corrected_permutation,
                                                     guards, strict=True):  # fmt: skip
        outcome, reason = _outcome(h, rule.alpha, primary, p_t, p_permutation, guard)
        verdicts.append(Verdict(h, outcome, primary, p_t, p_permutation, guard, reason))
    return verdicts


def _outcome(
    h: Hypothesis, alpha: float, primary: PairedStats, p_t: float, p_permutation: float, guard: PairedStats
) -> tuple[str, str]:
    """(outcome, why) by the steps of the module docstring, from corrected p values."""
    t_significant, permutation_significant = p_t < alpha, p_permutation < alpha
    if t_significant != permutation_significant:
        return INCONCLUSIVE, f"the t-test and the permutation test disagree on significance at α {alpha:g}"
    if t_significant and primary.mean >= h.min_gain:
        if h.guard is None or guard.ci95[0] > h.guard_ci_floor:
            guarded = "" if h.guard is None else f", guard CI above {_signed(h.guard_ci_floor)}"
            return HELPS, f"significant, mean gain >= {h.min_gain:g}{guarded}"
        floor = _signed(h.guard_ci_floor)
        return INCONCLUSIVE, f"the guard's 95% CI reaches {_signed(guard.ci95[0])}, not above {floor}"
    if t_significant and primary.mean <= -h.min_gain:
        return HURTS, f"significant, mean loss >= {h.min_gain:g}"
    low, high = primary.ci90
    if -h.no_effect_margin <= low and high <= h.no_effect_margin:
        return NO_EFFECT, f"the 90% CI lies within ±{h.no_effect_margin:g}"
    return INCONCLUSIVE, f"90% CI [{_signed(low)}, {_signed(high)}] is not within ±{h.no_effect_margin:g}" + (
        "" if t_significant else f" and the difference is not significant at α {alpha:g}"
    )


def _signed(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.3f}".replace("-", "−")


def verdict_lines(rule: DecisionRule, verdicts: list[Verdict]) -> list[str]:
    """The report's section: the rule's terms, then one line per hypothesis. A rule whose hypotheses share their
    terms (v3's) states them once."""
    shared = len({h.terms() for h in rule.hypotheses}) == 1
    lines = _shared_terms(rule) if shared else _family_terms(rule)
    bullets = [_shared_bullet(v) if shared else _hypothesis_bullet(v) for v in verdicts]
    return ["## Decision (computed by the protocol's rule)", "", *lines, "", *bullets, ""]


def _correction_words(rule: DecisionRule, over: str) -> str:
    return (f"paired two-sided t-test and sign-flip permutation test, each {rule.correction.capitalize()}-corrected "
            f"over the {over} ({len(rule.hypotheses)}) at α {rule.alpha:g}")  # fmt: skip


def _shared_terms(rule: DecisionRule) -> list[str]:
    h = rule.hypotheses[0]
    guard = f" and the 95% CI of the `{h.guard.metric}` gain above {_signed(h.guard_ci_floor)}" if h.guard else ""
    return [f"Primary: {h.effect.describe()}, gain signed so + is better; {_correction_words(rule, 'comparisons')}. "
            f"Helps: both significant, mean gain >= {h.min_gain:g}{guard}; hurts: both significant, mean loss >= "
            f"{h.min_gain:g}; no useful effect: 90% CI within ±{h.no_effect_margin:g}; otherwise "
            "inconclusive."]  # fmt: skip


def _family_terms(rule: DecisionRule) -> list[str]:
    return [f"Each hypothesis on its own effect per seed, signed so + is better, and its own thresholds; "
            f"{_correction_words(rule, 'hypotheses')}. Helps: both significant, mean effect >= its minimum (and its "
            "guard, where it has one); hurts: both significant, mean effect <= −its minimum; no useful effect: 90% "
            "CI within ±its margin; otherwise inconclusive, also when the two tests disagree on "
            "significance."]  # fmt: skip


def _numbers(v: Verdict) -> str:
    stats = v.primary
    return (f"95% CI [{_signed(stats.ci95[0])}, {_signed(stats.ci95[1])}], 90% CI [{_signed(stats.ci90[0])}, "
            f"{_signed(stats.ci90[1])}], corrected p(t) {v.p_t_corrected:.3g}, p(perm) "
            f"{v.p_permutation_corrected:.3g}, n {stats.n}")  # fmt: skip


def _guard_numbers(v: Verdict) -> str:
    low, high = (_signed(bound) for bound in v.guard.ci95)
    return f"; guard gain 95% CI [{low}, {high}]" if v.hypothesis.guard else ""


def _shared_bullet(v: Verdict) -> str:
    return (f"- `{v.variant}` vs `{v.baseline}`: **{v.outcome}** ({v.reason}). Mean gain {_signed(v.primary.mean)}, "
            f"{_numbers(v)}{_guard_numbers(v)}.")  # fmt: skip


def _hypothesis_bullet(v: Verdict) -> str:
    h = v.hypothesis
    meaning = f" (+: {h.meaning})" if h.meaning else ""
    return (f"- {h.name or 'Hypothesis'}, {h.compared()} on {h.effect.describe()}{meaning}; minimum "
            f"{h.min_gain:g}, margin ±{h.no_effect_margin:g}: **{v.outcome}** ({v.reason}). Mean "
            f"{_signed(v.primary.mean)}, {_numbers(v)}{_guard_numbers(v)}.")  # fmt: skip


INTERPOLATION = "eval/addition_interpolation"
EXACT = f"{INTERPOLATION}/exact_match"
EXACT_2DIGIT, EXACT_3DIGIT = f"{EXACT}_2digit_token", f"{EXACT}_3digit_token"  # study/token_classes.py
# Study v4's thresholds (min_gain = margin): the smallest margin, in steps of 0.005, at which "no useful effect" has
# a chance of at least 0.5 at a true effect of 0 with the sd at the 80% upper bound of v3's
# (docs/study-v4/study_v4_power.py, docs/study-v4-protocol.md).
V4 = DecisionRule(
    hypotheses=(
        Hypothesis("3digit/ntl-was-answer", "3digit/ce", Effect(EXACT_2DIGIT, minus=EXACT_3DIGIT),
                   min_gain=0.11, no_effect_margin=0.11, name="H1",
                   meaning="CE + NTL-WAS gains more over CE on 2-digit-token answers than on 3-digit-token ones"),
        Hypothesis("3digit/ntl-digits-answer", "3digit/ce", Effect(EXACT), min_gain=0.065, no_effect_margin=0.065,
                   name="H2", meaning="CE + NTL-digits gets more sums exactly right than CE"),
        Hypothesis("3digit/ntl-digits-answer", "3digit/ntl-was-answer", Effect(EXACT_3DIGIT), min_gain=0.075,
                   no_effect_margin=0.075, name="H3",
                   meaning="CE + NTL-digits gets more 3-digit-token sums exactly right than CE + NTL-WAS"),
    ),
)  # fmt: skip

REGRESSION = "eval/regression_interpolation"
LOG_ERROR = Effect(f"{REGRESSION}/log_mae", higher_is_better=False)
NO_MORE_UNPARSEABLE = Effect(f"{REGRESSION}/unparseable", higher_is_better=False)
# Study v5's thresholds (min_gain = margin), by study v4's rule from the regression pilot's paired sd at its 80% upper
# bound (docs/study-v5/study_v5_power.py, docs/study-v5-protocol.md). "Helps" on H1 and H2 also needs the 95% CI of the
# change in answers without a number above −0.01: log-error is over the answers that contain one.
V5 = DecisionRule(
    hypotheses=(
        Hypothesis("regression/ntl-was-answer", "regression/ce", LOG_ERROR, min_gain=0.025, no_effect_margin=0.025,
                   guard=NO_MORE_UNPARSEABLE, guard_ci_floor=-0.01, name="H1",
                   meaning="CE + NTL-WAS on the answers makes smaller errors than CE under 1–3-digit number tokens"),
        Hypothesis("regression-1digit/ntl-was-answer", "regression-1digit/ce", LOG_ERROR, min_gain=0.025,
                   no_effect_margin=0.025, guard=NO_MORE_UNPARSEABLE, guard_ci_floor=-0.01, name="H2",
                   meaning="CE + NTL-WAS on the answers makes smaller errors than CE under single-digit tokens"),
        Hypothesis("regression/ntl-was-answer", "regression/ce", LOG_ERROR, min_gain=0.035, no_effect_margin=0.035,
                   against=("regression-1digit/ntl-was-answer", "regression-1digit/ce"), name="H3",
                   meaning="NTL-WAS cuts the error more under 1–3-digit tokens than under single digits"),
    ),
)  # fmt: skip


def _v6_gain(name: str, folder: str, m: float, meaning: str) -> Hypothesis:
    """NTL-WAS on the answers against CE in one of study v6's recipe folders (one tokenizer, one noise level)."""
    return Hypothesis(f"{folder}/ntl-was-answer", f"{folder}/ce", LOG_ERROR, min_gain=m, no_effect_margin=m,
                      guard=NO_MORE_UNPARSEABLE, guard_ci_floor=-0.01, name=name, meaning=meaning)  # fmt: skip


def _v6_difference(name: str, folder: str, other: str, m: float, meaning: str) -> Hypothesis:
    """The gain in one folder minus the gain in another, seed by seed."""
    return Hypothesis(f"{folder}/ntl-was-answer", f"{folder}/ce", LOG_ERROR, min_gain=m, no_effect_margin=m,
                      against=(f"{other}/ntl-was-answer", f"{other}/ce"), name=name, meaning=meaning)  # fmt: skip


# Study v6's thresholds (min_gain = margin), by study v4's rule from the pilot's pooled sd of a gain at its 80% upper
# bound at the main length (docs/study-v6/study_v6_power.py, docs/study-v6-protocol.md); variants of recipes/study/v6.
V6_GAIN_M, V6_DIFFERENCE_M = 0.08, 0.115
V6 = DecisionRule(
    hypotheses=(
        _v6_gain("H1", "regression", V6_GAIN_M,
                 "at the end of training, CE + NTL-WAS makes smaller errors than CE under 1–3-digit tokens (noisy)"),
        _v6_gain("H2", "regression-1digit", V6_GAIN_M,
                 "at the end of training, CE + NTL-WAS makes smaller errors than CE under single digits (noisy)"),
        _v6_gain("H3", "regression-exact", V6_GAIN_M,
                 "CE + NTL-WAS makes smaller errors than CE under 1–3-digit tokens without label noise"),
        _v6_gain("H4", "regression-exact-1digit", V6_GAIN_M,
                 "CE + NTL-WAS makes smaller errors than CE under single digits without label noise"),
        _v6_difference("H5", "regression", "regression-1digit", V6_DIFFERENCE_M,
                       "at equal examples, NTL-WAS cuts the error more under 1–3-digit tokens than under 1-digit ones"),
        _v6_difference("H6", "regression", "regression-exact", V6_DIFFERENCE_M,
                       "under 1–3-digit tokens, NTL-WAS cuts the error more with noisy training answers than without"),
    ),
)  # fmt: skip

# Study v7 (docs/study-v7-protocol.md): v6's four gains, H1–H4 as v6 names them, asked again where each training
# question is seen about 1.8 times (recipes/study/v7); m by study v4's rule at the larger 80% upper bound of the pilot's
# and v6's sd of a gain (docs/study-v7/study_v7_power.py); each run also read at its best validation answer-CE
# (study/regime.py, secondary).
V7_M = 0.055
V7 = DecisionRule(
    hypotheses=(
        _v6_gain("H1", "regression", V7_M,
                 "with data seen about once, CE + NTL-WAS makes smaller errors than CE under 1–3-digit tokens (noisy)"),
        _v6_gain("H2", "regression-1digit", V7_M,
                 "with data seen about once, CE + NTL-WAS makes smaller errors than CE under single digits (noisy)"),
        _v6_gain("H3", "regression-exact", V7_M,
                 "with data seen about once, CE + NTL-WAS makes smaller errors than CE under 1–3-digit tokens without "
                 "label noise"),
        _v6_gain("H4", "regression-exact-1digit", V7_M,
                 "with data seen about once, CE + NTL-WAS makes smaller errors than CE under single digits without "
                 "label noise"),
    ),
    early_stopping="val_answer_ce",
)  # fmt: skip

# The protocol's rules by name (`ntl-pretrain study --decide NAME`).
RULES = {
    "v3": same_effect_rule(
        comparisons=(("3digit/ntl-was", "3digit/ce"), ("3digit/ntl-was-answer", "3digit/ce")),
        effect=Effect(f"{INTERPOLATION}/log_mae", higher_is_better=False),
        min_gain=0.02,
        no_effect_margin=0.02,
        guard=Effect(EXACT),
        guard_ci_floor=-0.03,
    ),
    "v3-gpu": same_effect_rule(
        comparisons=(("ntl-was-lambda0.1", "ce"), ("ntl-was-lambda1", "ce"), ("ntl-was-answer", "ce")),
        effect=Effect(EXACT),
        min_gain=0.05,
        no_effect_margin=0.05,
        correction="bonferroni",
    ),
    "v4": V4,
    "v5": V5,
    "v6": V6,
    "v7": V7,
}
