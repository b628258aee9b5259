"""The study: its recipes differ only in the loss, its report states what the runs measured, and one real run
(train + eval) agrees with the trainer's own validation."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ntl_pretrain.cli import main as cli_main
from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.evaluation.answers import error_profile, error_size
from ntl_pretrain.plot import read_metrics
from ntl_pretrain.study.archive import ARCHIVED, archive_run
from ntl_pretrain.study.commands import EXIT_UNFINISHED, device_name, execute, placement, resolve_device, run_all
from ntl_pretrain.study.decision import Effect, decide, same_effect_rule
from ntl_pretrain.study.provenance import SOURCE, unclean_warning
from ntl_pretrain.study.report import (
    VALIDATION_METRICS,
    _wall_clock,
    by_variant,
    error_profile_section,
    generation_metrics,
    low_accuracy_notes,
    results_table,
    setup_lines,
    write_report,
)
from ntl_pretrain.study.runs import StudyRun, baseline_of, plan

ROOT = Path(__file__).resolve().parent.parent
STUDY_RECIPES = ROOT / "recipes" / "study"
SETS = ["addition_interpolation", "addition_extrapolation"]  # the labels of the study recipe's eval.qa_sets


def test_study_variants_differ_only_in_the_loss() -> None:
    recipes = {variant: load_recipe(STUDY_RECIPES / f"{variant}.yaml") for variant in ("ce", "ntl-was", "ntl-mse")}
    assert [(r.loss.ntl.kind, r.loss.ntl.weight) for r in recipes.values()] == [(None, 0.3), ("was", 0.3), ("mse", 0.3)]
    shared = []
    for recipe in recipes.values():
        fields = dataclasses.asdict(recipe)
        del fields["loss"]
        fields["train"].pop("output_dir")
        shared.append(fields)
    assert shared[0] == shared[1] == shared[2]
    load_run(STUDY_RECIPES / "ntl-was.yaml", [], world_size=1)  # the DeepSpeed config resolves too


def test_three_digit_variants_differ_from_single_digit_ones_only_in_the_tokenizer() -> None:
    for variant in ("ce", "ntl-was", "ntl-mse"):
        single = dataclasses.asdict(load_recipe(STUDY_RECIPES / f"{variant}.yaml"))
        chunked = dataclasses.asdict(load_recipe(STUDY_RECIPES / "3digit" / f"{variant}.yaml"))
        assert chunked["tokenizer"]["path"] == "pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit"
        for fields in (single, chunked):
            del fields["tokenizer"]["path"]
            fields["train"].pop("output_dir")
        assert single == chunked, variant


def test_plan_names_runs_and_refuses_unknown_variants(tmp_path: Path) -> None:
    runs = plan(STUDY_RECIPES, ["ce", "ntl-was", "3digit/ce"], [0, 1], tmp_path)
    names = ["ce-seed0", "ce-seed1", "ntl-was-seed0", "ntl-was-seed1", "3digit-ce-seed0", "3digit-ce-seed1"]
    assert [run.name for run in runs] == names
    assert runs[-1].run_dir == tmp_path / "3digit" / "ce-seed1"
    with pytest.raises(RecipeError, match="ntl-huber"):
        plan(STUDY_RECIPES, ["ntl-huber"], [0], tmp_path)


def test_each_variant_is_compared_with_the_ce_run_of_its_own_folder() -> None:
    assert [baseline_of(v) for v in ("ntl-was", "3digit/ntl-was", "a/b/ce")] == ["ce", "3digit/ce", "a/b/ce"]
    grouped = {
        "ce": [fake_results(0.5, 1.0, 0), fake_results(0.5, 1.0, 1)],
        "ntl-was": [fake_results(0.6, 1.0, 0), fake_results(0.7, 1.0, 1)],
        "3digit/ce": [fake_results(0.2, 1.0, 0), fake_results(0.4, 1.0, 1)],
        "3digit/ntl-was": [fake_results(0.1, 1.0, 0), fake_results(0.3, 1.0, 1)],
    }
    metric = generation_metrics(SETS)[0]  # exact match on the first set
    table = results_table(grouped, [metric])
    assert table[0].endswith("| ntl-was − ce | 3digit/ntl-was − 3digit/ce |")
    cells = [cell.strip() for cell in table[2].strip("| ").split(" | ")]
    # single digits: +0.15 and better on both seeds; three digits: −0.10 and worse on both seeds of its own pairing
    assert cells[-2:] == ["+0.150 (2/2)", "−0.100 (0/2)"]


def fake_results(exact: float, mae: float, seed: int) -> dict:
    results = {metric.key: 0.5 for metric in (*generation_metrics(SETS), *VALIDATION_METRICS)}
    results.update({f"eval/{SETS[0]}/exact_match": exact, f"eval/{SETS[0]}/mae": mae})
    results.update({f"eval/{qa_set}/examples": 100.0 for qa_set in SETS})
    return results | {"seed": seed}


def test_report_tables_mean_std_and_differences(tmp_path: Path) -> None:
    measured = {"ce": [(0.10, 50.0), (0.12, 40.0), (0.11, 45.0)], "ntl-was": [(0.20, 30.0), (0.13, 60.0), (0.18, 35.0)]}
    runs = []
    for variant, seeds in measured.items():
        for seed, (exact, mae) in enumerate(seeds):
            run = StudyRun(variant, seed, STUDY_RECIPES / f"{variant}.yaml", tmp_path / f"{variant}-seed{seed}")
            run.run_dir.mkdir()
            results = fake_results(exact, mae, seed)
            if (variant, seed) == ("ce", 2):  # evaluated before `val_number_ce` existed: that row is left out
                del results["val_number_ce"]
            (run.run_dir / "eval.json").write_text(json.dumps(results))
            (run.run_dir / "study.json").write_text(json.dumps({"train_s": 60.0, "eval_s": 10.0}))
            steps = [{"step": s, "loss": 2.0 / s, "ce": 2.0 / s, "ntl": 0.0} for s in (1, 2, 3)]
            # the trainer's periodic evaluation at steps 2 and 3, then the final `ntl-pretrain eval` record
            steps += [fake_results(exact * s / 3, mae, seed) | {"step": s, "split": "eval"} for s in (2, 3)]
            steps += [fake_results(exact, mae, seed) | {"step": 3, "split": "eval", "model": str(run.run_dir)}]
            (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
            (run.run_dir / "recipe.yaml").write_text("{}")
            runs.append(run)
    doc, plot = tmp_path / "docs" / "study.md", tmp_path / "docs" / "study.png"
    protocol = tmp_path / "docs" / "protocol.md"
    protocol.parent.mkdir()
    protocol.write_text("Primary metric: exact match.\n")
    write_report(runs, doc, plot, "ntl-pretrain study", [], protocol=protocol)
    text = doc.read_text()
    assert plot.is_file() and "](study.png)" in text
    assert "## Protocol (fixed before the runs: [protocol.md](protocol.md))\n\nPrimary metric: exact match.\n" in text

    rows = table_rows(section(text, "## Results"))
    exact_row, mae_row = rows[f"{SETS[0]} exact match"], rows[f"{SETS[0]} MAE"]
    assert rows[f"{SETS[1]} digit acc."] and rows["val NTL-WAS"]  # every set's metrics, then validation
    assert "val CE at number labels" not in rows
    ce_exact = [e for e, _ in measured["ce"]]
    was_exact = [e for e, _ in measured["ntl-was"]]
    assert exact_row[1] == f"{statistics.fmean(ce_exact):.3f} ± {statistics.stdev(ce_exact):.3f}"
    assert exact_row[2] == f"{statistics.fmean(was_exact):.3f} ± {statistics.stdev(was_exact):.3f}"
    # paired by seed: ntl-was has the higher exact match on all 3 seeds, the lower MAE on seeds 0 and 2 only
    assert exact_row[3].rstrip(" |") == f"+{statistics.fmean(was_exact) - statistics.fmean(ce_exact):.3f} (3/3)"
    mae_gain = statistics.fmean(m for _, m in measured["ce"]) - statistics.fmean(m for _, m in measured["ntl-was"])
    assert mae_row[3].rstrip(" |") == f"+{mae_gain:.3f} (2/3)"
    assert "(0.25 for n = 3; two-sided sign test)" in text
    assert rows[f"{SETS[1]} digit acc."][3].rstrip(" |") == "+0.000"  # tied on every seed: no count
    assert "6 runs, 7.0 min" in text
    assert "100 of `pkg:ntl_pretrain/corpus/addition/interpolation.jsonl`" in text  # what was asked, from the recipe
    assert "Caveats" not in text  # exact match of 10-50%: the models learned something

    curve = text.split("## During training: exact match")[1].split(f"{SETS[1]}:")[0]
    ce_row = next(line for line in curve.splitlines() if line.startswith("| ce |"))
    at_step_2 = [exact * 2 / 3 for exact in ce_exact]
    assert "| step 2 | step 3 |" in curve and "first 100 questions" in curve
    assert ce_row.split(" | ")[1] == f"{statistics.fmean(at_step_2):.3f} ± {statistics.stdev(at_step_2):.3f}"


def section(text: str, heading: str) -> str:
    """The Markdown from `heading` to the next heading of its level."""
    level = heading.split(" ")[0] + " "
    return text.split(heading, 1)[1].split("\n" + level, 1)[0]


def table_rows(text: str) -> dict[str, list[str]]:
    """Table rows by their first cell; each row's cells as split on " | " (the first keeps its "| ")."""
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("|")}


