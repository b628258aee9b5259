"""The power tables, thresholds and compute of docs/study-v7-protocol.md, from study v7's exploratory pilot
(docs/study-v7-pilot/, seeds 200 and 201) and study v6's 96 runs.

    python docs/study-v7/study_v7_power.py [--seeds 12]

The primary metric is `eval/regression_interpolation/log_mae`, mean log10(1 + |error|) over the 1,000 held-out
answers, lower is better; each hypothesis (H1–H4, v6's names: NTL-WAS on the answers against CE under one tokenizer
and noise level) is measured per seed by the code `--decide` applies (`Hypothesis.per_seed`). Two sds of a gain:
- the pilot's: pooled within condition over the conditions it ran on both seeds (the 1–3-digit ones), 1 degree of
  freedom each;
- v6's: pooled over its four conditions' 12 seeds (44 degrees of freedom), the same effects in the memorising regime.
Each at its one-sided 80% upper bound; the plan takes the larger, and m (= min_gain = margin) is study v4's rule at
it: the smallest multiple of 0.005 at which "no useful effect" has a chance of at least 0.5 at a true effect of 0
(checked against RULES["v7"] once it exists). Normal theory with n = `--seeds` (study/power.py) at α 0.05/4 (Holm's
first step over four hypotheses) and α 0.05 (its last). Then the compute, by the pilot plan's rule (dated addition
of 2026-12-02 14:05): v6's idle seconds a step, beside the pilot's own with the machine's load. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "study-v4"))  # study v4's power rule, reused
from study_v4_power import power_row, rule_margin, rule_row  # noqa: E402

from ntl_pretrain.study.decision import LOG_ERROR, RULES, Hypothesis
from ntl_pretrain.study.power import sd_upper_bound
from ntl_pretrain.study.report import by_variant
from ntl_pretrain.study.runs import plan

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this script lives in docs/<study>/
PILOT_SEEDS = [200, 201]
V6_SEEDS = list(range(64, 76))
ALPHAS = (0.05 / 4, 0.05)
EFFECTS = (0.02, 0.05, 0.10, 0.15)
FOLDERS = {"H1": "regression", "H2": "regression-1digit", "H3": "regression-exact", "H4": "regression-exact-1digit"}
# The pilot plan's dated addition of 2026-12-02 14:05: v6's idle seconds a step at two jobs, 12 s of evaluation a run,
# at most 10.5 h of wall-clock at two jobs.
STEP_S = {"3digit": 0.390, "1digit": 0.235}
EVAL_S = 12.0
STEPS = {"3digit": 2000, "1digit": 3232}
BUDGET_S = 10.5 * 3600 * 2
ARM_GROUPS = (  # the pilot plan's order: always, then while the whole study fits
    ("the four 1–3-digit CE and NTL-WAS arms", "3digit", 4),
    ("the two single-digit pairs", "1digit", 4),
    ("the two number-level arms", "3digit", 2),
)


def hypothesis(name: str) -> Hypothesis:
    """A planned comparison, thresholds left at 0: they are what this script chooses."""
    folder = FOLDERS[name]
    return Hypothesis(f"{folder}/ntl-was-answer", f"{folder}/ce", LOG_ERROR, 0.0, 0.0, name=name)


def effects(recipes: Path, seeds: list[int], archive: Path) -> dict[str, list[float]]:
    """{hypothesis: per-seed effects} for every hypothesis whose two variants are archived on every seed."""
    found = {}
    with tempfile.TemporaryDirectory() as nowhere:
        for name, folder in FOLDERS.items():
            runs = plan(recipes, [f"{folder}/ce", f"{folder}/ntl-was-answer"], seeds, Path(nowhere), archive)
            if all(run.archived for run in runs):
                found[name] = hypothesis(name).per_seed(by_variant(runs, [run.measured() for run in runs]))
    return found


def pooled_sd(gains: list[list[float]]) -> tuple[float, int]:
    """(the pooled within-condition sd, its degrees of freedom) of per-seed gains measured in several conditions."""
    df = sum(len(values) - 1 for values in gains)
    return math.sqrt(sum((len(values) - 1) * statistics.variance(values) for values in gains) / df), df


def pilot_seconds(archive: Path) -> list[str]:
    """Each archived pilot run's seconds a step, as measured on the loaded machine."""
    lines = []
    for done in sorted(archive.glob("*/runs/*/study.json")):
        timing = json.loads(done.read_text())
        steps = yaml.safe_load((done.parent / "recipe.yaml").read_text())["train"]["max_steps"]
        lines.append(f"{done.parent.name}: {timing['train_s'] / steps:.3f} s a step")
    return lines


