"""The power tables of docs/study-v5-protocol.md, from study v4's exploratory regression pilot
(docs/study-v4-pilot/runs: `regression/ce` and `regression/ntl-was-answer`, seeds 16–21).

    python docs/study-v5/study_v5_power.py [--seeds 24] [--archive docs/study-v4-pilot/runs]

The primary metric is `eval/regression_interpolation/log_mae`, mean log10(1 + |error|) over the 1,000 held-out
answers, lower is better. Per hypothesis of `--decide v5` (study/decision.py, RULES["v5"]), its per-seed effect's
paired sd, planned as follows (the pilot has 6 seeds and only the 1–3-digit tokenizer):
- H1 (NTL-WAS vs CE, 1–3-digit tokens): the pilot's own pair, measured by the code the rule applies.
- H2 (the same under single digits): no pilot; planned with H1's sd.
- H3 (H1's per-seed gain minus H2's): the gains of two independently trained pairs, so √2 × H1's sd.
Every sd also at its one-sided 80% upper bound from 6 seeds (× 1.46). Normal theory with n = `--seeds`
(study/power.py), at α 0.05/3 (Holm's first step) and α 0.05 (its last): the t-test's power at several true effects
and the smallest it detects with 0.8; then each threshold m (= min_gain = margin) by study v4's rule, the smallest
multiple of 0.005 at which "no useful effect" has a chance of at least 0.5 at a true effect of 0 with the upper-bound
sd (checked against RULES["v5"]), with the chance of "helps" at true effects m and 1.5 m. Prints Markdown.
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

from ntl_pretrain.study.decision import RULES
from ntl_pretrain.study.power import sd_upper_bound
from ntl_pretrain.study.report import by_variant
from ntl_pretrain.study.runs import plan

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this script lives in docs/<study>/
PILOT_SEEDS = list(range(16, 22))
PILOT_ARMS = ("regression/ce", "regression/ntl-was-answer")
EFFECTS = (0.01, 0.02, 0.03, 0.05)
SD_FACTOR = {"H1": 1.0, "H2": 1.0, "H3": math.sqrt(2.0)}  # module docstring


def pilot_results(archive: Path) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as nowhere:  # every run is archived: no run folder is read or written
        runs = plan(ROOT / "recipes" / "study", list(PILOT_ARMS), PILOT_SEEDS, Path(nowhere), archive)
        missing = [run.name for run in runs if not run.archived]
        if missing:
            raise SystemExit(f"{archive}: not archived: {', '.join(missing)}")
        return by_variant(runs, [run.measured() for run in runs])


def tables(grouped: dict[str, list[dict]], n: int) -> list[str]:
    h1 = RULES["v5"].hypotheses[0]
    effects = h1.effect.per_seed(grouped[PILOT_ARMS[1]], grouped[PILOT_ARMS[0]])
    measured_sd = statistics.stdev(effects)
    notes = [f"Measured on the pilot, `{PILOT_ARMS[1]}` − `{PILOT_ARMS[0]}` on {h1.effect.describe()}: mean gain "
             f"{statistics.fmean(effects):+.3f}, paired sd {measured_sd:.3f} over {len(effects)} seeds "
             f"(per seed: {', '.join(f'{e:+.3f}' for e in effects)}).", ""]  # fmt: skip
    power = ["| hypothesis | sd | " + " | ".join(f"power at {effect:g}" for effect in EFFECTS)
             + " | detected with 0.8 |", "|---|---|" + "---:|" * (len(EFFECTS) + 1)]  # fmt: skip
    rule = ["| hypothesis | sd | m | P(no useful effect), effect 0 | P(helps), effect m | P(helps), effect 1.5 m |",
            "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for h in RULES["v5"].hypotheses:
        sd = SD_FACTOR[h.name] * measured_sd
        chosen = rule_margin(sd, len(effects), n)
        notes.append(f"- {h.name}: planning sd {sd:.3f}; m by the protocol's rule {chosen:g}, in RULES['v5'] "
                     f"{h.no_effect_margin:g} (min_gain {h.min_gain:g}).")  # fmt: skip
        for label, planned in (("planned", sd), ("80% upper", sd_upper_bound(sd, len(effects)))):
            power.append(power_row(h, planned, label, n, EFFECTS))
            rule.append(rule_row(h, planned, label, n))
    header = f"n = {n} seeds; two figures in a cell: at α 0.05/3 / at α 0.05."
    return [header, "", *notes, "", *power, "", *rule]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24, help="seeds per arm in the planned study")
    parser.add_argument("--archive", type=Path, default=ROOT / "docs" / "study-v4-pilot" / "runs")
    args = parser.parse_args()
    print("\n".join(tables(pilot_results(args.archive), args.seeds)))


if __name__ == "__main__":
    main()