def test_runs_go_seed_by_seed_so_a_stopped_study_leaves_whole_pairs(tmp_path: Path, monkeypatch) -> None:
    """The plan is variant by variant; the runs start seed by seed (every variant of a seed, then the next), the
    finished ones skipped, and `--stop-after` then leaves complete sets of paired runs behind."""
    runs = plan(STUDY_RECIPES, ["ce", "ntl-was"], [5, 3, 4], tmp_path / "runs")
    runs[1].run_dir.mkdir(parents=True)
    runs[1].done_file.write_text("{}")  # ce seed 3 finished earlier
    started = []
    monkeypatch.setattr("ntl_pretrain.study.commands.execute", lambda run, *_: started.append(run.name))
    run_all(runs, [], [], jobs=1, env={}, logs=tmp_path / "logs", device="cpu")
    assert started == ["ce-seed5", "ntl-was-seed5", "ntl-was-seed3", "ce-seed4", "ntl-was-seed4"]


def test_wall_clock_counts_only_time_with_a_run_in_progress(tmp_path: Path) -> None:
    """Two overlapping runs, then one started a day later (a resumed study): 150 s + 100 s, not a day."""
    runs = []
    for index, (start, end) in enumerate([(0, 100), (50, 150), (86_400, 86_500)]):
        run = StudyRun("ce", index, STUDY_RECIPES / "ce.yaml", tmp_path / f"ce-seed{index}")
        run.run_dir.mkdir()
        for path, stamp in ((run.run_dir / "recipe.yaml", start), (run.done_file, end)):
            path.write_text("{}")
            os.utime(path, (1e9 + stamp, 1e9 + stamp))
        runs.append(run)
    assert _wall_clock(runs) == 250.0


