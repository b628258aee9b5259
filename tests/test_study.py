"""The study: its recipes differ only in the loss, its report states what the runs measured, and one real run
(train + eval) agrees with the trainer's own validation."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path

import pytest

from ntl_pretrain.config import RecipeError, load_recipe
from ntl_pretrain.deepspeed_config import load_run
from ntl_pretrain.evaluation.answers import error_profile
from ntl_pretrain.study import execute, placement
from ntl_pretrain.study_report import (
    VALIDATION_METRICS,
    _wall_clock,
    error_profile_section,
    generation_metrics,
    low_accuracy_notes,
    results_table,
    write_report,
)
from ntl_pretrain.study_runs import StudyRun, baseline_of, plan

STUDY_RECIPES = Path(__file__).resolve().parent.parent / "recipes" / "study"
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
    execute(run, overrides, ["--max-examples", "8", "--max-new-tokens", "4"], env, logs=tmp_path / "logs")
    results = run.results()
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    trainer_validation = next(r for r in records if r.get("split") == "validation")
    assert results["step"] == trainer_validation["step"] == 2
    assert results["val_ce"] == pytest.approx(trainer_validation["val_ce"], rel=1e-5)
    assert results["val_ntl_was"] == pytest.approx(trainer_validation["val_ntl"], rel=1e-5)
    assert results[f"eval/{SETS[0]}/examples"] == results[f"eval/{SETS[1]}/examples"] == 8  # the recipe's sets
    assert records[-1]["split"] == "eval"  # --log-metrics appended the evaluation for `ntl-pretrain plot`
    assert set(run.timing()) == {"variant", "seed", "train_s", "eval_s", "started", "finished"}
    assert [record["set"] for record in run.answers()] == [SETS[0]] * 8 + [SETS[1]] * 8  # for error_profile
