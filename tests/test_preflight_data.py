"""The dry run reads what every reader of the planned world will read first: a source that leaves a reader without a
usable document is refused before launch, naming the fix when its records are lines (issue 50: a one-record-per-line
txt read by paragraph passed `--dry-run`, and `train` died 1.5 minutes later on rank 1)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers.launches import TINY

from ntl_pretrain import cli
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.data.sources import SourceStream
from ntl_pretrain.preflight.data import check_readers


def recipe_reading(path, *overrides: str):
    return load_recipe(TINY, [f"data.sources=[{{path: {path}}}]", "data.validation=[]",
                              "train.eval_every_steps=null", *overrides])  # fmt: skip


@pytest.fixture
def lines_txt(tmp_path):
    path = tmp_path / "sums.txt"
    path.write_text("".join(f"{i} plus {i} is {2 * i}\n" for i in range(6)))
    return path


def test_records_on_lines_read_by_paragraph_are_refused_naming_sample_by_line(lines_txt):
    with pytest.raises(RecipeError, match=r"data\.sources\.0: reader 1 of 2 .* holds 1 usable document .* its records "
                                          r"are lines: set data\.sources\.0\.sample_by: line"):  # fmt: skip
        check_readers(recipe_reading(lines_txt), world_size=2)
    check_readers(recipe_reading(lines_txt), world_size=1)  # one reader: the one paragraph is its document
    check_readers(recipe_reading(lines_txt, "data.sources.0.sample_by=line"), world_size=2)


def test_workers_are_readers_too(lines_txt):
    by_line = recipe_reading(lines_txt, "data.sources.0.sample_by=line")
    check_readers(by_line, world_size=6)
    with pytest.raises(RecipeError, match=r"reader 6 of 12 \(6 ranks x 2 readers each\) .* holds 6 usable documents"):
        check_readers(recipe_reading(lines_txt, "data.sources.0.sample_by=line", "data.num_workers=2"), world_size=6)


def test_a_reader_whose_records_are_all_broken_is_refused(tmp_path):
    """Records are dealt in turn: with every odd record broken, reader 1 of 2 gets only broken ones."""
    path = tmp_path / "halfbad.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" if i % 2 == 0 else "{not json\n"
                            for i in range(8)))  # fmt: skip
    check_readers(recipe_reading(path), world_size=1)
    with pytest.raises(RecipeError, match=r"reader 1 of 2 .* add records, or train on fewer ranks"):
        check_readers(recipe_reading(path), world_size=2)


def test_the_dry_run_makes_the_check(lines_txt, tmp_path, capsys):
    argv = ["train", str(TINY), "--dry-run", "--nproc", "2", f"train.output_dir={tmp_path / 'run'}",
            f"data.sources=[{{path: {lines_txt}}}]"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "set data.sources.0.sample_by: line" in capsys.readouterr().err


def test_a_run_that_meets_it_anyway_names_the_fix_too(lines_txt):
    """A source changed after the checks, or a launch without them (launch/*.sh): the rank's error says the same."""
    stream = SourceStream(SourceConfig(path=str(lines_txt)), shard=1, num_shards=2, cycle=True, skipped=Counter())
    with pytest.raises(DataError, match=r"reader 1 of 2 no usable document .* if its records are lines, set "
                                        r"sample_by: line"):  # fmt: skip
        stream.next_document()


def test_whole_files_are_counted_not_read(tmp_path):
    """`sample_by: document`: one document a file; a reader past the written files has none."""
    for name, text in (("a.txt", "12 plus 30 is 42"), ("b.txt", "7 times 6 is 42")):
        (tmp_path / name).write_text(text)
    recipe = load_recipe(TINY, [f"data.sources=[{{path: {tmp_path}, format: txt, sample_by: document}}]",
                                "data.validation=[]", "train.eval_every_steps=null"])  # fmt: skip
    check_readers(recipe, world_size=2)
    with pytest.raises(RecipeError, match=r"reader 2 of 3 .* holds 2 usable documents for 3 readers"):
        check_readers(recipe, world_size=3)