def answer(question: str, reference: str, generated: str) -> dict:
    parsed = generated if generated.lstrip("-").replace(".", "", 1).isdigit() else None
    return {"set": SETS[0], "question": question, "answer": reference, "generated": generated, "parsed": parsed,
            "exact": parsed is not None and float(parsed) == float(reference)}  # fmt: skip


def test_error_profile_sorts_wrong_answers_by_their_last_digit() -> None:
    records = [answer("1+1=", "2", "2"), answer("9+9=", "18", "17"), answer("5+5=", "10", "13"),
               answer("7+7=", "14", "24"), answer("8+8=", "16", "-6"), answer("1+2=", "3", "x"),
               answer("1+1=", "2", "2.5"), answer("2+2=", "4", "4")]  # fmt: skip
    profile = error_profile(records)
    assert profile["exact"] == 2 / 8
    assert profile["last_digit_wrong"] == 2 / 8  # 17 (off by 1) and 13 (off by 3)
    assert profile["higher_digit_wrong"] == 2 / 8  # 24 against 14 (a carry), -6 against 16 (last digit 6 is right)
    assert profile["last_digit_off_by_one"] == 1 / 2 and profile["last_digit_distance"] == 2.0
    nothing_wrong = error_profile([answer("1+1=", "2", "2")])
    assert nothing_wrong["exact"] == 1.0 and math.isnan(nothing_wrong["last_digit_distance"])


def test_error_size_is_the_median_and_the_mean_of_the_best_90_percent() -> None:
    """Against numpy on 20 answers with one wild one: the median ignores it, the best-90% mean drops the 2 largest;
    answers without a number are left out, as from `eval`'s MAE."""
    wanted = np.arange(100, 120)
    got = wanted + np.array([0, 1, -1, 2, 3, -3, 0, 5, 8, -2, 1, 1, 0, -4, 6, 2, 316072, 0, -1, 9])
    records = [answer("q", str(w), str(g)) for w, g in zip(wanted, got, strict=True)] + [answer("q", "7", "none")]
    errors = np.abs(got - wanted)
    size = error_size(records)
    assert size["median_ae"] == np.median(errors)
    assert size["trimmed_mae"] == pytest.approx(np.sort(errors)[:18].mean())
    assert error_profile(records)["median_ae"] == size["median_ae"]
    assert all(math.isnan(value) for value in error_size([answer("q", "7", "none")]).values())


def test_error_profile_section_needs_every_runs_answers(tmp_path: Path) -> None:
    runs = []
    for variant, seed, generated in (("ce", 0, "13"), ("ce", 1, "12"), ("ntl-was", 0, "22"), ("ntl-was", 1, "12")):
        run = StudyRun(variant, seed, STUDY_RECIPES / f"{variant}.yaml", tmp_path / f"{variant}-seed{seed}")
        run.run_dir.mkdir()
        records = [answer("5+7=", "12", generated), answer("6+6=", "12", "12")]
        (run.run_dir / "answers.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        runs.append(run)
    lines = error_profile_section(runs)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    # ce: seed 0 has its last digit wrong by 1 (13), seed 1 is exact; ntl-was: a wrong tens digit, then exact
    assert rows["ce"][1:4] == ["0.750 ± 0.354", "0.250 ± 0.354", "0.000 ± 0.000"]
    assert rows["ntl-was"][1:4] == ["0.750 ± 0.354", "0.000 ± 0.000", "0.250 ± 0.354"]
    assert rows["ce"][4] == "1.000 ± 0.000" and rows["ntl-was"][5].rstrip(" |") == "n/a"
    (runs[-1].run_dir / "answers.jsonl").unlink()
    assert error_profile_section(runs) == []  # one run without answers (an older evaluation): no section


def test_caveat_when_no_variant_learned_the_task() -> None:
    grouped = {variant: [fake_results(exact, 1.0, 0) | {f"eval/{SETS[1]}/exact_match": 0.4}] for variant, exact in
               (("ce", 0.01), ("ntl-was", 0.03))}  # fmt: skip
    notes = low_accuracy_notes(grouped)
    assert len(notes) == 1 and notes[0].startswith(f"- {SETS[0]}: the best variant's mean exact match is 3.0%")


@pytest.mark.slow
def test_one_study_run_trains_evaluates_and_matches_the_trainers_validation(tmp_path: Path) -> None:
    run = StudyRun("ntl-was", 0, STUDY_RECIPES / "ntl-was.yaml", tmp_path / "ntl-was-seed0")
    overrides = ["train.max_steps=2", "train.eval_every_steps=2", "train.eval_max_batches=null",
                 "model.config.num_hidden_layers=1"]  # fmt: skip
    _, env = placement("cpu", jobs=1, environ=dict(os.environ), cpu_count=2)
    execute(run, overrides, ["--max-examples", "8", "--max-new-tokens", "4"], env, logs=tmp_path / "logs",
            device=device_name("cpu"))  # fmt: skip
    results = run.results()
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer_validation = next(r for r in records if r.get("split") == "validation")
    assert results["step"] == trainer_validation["step"] == 2
    assert results["val_ce"] == pytest.approx(trainer_validation["val_ce"], rel=1e-5)
    assert results["val_ntl_was"] == pytest.approx(trainer_validation["val_ntl"], rel=1e-5)
    assert results[f"eval/{SETS[0]}/examples"] == results[f"eval/{SETS[1]}/examples"] == 8  # the recipe's sets
    assert records[-1]["split"] == "eval"  # --log-metrics appended the evaluation for `ntl-pretrain plot`
    assert set(run.timing()) == {"variant", "seed", "train_s", "eval_s", "started", "finished", "code", "device"}
    assert run.timing()["device"] == f"cpu ({os.cpu_count()} cores)"  # where it ran (issue 58)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert run.timing()["code"]["commit"] == head.stdout.strip()  # the checkout these tests import
    assert [record["set"] for record in run.answers()] == [SETS[0]] * 8 + [SETS[1]] * 8  # for error_profile


def write_finished_run(run: StudyRun, results: dict, answers: list[dict], recipe: str = "{}",
                       code: dict | None = None) -> None:  # fmt: skip
    """What `execute` leaves in a run folder (without checkpoints): results, answers, the trainer's records; the
    recipe names no tokenizer unless `recipe` does (then the answers are also scored per token class); `code`: the
    code that ran it, as study/provenance.py records it (runs of older studies have none)."""
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "eval.json").write_text(json.dumps(results))
    (run.run_dir / "answers.jsonl").write_text("".join(json.dumps(record) + "\n" for record in answers))
    steps = [{"step": s, "loss": 2.0 / s, "ce": 2.0 / s, "ntl": 0.0} for s in (1, 2)]
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (run.run_dir / "recipe.yaml").write_text(recipe)
    timing = {"variant": run.variant, "seed": run.seed, "train_s": 60.0, "eval_s": 5.0, "started": 1e9 + 100 * run.seed,
              "finished": 1e9 + 100 * run.seed + 65} | ({} if code is None else {"code": code})  # fmt: skip
    (run.run_dir / "study.json").write_text(json.dumps(timing))