def compute_lines(n: int) -> list[str]:
    lines, total = [], 0.0
    for what, tokenizer, arms in ARM_GROUPS:
        cost = arms * (STEPS[tokenizer] * STEP_S[tokenizer] + EVAL_S) * n / 2
        verdict = "in" if total + cost <= BUDGET_S / 2 else "out"
        total += cost if verdict == "in" else 0.0
        lines.append(f"- {what}: {cost / 3600:.2f} h of wall-clock at two jobs for {n} seeds: **{verdict}** "
                     f"({total / 3600:.2f} h so far of {BUDGET_S / 7200:.1f} h).")  # fmt: skip
    return lines


def effect_lines(found: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = []
    for name in FOLDERS:
        for label, effects_of in found.items():
            if name in effects_of:
                values = effects_of[name]
                lines.append(f"- {name} ({FOLDERS[name]}), {label}: per seed {', '.join(f'{v:+.3f}' for v in values)}"
                             f" (mean {statistics.fmean(values):+.3f}, sd {statistics.stdev(values):.3f})")  # fmt: skip
    return lines


def table_lines(sds: dict[str, tuple[float, int]], upper: dict[str, float], m: float, n: int) -> list[str]:
    """The power of H1–H4 at each sd, and the chances of the verdicts at m: all four share sd and m."""
    h = Hypothesis("ntl", "ce", LOG_ERROR, m, m, name="H1–H4")
    rows = [(sd, label) for label, (sd, _) in sds.items()] + [(upper[label], f"{label}, 80% upper") for label in sds]
    return [
        "| hypothesis | sd | " + " | ".join(f"power at {e:g}" for e in EFFECTS) + " | detected with 0.8 |",
        "|---|---|" + "---:|" * (len(EFFECTS) + 1),
        *(power_row(h, sd, label, n, EFFECTS, alphas=ALPHAS) for sd, label in rows),
        "",
        "| hypothesis | sd | m | P(no useful effect), effect 0 | P(helps), effect m | P(helps), effect 1.5 m |",
        "|---|---|---:|---:|---:|---:|",
        *(rule_row(h, upper[label], f"{label}, 80% upper", n, alphas=ALPHAS) for label in sds),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=12, help="seeds per arm in the planned study")
    n = parser.parse_args().seeds
    docs, recipes = ROOT / "docs", ROOT / "recipes" / "study"
    found = {"pilot": effects(recipes / "v7", PILOT_SEEDS, docs / "study-v7-pilot" / "3digit" / "runs"),
             "v6": effects(recipes / "v6", V6_SEEDS, docs / "study-v6" / "runs")}  # fmt: skip
    if not found["pilot"]:
        raise SystemExit("no pilot condition is archived on both seeds yet")
    sds = {label: pooled_sd(list(effects_of.values())) for label, effects_of in found.items()}
    upper = {label: sd_upper_bound(sd, df + 1) for label, (sd, df) in sds.items()}
    chosen = max(upper, key=upper.get)
    m = rule_margin(sds[chosen][0], sds[chosen][1] + 1, n)
    defined = sorted({h.no_effect_margin for h in RULES["v7"].hypotheses}) if "v7" in RULES else None
    print("\n".join([
        f"n = {n} seeds; two figures in a cell: at α 0.05/4 / at α 0.05.",
        "",
        *effect_lines(found),
        "",
        *(f"- sd of a gain, {label}: {sd:.3f} on {df} degrees of freedom, 80% upper bound {upper[label]:.3f}"
          for label, (sd, df) in sds.items()),
        f"- planning sd: {chosen}'s at its upper bound ({upper[chosen]:.3f}); m by the rule: {m:g}"
        + ("" if defined is None else f"; in RULES['v7']: {defined}"),
        "",
        *table_lines(sds, upper, m, n),
        "",
        "Compute, by the pilot plan's rule (v6's idle seconds a step at two jobs, 12 s of evaluation a run, at most "
        "10.5 h):",
        "",
        *compute_lines(n),
        "",
        "The pilot's own seconds a step (a loaded machine):",
        "",
        *(f"- {line}" for line in pilot_seconds(docs / "study-v7-pilot")),
    ]))  # fmt: skip


if __name__ == "__main__":
    main()
