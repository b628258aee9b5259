"""The read-out of study v6's exploratory pilot (docs/study-v6-pilot-plan.md): where CE's error stops improving, and
the seed-to-seed sd of each planned effect there.

    python docs/study-v6-pilot/study_v6_pilot.py [--archive docs/study-v6-pilot]

Reads the archived runs of the pilot's commands (`<length>-<tokenizer>/runs/<run>/`: 1x and 2x, 3digit and 1digit,
then 4x where CE still improved from 1x to 2x) and prints Markdown, descriptive only:
- per tokenizer × noise × length: the mean log-error (`eval/regression_interpolation/log_mae`, all 1,000 held-out
  questions) of CE and of CE + NTL-WAS on the answers, the per-seed gain (CE minus NTL, + is better), its mean and sd;
- CE's change at each doubling of the length, against the plan's 0.025: "plateau" when it improves by less;
- the per-seed effects the main study's hypotheses would measure at each length, with their sd (the tokenizer
  difference is the 1–3-digit gain minus the single-digit gain of the same seed and noise);
- the gain along training (the trainer's evaluation of the first 200 questions every 100 steps) at matched examples.
Runs not archived yet are left out and counted.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this script lives in docs/<study>/
METRIC = "eval/regression_interpolation/log_mae"
PLATEAU_MARGIN = 0.025
LENGTHS = ("1x", "2x", "4x")
TOKENIZERS = ("3digit", "1digit")
NOISES = ("noisy", "exact")
STEPS_PER_EXAMPLE = {"3digit": 1.0, "1digit": 1.616}  # docs/study-v6-pilot-plan.md, "Lengths"


def condition(variant: str) -> tuple[str, str, str]:
    """(tokenizer, noise, arm) of a pilot variant such as `regression-exact-1digit/ntl-was-answer`."""
    folder, arm = variant.split("/")
    return ("1digit" if folder.endswith("1digit") else "3digit", "exact" if "exact" in folder else "noisy",
            "ntl" if arm.startswith("ntl") else "ce")  # fmt: skip


def read_runs(archive: Path) -> tuple[dict, dict, int]:
    """({(tokenizer, noise, arm, length): {seed: log-error}}, {same key: {seed: {step: log-error}}}, runs found)."""
    final, curves, found = defaultdict(dict), defaultdict(dict), 0
    for run in sorted(archive.glob("*/runs/*")):
        if not (run / "study.json").is_file():
            continue
        found += 1
        timing = json.loads((run / "study.json").read_text())
        length = run.parent.parent.name.split("-")[0]
        key = (*condition(timing["variant"]), length)
        final[key][timing["seed"]] = json.loads((run / "eval.json").read_text())[METRIC]
        curves[key][timing["seed"]] = training_curve(run / "metrics.jsonl.gz")
    return final, curves, found


def training_curve(path: Path) -> dict[int, float]:
    """{step: log-error on the first 200 held-out questions} from the trainer's evaluations (the first record of a
    step: the study's final evaluation of all 1,000 questions comes after the trainer's at the last step)."""
    curve = {}
    for line in gzip.decompress(path.read_bytes()).decode().splitlines():
        record = json.loads(line)
        if record.get("split") == "eval" and isinstance(record.get(METRIC), float) and "step" in record:
            curve.setdefault(record["step"], record[METRIC])
    return curve


def gains(final: dict, tokenizer: str, noise: str, length: str) -> dict[int, float]:
    ce, ntl = final.get((tokenizer, noise, "ce", length), {}), final.get((tokenizer, noise, "ntl", length), {})
    return {seed: ce[seed] - ntl[seed] for seed in sorted(ce) if seed in ntl}


def describe(values: list[float]) -> str:
    if not values:
        return "–"
    sd = f", sd {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):+.3f}{sd} ({', '.join(f'{v:+.3f}' for v in values)})"


def mean(values) -> str:
    values = list(values)
    return f"{statistics.fmean(values):.3f}" if values else "–"


def final_table(final: dict) -> list[str]:
    lines = ["| tokenizer | noise | length | CE log-error | NTL log-error | gain per seed: mean, sd (seeds) |",
             "|---|---|---|---:|---:|---|"]  # fmt: skip
    for tokenizer in TOKENIZERS:
        for noise in NOISES:
            for length in LENGTHS:
                ce = final.get((tokenizer, noise, "ce", length), {}).values()
                ntl = final.get((tokenizer, noise, "ntl", length), {}).values()
                row = [
                    tokenizer,
                    noise,
                    length,
                    mean(ce),
                    mean(ntl),
                    describe(list(gains(final, tokenizer, noise, length).values())),
                ]
                lines.append("| " + " | ".join(row) + " |")
    return lines


def plateau_lines(final: dict) -> list[str]:
    lines = []
    for tokenizer in TOKENIZERS:
        for noise in NOISES:
            for shorter, longer in itertools.pairwise(LENGTHS):
                short, long = (final.get((tokenizer, noise, "ce", length), {}) for length in (shorter, longer))
                change = [long[seed] - short[seed] for seed in sorted(short) if seed in long]
                if not change:
                    continue
                verdict = "plateau" if statistics.fmean(change) > -PLATEAU_MARGIN else "still improving"
                lines.append(f"- {tokenizer}, {noise}: CE {longer} minus {shorter} {describe(change)}: {verdict} at "
                             f"{shorter}.")  # fmt: skip
    return lines


def effect_lines(final: dict) -> list[str]:
    lines = []
    for length in LENGTHS:
        for noise in NOISES:
            chunked, single = (gains(final, tokenizer, noise, length) for tokenizer in TOKENIZERS)
            difference = [chunked[seed] - single[seed] for seed in chunked if seed in single]
            lines.append(f"- {length}, {noise}: 1–3-digit gain minus single-digit gain {describe(difference)}.")
        for tokenizer in TOKENIZERS:
            noisy, exact = (gains(final, tokenizer, noise, length) for noise in NOISES)
            difference = [noisy[seed] - exact[seed] for seed in noisy if seed in exact]
            lines.append(f"- {length}, {tokenizer}: gain with noise minus gain without {describe(difference)}.")
    return lines


def curve_lines(curves: dict) -> list[str]:
    """The mean gain along training of the longest runs of each tokenizer and noise, at matched examples (steps of
    the 1–3-digit runs; single-digit steps × 1.616, read at the nearest evaluation, every 100 steps)."""
    lines = []
    for tokenizer in TOKENIZERS:
        for noise in NOISES:
            for length in reversed(LENGTHS):
                ce, ntl = (curves.get((tokenizer, noise, arm, length), {}) for arm in ("ce", "ntl"))
                seeds = [seed for seed in ce if seed in ntl]
                if seeds:
                    lines.append(f"- {tokenizer}, {noise} ({length} runs, {len(seeds)} seeds): "
                                 + ", ".join(gain_cells(ce, ntl, seeds, tokenizer, length)))  # fmt: skip
                    break
    return lines


def gain_cells(ce: dict, ntl: dict, seeds: list[int], tokenizer: str, length: str) -> list[str]:
    last = 1000 * int(length.rstrip("x"))  # in 1–3-digit steps
    cells = []
    for step in range(last // 10, last + 1, last // 10):
        at = round(step * STEPS_PER_EXAMPLE[tokenizer] / 100) * 100
        pairs = [(ce[s][at], ntl[s][at]) for s in seeds if at in ce[s] and at in ntl[s]]
        if pairs:
            cells.append(f"{step}: {statistics.fmean(c - n for c, n in pairs):+.2f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archive", type=Path, default=ROOT / "docs" / "study-v6-pilot")
    args = parser.parse_args()
    final, curves, found = read_runs(args.archive)
    print(f"{found} pilot runs archived (the plan's 32, then the 4x runs).\n")
    print("\n".join(["## Log-error at the end of training", "", *final_table(final), "",
                     f"## Does CE improve when the length doubles (plateau: by less than {PLATEAU_MARGIN})?", "",
                     *plateau_lines(final), "", "## The main study's effects per seed", "", *effect_lines(final), "",
                     "## NTL's gain along training (the longest runs; 1–3-digit steps, matched examples)", "",
                     *curve_lines(curves)]))  # fmt: skip


if __name__ == "__main__":
    main()