# Per seed: (ce exact, ntl-was exact, ce log-error, ntl-was log-error, ce's and ntl-was's generated answer to 5+7).
PAIRED = [(0.50, 0.58, 0.20, 0.15, "15", "13"), (0.40, 0.41, 0.25, 0.24, "13", "13"),
          (0.60, 0.66, 0.18, 0.12, "16", "13"), (0.55, 0.52, 0.21, 0.22, "12", "14")]  # fmt: skip


def answers_to(five_plus_seven: str) -> list[dict]:
    """Three answers: 5+7 as given, 9+9 off by one in the last digit, 1+1 right."""
    return [answer("5+7=", "12", five_plus_seven), answer("9+9=", "18", "17"), answer("1+1=", "2", "2")]


def paired_study(tmp_path: Path, archive: Path | None = None) -> list[StudyRun]:
    runs = []
    for seed, (ce_exact, was_exact, ce_log, was_log, ce_answer, was_answer) in enumerate(PAIRED):
        for variant, exact, log_error, generated in (("ce", ce_exact, ce_log, ce_answer),
                                                     ("ntl-was", was_exact, was_log, was_answer)):  # fmt: skip
            name = f"{variant}-seed{seed}"
            run = StudyRun(variant, seed, STUDY_RECIPES / f"{variant}.yaml", tmp_path / "runs" / name,
                           None if archive is None else archive / name)  # fmt: skip
            results = fake_results(exact, 1.0, seed) | {f"eval/{SETS[0]}/log_mae": log_error}
            del results["seed"]
            code = {"commit": "0123456789abcdef", "dirty": seed == 1} if seed < 2 else None
            write_finished_run(run, results, answers_to(generated), code=code)
            runs.append(run)
    return runs


