"""`ntl-pretrain eval` on an HF folder: flags become the evaluation settings, the record matches the library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launches import REPO, as_a_user_runs_it, unattended_run
from test_evaluate_generation import TINY_TOKENIZER, greedy_one_by_one, tiny_model

from ntl_pretrain.cli import main as cli_main
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.evaluation import EvalConfig, QaSetConfig, generation_metrics, validation_metrics
from ntl_pretrain.evaluation.model_folder import resolve_target
from ntl_pretrain.tokenizer import load_tokenizer, resolve_path

QA = "pkg:ntl_pretrain/corpus/arithmetic/interpolation.jsonl"
HELD_OUT = "pkg:ntl_pretrain/corpus/word_problems/validation.jsonl"


def test_eval_command_on_an_hf_folder(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(TINY_TOKENIZER)
    model = tiny_model(tokenizer)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "eval.json"
    args = [str(folder), "--qa", QA, "--max-examples", "6", "--max-new-tokens", "5", "--batch-size", "4",
            "--validation", HELD_OUT, "--template", "{question} {answer}", "--seq-len", "64",
            "--max-validation-batches", "2", "--out", str(out),
            "--answers", str(tmp_path / "answers.jsonl")]  # fmt: skip
    assert cli_main(["eval", *args]) == 0
    record = json.loads(out.read_text())

    cfg = EvalConfig(qa_sets=[QaSetConfig(path=QA)], max_examples=6, max_new_tokens=5, batch_size=4)
    expected = generation_metrics(model, tokenizer, cfg)
    source = SourceConfig(path=str(resolve_path(HELD_OUT)), template="{question} {answer}")
    expected.update(validation_metrics(model, tokenizer, [source], seq_len=64, max_sequences=16))  # 2 batches of 8
    assert record["step"] is None and record["split"] == "eval"
    for key, value in expected.items():
        assert record[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key

    # --answers: every question in file order, the text an unbatched greedy decoder produces, scored as the record
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    questions = [json.loads(line) for line in resolve_path(QA).read_text().splitlines()[:6]]
    assert [(a["set"], a["question"], a["answer"]) for a in answers] == [
        ("arithmetic_interpolation", q["question"], q["answer"]) for q in questions
    ]
    unbatched = [greedy_one_by_one(model, tokenizer, q["question"], 5) for q in questions]
    assert [a["generated"] for a in answers] == unbatched
    assert sum(a["exact"] for a in answers) / 6 == record["eval/arithmetic_interpolation/exact_match"]
    assert sum(a["parsed"] is None for a in answers) / 6 == record["eval/arithmetic_interpolation/unparseable"]


@pytest.mark.slow
def test_eval_stdout_is_the_json_record_only_for_every_target_kind(tmp_path_factory) -> None:
    """`ntl-pretrain eval TARGET | python -m json.tool` works: DeepSpeed's accelerator warning goes to stderr with
    eval's own progress (its checkpoint reader's lines and transformers' bars nowhere), for a run directory (its
    checkpoint exported first), a checkpoint folder and an HF folder."""
    run_dir, _ = unattended_run(tmp_path_factory)
    step_folder, hf = run_dir / "checkpoints" / "step_4", tmp_path_factory.mktemp("eval_stdout") / "hf"
    subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "export", str(step_folder), str(hf)], cwd=REPO,
                   env=as_a_user_runs_it(), check=True, capture_output=True)  # fmt: skip
    flags = ["--max-examples", "2", "--max-new-tokens", "2", "--max-validation-batches", "1"]
    for target, validated in ((run_dir, True), (step_folder, True), (hf, False)):
        done = subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "eval", str(target), *flags], cwd=REPO,
                              env=as_a_user_runs_it(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.count("\n") == 1, done.stdout
        record = json.loads(done.stdout)
        assert record["model"] == str(target) and ("val_ce" in record) == validated
        said = done.stderr.splitlines()
        # each stage at once (and every few seconds while it lasts), on stderr; DeepSpeed's reader and the bars kept off
        assert (f"ntl-pretrain eval: {target}: exporting {step_folder} to a temporary HF folder" in said) == validated
        answering = f"ntl-pretrain eval: {target}: answering arithmetic_interpolation, arithmetic_extrapolation"
        assert any(line.startswith(answering) for line in said), said
        assert "Processing zero checkpoint" not in done.stderr and "%|" not in done.stderr, done.stderr


def test_targets_resolve_to_folders_or_checkpoints(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="an HF folder without weights"):
        resolve_target(hf)
    (hf / "model.safetensors").write_bytes(b"")
    assert resolve_target(hf).hf_folder == hf
    step = tmp_path / "run" / "checkpoints" / "step_40"
    (step / "hf_config").mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").touch()  # a step folder without model states is not a checkpoint
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_40")
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints", step):
        target = resolve_target(path)
        assert (target.checkpoint, target.step, target.run_dir) == (step, 40, tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        resolve_target(tmp_path / "nothing")


def test_eval_config_checks_name_the_key() -> None:
    from ntl_pretrain.evaluation.config import EvalConfig, QaSetConfig

    EvalConfig().check()
    for qa in EvalConfig().qa_sets:
        qa.check()
    with pytest.raises(ValueError, match="^path: no such file"):
        QaSetConfig(path="pkg:ntl_pretrain/corpus/arithmetic/missing.jsonl").check()
    with pytest.raises(ValueError, match="^prompt_template:"):
        EvalConfig(prompt_template="Q:").check()
    with pytest.raises(ValueError, match="^qa_sets: several sets"):
        EvalConfig(qa_sets=[QaSetConfig(path=QA), QaSetConfig(path=QA)]).check()


def parse_eval_flags(*flags: str):
    import argparse

    from ntl_pretrain.evaluation.arguments import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["eval", "RUN", *flags])


def saved_run(tmp_path: Path, recipe_text: str) -> Path:
    step = tmp_path / "run" / "checkpoints" / "step_3"
    (step / "hf_config").mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").touch()  # a step folder without model states is not a checkpoint
    (step / "recipe.yaml").write_text(recipe_text)
    return tmp_path / "run"


def test_a_runs_own_eval_section_fills_what_the_flags_leave_out(tmp_path: Path) -> None:
    from ntl_pretrain.config.loading import dump_recipe, load_recipe
    from ntl_pretrain.evaluation.commands import eval_config_from_args
    from ntl_pretrain.evaluation.model_folder import recipe_eval

    study = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "study" / "ntl-was.yaml")
    from_run = recipe_eval(resolve_target(saved_run(tmp_path, dump_recipe(study))))
    assert from_run == study.eval  # the saved section reads back as the recipe's own

    cfg = eval_config_from_args(parse_eval_flags("--max-examples", "7"), from_run)
    assert [qa.label for qa in cfg.qa_sets] == ["addition_interpolation", "addition_extrapolation"]
    assert (cfg.prompt_template, cfg.max_new_tokens, cfg.max_examples) == ("{question}", 6, 7)

    flags = parse_eval_flags("--qa", QA, "--max-new-tokens", "9", "--prompt-template", "Q: {question}")
    cfg = eval_config_from_args(flags, from_run)  # flags win over the run's section
    assert ([qa.label for qa in cfg.qa_sets], cfg.max_new_tokens) == (["arithmetic_interpolation"], 9)
    assert cfg.prompt_template == "Q: {question}"

    older = dump_recipe(study).split("\neval:\n")[0]  # a run saved before recipes had `eval:`
    assert recipe_eval(resolve_target(saved_run(tmp_path / "old", older))) is None
    defaults = eval_config_from_args(parse_eval_flags(), None)
    assert [qa.label for qa in defaults.qa_sets] == [qa.label for qa in EvalConfig().qa_sets]
    assert defaults.max_new_tokens == EvalConfig().max_new_tokens


def test_validation_is_packed_as_the_run_packed_it_unless_flags_say_otherwise(tmp_path: Path) -> None:
    from dataclasses import replace

    from ntl_pretrain.config.loading import dump_recipe, load_recipe
    from ntl_pretrain.evaluation.commands import _validation_data

    tiny = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml")
    recipe = replace(tiny, data=replace(tiny.data, seq_len=96, per_document_attention=True))
    target = resolve_target(saved_run(tmp_path, dump_recipe(recipe)))
    data = _validation_data(target, EvalConfig(), None, None)
    assert (data.seq_len, data.per_document_attention) == (96, True)
    assert data.validation == tiny.data.validation
    flags = parse_eval_flags("--no-per-document-attention", "--seq-len", "32")
    data = _validation_data(target, EvalConfig(), flags.seq_len, flags.per_document_attention)
    assert (data.seq_len, data.per_document_attention) == (32, False)
    assert parse_eval_flags().per_document_attention is None  # None = the run's setting
