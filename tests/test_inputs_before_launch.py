"""Inputs that used to pass the checks and fail a run minutes in (issue 31): Q/A reference answers as users write
them, and the wandb extra a recipe asks for. Each is read as written or refused before launch with one line."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from ntl_pretrain import cli
from ntl_pretrain.evaluation.answers import parse_reference
from ntl_pretrain.evaluation.arguments import register
from ntl_pretrain.evaluation.commands import eval_config_from_args
from ntl_pretrain.evaluation.generation import QaExample
from ntl_pretrain.preflight import world as preflight

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"


@pytest.mark.parametrize(
    ("written", "value"),
    [("62,417", "62417"), ("-3.5", "-3.5"), ("+7", "7"), ("\u221212", "-12"), (" 1,234.50 ", "1234.5"), (".5", "0.5")],
)
def test_references_are_read_as_users_write_them(written, value):
    assert parse_reference(written) == Decimal(value)
    assert QaExample("q", written).answer_value == Decimal(value)  # what the generation eval scores against


@pytest.mark.parametrize("written", ["1e3", "about 5", "", "3,4", "62,417x", "12.", "NaN"])
def test_references_that_are_not_one_number_are_refused(written):
    with pytest.raises(ValueError, match="is not a number"):
        parse_reference(written)


def qa_file(tmp_path: Path, *answers: str) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(f'{{"question": "What is {i}?", "answer": "{a}"}}\n' for i, a in enumerate(answers)))
    return path


def dry_run(tmp_path: Path, *overrides: str) -> int:
    return cli.main(["train", str(TINY), "--dry-run", f"train.output_dir={tmp_path / 'run'}", *overrides])


def test_a_bad_reference_is_refused_before_launch_naming_file_line_and_value(tmp_path, capsys):
    (tmp_path / "good").mkdir()
    good, bad = qa_file(tmp_path / "good", "62,417", "-3.5"), qa_file(tmp_path, "62,417", "62 417")
    assert dry_run(tmp_path, "eval.every_steps=10", f"eval.qa_sets=[{{path: {good}}}]") == 0
    capsys.readouterr()
    assert dry_run(tmp_path, "eval.every_steps=10", f"eval.qa_sets=[{{path: {bad}}}]") == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"{bad} line 2: answer '62 417' is not a number" in error, error


def test_eval_refuses_a_bad_reference_before_loading_the_model(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", "model", "--qa", str(qa_file(tmp_path, "1", "two"))])
    with pytest.raises(ValueError, match=r"qa\.jsonl line 2: answer 'two' is not a number"):
        eval_config_from_args(args)


def test_wandb_asked_for_but_not_installed_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight, "installed", lambda name: name != "wandb")
    assert dry_run(tmp_path, "logging.wandb=true") == 2
    error = capsys.readouterr().err.strip()
    assert "logging.wandb: true needs the wandb package, which is not installed" in error and "\n" not in error
    monkeypatch.setattr(preflight, "installed", lambda name: True)
    monkeypatch.setenv("WANDB_MODE", "offline")  # online needs a key and the server (tests/test_wandb_preflight.py)
    assert dry_run(tmp_path, "logging.wandb=true") == 0


def test_an_output_folder_whose_parent_takes_no_lock_is_refused_before_launch(tmp_path, monkeypatch):
    """The folder exists and is writable, its parent is not (issue 42): the lock lives in the parent, so the run
    would die in its ranks. os.access stands in for the permission: tests run as root, which passes every check."""
    parent = tmp_path / "shared"
    (parent / "run").mkdir(parents=True)
    access = preflight.os.access
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: Path(path) != parent and access(path, mode))
    with pytest.raises(preflight.RecipeError, match=r"the run's lock .*run\.lock cannot be written \(.*shared is not"):
        preflight.check_output_dir(str(parent / "run"))
    preflight.check_output_dir(str(tmp_path / "elsewhere" / "run"))  # a parent to be created under a writable one