def test_report_pairs_every_metric_writes_runs_csv_and_states_the_verdict(tmp_path: Path) -> None:
    runs = paired_study(tmp_path)
    doc, plot = tmp_path / "docs" / "study.md", tmp_path / "docs" / "study.png"
    rule = same_effect_rule((("ntl-was", "ce"),), Effect(f"eval/{SETS[0]}/log_mae", higher_is_better=False), 0.02,
                            0.02, guard=Effect(f"eval/{SETS[0]}/exact_match"))  # fmt: skip
    write_report(runs, doc, plot, "ntl-pretrain study", [], rule=rule)
    text = doc.read_text()

    ce_log, was_log = [p[2] for p in PAIRED], [p[3] for p in PAIRED]
    log_gains = [c - w for c, w in zip(ce_log, was_log, strict=True)]  # CE minus the variant: + is better
    reference = scipy_stats.ttest_rel(ce_log, was_log)
    low, high = reference.confidence_interval(0.95)
    paired = table_rows(section(text, "## Paired differences"))
    row = [cell.strip(" |") for cell in paired[f"{SETS[0]} log10(1+AE)"]]
    assert row[1:] == [f"+{statistics.fmean(log_gains):.3f}", f"[{_signed(low)}, {_signed(high)}]",
                       f"+{reference.statistic:.2f}", f"{reference.pvalue:.3f}", "0.375", "4"]  # fmt: skip
    # the permutation p: gains +0.05 +0.01 +0.06 −0.01 (sum 0.11); as far from 0 are the observed signs, those with
    # −0.01 flipped (0.13) or both ±0.01 flipped (0.11, a tie), and their negatives: 6 of 16 sign patterns

    # of the wrong last digits, the share off by one: 9+9=17 always, 5+7 when answered 13 (not 15, 16 or 14)
    results = table_rows(section(text, "## Results"))
    off_by_one = results[f"{SETS[0]} wrong last digits off by 1"]
    ce_share = [error_profile(answers_to(p[4]))["last_digit_off_by_one"] for p in PAIRED]
    was_share = [error_profile(answers_to(p[5]))["last_digit_off_by_one"] for p in PAIRED]
    assert ce_share == [0.5, 1.0, 0.5, 1.0] and was_share == [1.0, 1.0, 1.0, 0.5]
    assert off_by_one[1] == f"{statistics.fmean(ce_share):.3f} ± {statistics.stdev(ce_share):.3f}"
    assert off_by_one[3].rstrip(" |") == "+0.125 (2/3)"  # better on seeds 0 and 2, worse on 3, tied on 1
    off_by_one_paired = [cell.strip(" |") for cell in paired[f"{SETS[0]} wrong last digits off by 1"]]
    assert off_by_one_paired[1] == "+0.125" and off_by_one_paired[-1] == "4"
    assert f"{SETS[0]} R²" in results and results[f"{SETS[0]} MAE"][1] == "1.000 ± 0.000"  # 3 decimals
    assert "val CE at answer labels" in results and "val NTL-WAS at answer labels" in results

    verdict = decide(rule, by_variant(runs, [run.measured() for run in runs]))[0]
    assert f"- `ntl-was` vs `ce`: **{verdict.outcome}**" in section(text, "## Decision")

    with (tmp_path / "docs" / "study-runs.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(row["variant"], row["seed"]) for row in rows] == [(v, str(s)) for s in range(4) for v in ("ce", "ntl-was")]
    assert float(rows[3][f"eval/{SETS[0]}/log_mae"]) == PAIRED[1][3]
    assert float(rows[2][f"errors/{SETS[0]}/last_digit_off_by_one"]) == ce_share[1]
    assert rows[0]["train_s"] == "60.0" and rows[0]["eval_s"] == "5.0" and "val_ntl_was" in rows[0]
    assert [row["code"] for row in rows[::2]] == ["0123456789", "0123456789 +changes", "not recorded", "not recorded"]
    assert ("- Code (the `code` field of each run's study.json): `0123456789` 2 runs; `0123456789 +changes` 2 runs; "
            "`not recorded` 4 runs.") in section(text, "## Setup")  # fmt: skip
    code_cell, device_cell = table_rows(section(text, "## Per run"))["ce-seed1"][-2:]
    assert (code_cell.strip(" |"), device_cell.strip(" |")) == ("0123456789 +changes", "not recorded")
    assert {row["device"] for row in rows} == {"not recorded"}  # runs made before study.json recorded a device


def _signed(value: float) -> str:
    return f"{'+' if value >= 0 else '−'}{abs(value):.3f}"


def test_archived_runs_are_done_and_report_without_their_run_folders(tmp_path: Path) -> None:
    archive = tmp_path / "committed"
    runs = paired_study(tmp_path, archive)
    for run in runs[:-1]:
        archive_run(run.run_dir, run.archive)
    archived = sorted(path.name for path in (archive / "ce-seed0").iterdir())
    assert archived == sorted(ARCHIVED) and {"answers.jsonl.gz", "metrics.jsonl.gz"} < set(archived)  # no checkpoint
    first = (archive / "ce-seed0" / "metrics.jsonl.gz").read_bytes()
    archive_run(runs[0].run_dir, runs[0].archive)  # again, a second later: the same bytes for git
    assert (archive / "ce-seed0" / "metrics.jsonl.gz").read_bytes() == first
    assert read_metrics(archive / "ce-seed0") == read_metrics(runs[0].run_dir)
    # the last run finished before --archive was given: run_all archives it and runs nothing
    run_all(runs, [], [], jobs=2, env={}, logs=tmp_path / "logs", device="cpu")
    assert all(run.archived for run in runs) and not (tmp_path / "logs").exists()

    shutil.rmtree(tmp_path / "runs")  # a fresh clone: the archive alone
    fresh = plan(STUDY_RECIPES, ["ce", "ntl-was"], [0, 1, 2, 3], tmp_path / "runs", archive)
    assert all(run.done for run in fresh) and fresh[4].folder == archive / "ntl-was-seed0"
    assert fresh[4].answers() == answers_to(PAIRED[0][5])
    doc = tmp_path / "docs" / "study.md"
    write_report(fresh, doc, tmp_path / "docs" / "study.png", "ntl-pretrain study", [])
    assert "## Paired differences" in doc.read_text() and (tmp_path / "docs" / "study.png").is_file()
    assert "8 runs, 8.7 min of run time in total; 4.3 min of wall-clock" in doc.read_text()  # 4 x 65 s, from study.json

    (archive / "ce-seed3" / "study.json").unlink()  # an incomplete copy is not a finished run
    assert not plan(STUDY_RECIPES, ["ce"], [3], tmp_path / "runs", archive)[0].done


THREE_DIGIT_RECIPE = "tokenizer: {path: pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit}\ninit_from: null\n"


def class_answers(right: dict[str, int]) -> list[dict]:
    """Under tiny-tokenizer-3digit: two answers that are 2-digit tokens, three that are 3-digit tokens, one of two
    tokens (1998 = 199, 8), and one in the other set; the first `right[class]` of each class answered right, the
    others off by one."""
    references = {"2digit": ["87", "42"], "3digit": ["161", "100", "198"], "multi": ["1998"]}
    records = []
    for label, answers in references.items():
        for index, reference in enumerate(answers):
            generated = reference if index < right[label] else str(int(reference) + 1)
            records.append(answer(f"q{reference}=", reference, generated))
    return [*records, answer("x=", "55", "55") | {"set": SETS[1]}]


def test_exact_match_by_the_class_of_the_answers_token_under_the_runs_tokenizer(tmp_path: Path) -> None:
    from ntl_pretrain.study.token_classes import answer_class

    spec = "pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit"
    assert [answer_class(spec, text) for text in ("5", "87", "161", "007", "1998", "-5")] == [
        "1digit", "2digit", "3digit", "3digit", "multi", "multi"]  # fmt: skip
    run = StudyRun("3digit/ce", 0, STUDY_RECIPES / "3digit" / "ce.yaml", tmp_path / "runs" / "3digit-ce-seed0",
                   tmp_path / "archive" / "3digit-ce-seed0")  # fmt: skip
    write_finished_run(run, fake_results(0.5, 1.0, 0), class_answers({"2digit": 1, "3digit": 3, "multi": 0}),
                       THREE_DIGIT_RECIPE)  # fmt: skip
    archive_run(run.run_dir, run.archive)
    shutil.rmtree(run.run_dir)  # read from the archive: answers.jsonl.gz and the saved recipe's tokenizer
    measured = run.measured()
    by_class = {key.removeprefix("eval/"): value for key, value in measured.items() if key.endswith("_token")}
    assert by_class == {
        f"{SETS[0]}/exact_match_2digit_token": 0.5, f"{SETS[0]}/examples_2digit_token": 2,
        f"{SETS[0]}/exact_match_3digit_token": 1.0, f"{SETS[0]}/examples_3digit_token": 3,
        f"{SETS[0]}/exact_match_multi_token": 0.0, f"{SETS[0]}/examples_multi_token": 1,
        f"{SETS[1]}/exact_match_2digit_token": 1.0, f"{SETS[1]}/examples_2digit_token": 1,
    }  # fmt: skip
    (run.archive / "recipe.yaml").write_text("{}")  # a recipe that names no tokenizer: no classes, no error
    assert not any(key.endswith("_token") for key in run.measured())


def test_report_and_runs_csv_carry_exact_match_per_answer_token_class(tmp_path: Path) -> None:
    # 2-digit answers right per seed: ce 0, 1, 1; ntl-was 2, 2, 1. 3-digit: ce 3, 3, 2; ntl-was 1, 2, 2.
    right = {"3digit/ce": [(0, 3), (1, 3), (1, 2)], "3digit/ntl-was": [(2, 1), (2, 2), (1, 2)]}
    runs = []
    for variant, per_seed in right.items():
        for seed, (two, three) in enumerate(per_seed):
            run = StudyRun(variant, seed, STUDY_RECIPES / f"{variant}.yaml",
                           tmp_path / "runs" / f"{variant.replace('/', '-')}-seed{seed}")  # fmt: skip
            answers = class_answers({"2digit": two, "3digit": three, "multi": 1})
            write_finished_run(run, fake_results(0.5, 1.0, seed), answers, THREE_DIGIT_RECIPE)
            runs.append(run)
    doc = tmp_path / "docs" / "study.md"
    write_report(runs, doc, tmp_path / "docs" / "study.png", "ntl-pretrain study", [])
    text = doc.read_text()
    results = table_rows(section(text, "## Results"))
    two_digit = results[f"{SETS[0]} 2-digit-token answers: exact match"]
    # better on seeds 0 and 1, tied on seed 2 (left out of k/n)
    assert two_digit[1:3] == ["0.333 ± 0.289", "0.833 ± 0.289"] and two_digit[3].rstrip(" |") == "+0.500 (2/2)"
    three_digit = results[f"{SETS[0]} 3-digit-token answers: exact match"]
    assert three_digit[3].rstrip(" |") == "−0.333 (0/2)"  # worse on seeds 0 and 1, tied on seed 2
    assert results[f"{SETS[0]} 3-digit-token answers: count"][1] == "3 ± 0"
    assert f"{SETS[0]} multi-token answers: exact match" in results
    order = [title for title in results if title.startswith(SETS[0])]
    assert order.index(f"{SETS[0]} wrong last digits off by 1") < order.index(f"{SETS[0]} 2-digit-token answers: "
                                                                              "exact match")  # fmt: skip
    paired = table_rows(section(text, "## Paired differences"))
    assert paired[f"{SETS[0]} 2-digit-token answers: exact match"][1] == "+0.500"
    assert f"{SETS[0]} 2-digit-token answers: count" not in paired  # the same in every run: nothing to pair
    with (tmp_path / "docs" / "study-runs.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [float(row[f"eval/{SETS[0]}/exact_match_2digit_token"]) for row in rows] == [0, 0.5, 0.5, 1, 1, 0.5]
    assert {row[f"eval/{SETS[0]}/examples_3digit_token"] for row in rows} == {"3.0"}


def study_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["study", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_bad_override_or_variant_touches_no_run_folder(tmp_path: Path, capsys) -> None:
    unfinished = tmp_path / "runs" / "ce-seed0"
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text("{}\n")
    common = ["--recipes", str(STUDY_RECIPES), "--seeds", "0", "--runs-dir", str(tmp_path / "runs"), "--doc",
              str(tmp_path / "study.md"), "--plot", str(tmp_path / "study.png")]  # fmt: skip
    code, out, err = study_main(capsys, "trian.max_steps=1", *common, "--variants", "ce")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"ntl-pretrain study: {STUDY_RECIPES / 'ce.yaml'}: command-line override: trian: unknown key")
    code, _, err = study_main(capsys, *common, "--variants", "ce", "ntl-huber")
    assert code == 2 and "no recipe for variant 'ntl-huber'" in err
    code, _, err = study_main(capsys, *common, "--variants", "ce", "ntl-was", "--decide")
    assert code == 2 and "--decide compares" in err
    code, _, err = study_main(capsys, *common, "--variants", "ce", "--jobs", "0")
    assert code == 2 and "--jobs: must be >= 1" in err
    assert (unfinished / "metrics.jsonl").read_text() == "{}\n"


def test_overrides_after_seeds_or_variants_are_overrides(tmp_path: Path, capsys) -> None:
    """argparse's nargs="+" swallows the words after `--seeds`; the study gives back the `key=value` ones."""
    where = ["--recipes", str(STUDY_RECIPES), "--runs-dir", str(tmp_path / "runs")]
    assert cli_main(["study", *where, "--variants", "ce", "--seeds", "0", "1", "train.max_steps=5", "--status"]) == 0
    assert "ce: 0 done, 2 pending" in capsys.readouterr().out
    assert cli_main(["study", *where, "--seeds", "0", "trian.max_steps=5", "--variants", "ce"]) == 2
    err = capsys.readouterr().err
    assert "command-line override: trian: unknown key" in err and len(err.splitlines()) == 1
    assert cli_main(["study", *where, "--variants", "ce", "--seeds", "0", "one"]) == 2
    assert capsys.readouterr().err == "ntl-pretrain study: --seeds: expected whole numbers >= 0, got 'one'\n"
    assert not (tmp_path / "runs").exists()


def test_status_and_no_report_before_every_planned_run_is_finished(tmp_path: Path, capsys) -> None:
    archive = tmp_path / "committed"
    runs = paired_study(tmp_path, archive)
    for run in runs[:3]:
        archive_run(run.run_dir, run.archive)
    shutil.rmtree(tmp_path / "runs")
    doc, protocol = tmp_path / "study.md", tmp_path / "protocol.md"
    protocol.write_text("fixed\n")
    common = ["--recipes", str(STUDY_RECIPES), "--variants", "ce", "ntl-was", "--seeds", "0", "1", "--runs-dir",
              str(tmp_path / "runs"), "--archive", str(archive), "--doc", str(doc), "--plot",
              str(tmp_path / "study.png")]  # fmt: skip
    in_progress = tmp_path / "runs" / "ntl-was-seed1"  # at step 250 of 1,000 (the recipe the trainer wrote)
    in_progress.mkdir(parents=True)
    (in_progress / "recipe.yaml").write_text("train: {max_steps: 1000}\n")
    steps = [{"step": 249, "loss": 1.0}, {"step": 250, "loss": 1.0}, {"step": 250, "split": "validation"}]
    (in_progress / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    code, out, _ = study_main(capsys, *common, "--status")
    assert code == 0 and out.splitlines() == ["ce: 2 done, 0 pending", "ntl-was: 1 done, 1 pending",
                                              "all: 3 of 4 planned runs done, 1 pending; the unfinished runs have "
                                              "trained 0.25 runs' worth of steps"]  # fmt: skip
    shutil.rmtree(tmp_path / "runs")
    code, out, _ = study_main(capsys, *common, "--protocol", str(protocol), "--stop-after", "0")
    assert code == EXIT_UNFINISHED and not doc.exists() and not (tmp_path / "runs").exists()
    assert out == "ntl-pretrain study: 3 of 4 planned runs finished; no report until all are\n"

    recipes = tmp_path / "recipes" / "3digit"  # the variants the default decision rule compares
    recipes.mkdir(parents=True)
    for variant in ("ce", "ntl-was", "ntl-was-answer"):
        (recipes / f"{variant}.yaml").write_text(f"base: {STUDY_RECIPES / '3digit' / 'ntl-was.yaml'}\n")
    finished = StudyRun("3digit/ce", 0, recipes / "ce.yaml", tmp_path / "runs" / "3digit" / "ce-seed0")
    write_finished_run(finished, fake_results(0.5, 1.0, 0), answers_to("13"))  # one of the three runs
    code, out, _ = study_main(capsys, "--recipes", str(recipes.parent), "--variants", "3digit/ce", "3digit/ntl-was",
                              "3digit/ntl-was-answer", "--seeds", "0", "--runs-dir", str(tmp_path / "runs"),
                              "--doc", str(doc), "--plot", str(tmp_path / "study.png"), "--decide", "--stop-after",
                              "0")  # fmt: skip
    assert code == EXIT_UNFINISHED and not doc.exists()  # a verdict from some runs is a peek too


def test_cpu_runs_split_the_threads_and_gpu_runs_share_the_device() -> None:
    overrides, env = placement("cpu", jobs=2, environ={"PATH": "/bin"}, cpu_count=16)
    assert overrides == [] and env == {"PATH": "/bin", "OMP_NUM_THREADS": "8", "DS_ACCELERATOR": "cpu",
                                       "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    environ = {"PATH": "/bin", "DS_ACCELERATOR": "cpu"}
    overrides, env = placement("cuda", jobs=8, environ=environ, cpu_count=16)
    assert overrides == ["train.device=cuda"] and env == {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert resolve_device("auto", {"auto"}, cuda_available=True) == "cuda"
    assert resolve_device("auto", {"auto", "cpu"}, cuda_available=True) == "cpu"
    assert resolve_device("auto", {"cuda"}, cuda_available=False) == "cpu"
    assert resolve_device("cpu", {"auto"}, cuda_available=True) == "cpu"
    with pytest.raises(RecipeError, match="no CUDA GPU is visible"):
        resolve_device("cuda", {"auto"}, cuda_available=False)
    with pytest.raises(RecipeError, match="train.device: cpu"):
        resolve_device("cuda", {"cpu"}, cuda_available=True)


def test_on_a_gpu_every_run_is_one_process_on_the_device(tmp_path: Path, capsys, monkeypatch) -> None:
    """The whole command with a GPU (faked): each run's train and eval commands and environment."""
    launched: list[tuple[list[str], dict]] = []
    real_run = subprocess.run

    def fake_subprocess_run(command: list[str], env: dict | None = None, **kwargs):
        if command[0] == "git":  # the run's code record (study/provenance.py)
            return real_run(command, env=env, **kwargs)
        launched.append((command, env))
        if "ntl_pretrain.evaluation" in command:
            folder = Path(command[command.index("ntl_pretrain.evaluation") + 1])
            seed = int(folder.name.rsplit("seed", 1)[1])
            results = fake_results(0.5, 1.0, seed)
            del results["seed"]
            (folder / "eval.json").write_text(json.dumps(results))
            (folder / "answers.jsonl").write_text(json.dumps(answer("5+7=", "12", "13")) + "\n")
        else:
            folder = Path(next(arg for arg in command if arg.startswith("train.output_dir=")).split("=", 1)[1])
            folder.mkdir(parents=True)
            (folder / "recipe.yaml").write_text("{}")
            (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")

    monkeypatch.setattr("ntl_pretrain.study.commands.subprocess.run", fake_subprocess_run)
    monkeypatch.setattr("ntl_pretrain.study.commands._cuda_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    runs_dir = tmp_path / "runs"
    code, out, _ = study_main(capsys, "--recipes", str(STUDY_RECIPES), "--variants", "ce", "ntl-was", "--seeds", "0",
                              "1", "--runs-dir", str(runs_dir), "--doc", str(tmp_path / "study.md"), "--plot",
                              str(tmp_path / "study.png"), "--jobs", "3",
                              "train.max_steps=7")  # fmt: skip
    assert code == 0 and out.endswith(f"{tmp_path / 'study.md'}\n")
    trains = [(command, env) for command, env in launched if "train" in command]
    assert len(trains) == 4 and len(launched) == 8
    for _, env in launched:
        assert "DS_ACCELERATOR" not in env and env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
    for command, _ in trains:
        assert command[command.index("train") + 2 :][:2] == ["--nproc", "1"]
        assert command[-2:] == ["train.max_steps=7", "train.device=cuda"]
    assert (tmp_path / "study-runs.csv").is_file() and (tmp_path / "study.png").is_file()
    timings = [json.loads(path.read_text()) for path in runs_dir.glob("*/study.json")]
    assert len(timings) == 4 and {timing["device"] for timing in timings} == {"cuda (NVIDIA H200)"}
    assert (
        "- Device (the `device` field of each run's study.json): cuda (NVIDIA H200) 4 runs."
        in (tmp_path / "study.md").read_text()
    )


def test_setup_names_each_variants_tokenizer_steps_and_data_where_they_differ_from_the_first(tmp_path: Path) -> None:
    """Study v6's arms differ in tokenizer, training answers and length (single-digit runs take 1.616x the steps for
    the same examples): the setup's variant line says so per variant; its Training and Data lines are the first's."""
    longer = tmp_path / "recipes" / "regression-exact-1digit"
    longer.mkdir(parents=True)
    (longer / "ntl-was-answer.yaml").write_text(
        f"base: {STUDY_RECIPES / 'regression-exact-1digit' / 'ntl-was-answer.yaml'}\ntrain: {{max_steps: 1616}}\n"
    )
    variant = "regression-exact-1digit/ntl-was-answer"
    runs = [*plan(STUDY_RECIPES, ["regression/ce"], [0], tmp_path / "runs"),
            *plan(tmp_path / "recipes", [variant], [0], tmp_path / "runs")]  # fmt: skip
    for run in runs:
        write_finished_run(run, fake_results(0.5, 1.0, 0), [])
    lines = setup_lines(runs, [])
    variants = next(line for line in lines if line.startswith("- Variants"))
    assert "regression/ce = CE;" in variants
    assert ("regression-exact-1digit/ntl-was-answer = CE + 0.3 · NTL-WAS with tokenizer "
            "`pkg:ntl_pretrain/corpus/tiny-tokenizer`, 1,616 steps, data "
            "`pkg:ntl_pretrain/corpus/regression-exact/train.jsonl`;") in variants  # fmt: skip
    assert any(line.startswith("- Training: 1000 steps") for line in lines)


def test_a_study_warns_before_its_runs_when_their_code_is_not_one_clean_commit() -> None:
    """Started from another checkout's folder, `python -m` imports that checkout, not the clone on PYTHONPATH: the
    warning names where the code came from, before any run records it."""
    assert unclean_warning({"commit": "0" * 40, "dirty": False}) is None
    dirty = unclean_warning({"commit": "0" * 40, "dirty": True})
    assert dirty is not None and "has uncommitted changes" in dirty and f"({SOURCE})" in dirty
    assert "is not a git checkout" in (unclean_warning({"version": "0.1.0"}) or "")
