"""Damaged or mislabelled files: one line naming the file and the cause, from the recipe check, `data preview`
and a running reader; BOM and zstd files read."""

from __future__ import annotations

import bz2
import gzip
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from ntl_pretrain.cli import main as cli_main
from ntl_pretrain.data import DataConfig, SourceConfig, validate_sources
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.data.probe import PROBE_BYTES
from ntl_pretrain.data.sources import SourceStream

REPO = Path(__file__).resolve().parent.parent
RECORDS = b"".join(json.dumps({"text": f"document {i}", "id": i}).encode() + b"\n" for i in range(200))


def truncated(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


# (case, file name, content, source keys, cause the message must state)
CASES = [
    ("truncated gzip", "a.jsonl.gz", truncated(gzip.compress(RECORDS)), {}, "truncated or corrupt gzip file"),
    ("corrupt bz2", "a.jsonl.bz2", b"BZh9" + bytes(range(256)) * 4, {}, "truncated or corrupt bz2 file"),
    ("truncated zstd", "a.jsonl.zst", truncated(zstandard.compress(RECORDS)), {}, "truncated or corrupt zstd file"),
    ("malformed JSON array", "a.json", b'[{"text": "one"}, {"text": "two"', {}, "malformed JSON array"),
    ("empty file", "a.jsonl", b"", {}, "empty file"),
    ("blank file", "a.jsonl", b"\n  \n\n", {}, "empty file"),
    (
        "no text field",
        "a.jsonl",
        b'{"body": "x", "id": 1}\n{"body": "y", "id": 2}\n',
        {},
        r"none of the first 2 records has all of the fields 'text'; the records have fields \['body', 'id'\]",
    ),
    (
        "no template fields",
        "a.jsonl",
        b'{"q": "1+1=", "a": "2"}\n',
        {"template": "{question} {answer}"},
        r"has all of the fields 'question', 'answer'; the records have fields \['a', 'q'\]",
    ),
    (
        "gzip named .jsonl",
        "a.jsonl",
        gzip.compress(RECORDS),
        {},
        "gzip-compressed, but its name does not say so; name it a.jsonl.gz",
    ),
    ("plain named .gz", "a.jsonl.gz", RECORDS, {}, "named .gz but it is not gzip-compressed"),
    ("bz2 named .gz", "a.jsonl.gz", bz2.compress(RECORDS), {}, "named .gz but its content is bz2"),
    ("text named .jsonl", "a.jsonl", b"Plain prose.\nMore prose.\n", {}, "is valid UTF-8 JSON; is it JSON lines"),
    ("parquet named .jsonl", "a.jsonl", None, {}, "a parquet file read as jsonl"),
    (
        "parquet without the field",
        "a.parquet",
        None,
        {"text_field": "body"},
        r"no column 'body'; the columns are \['text'\]",
    ),
    ("truncated parquet", "a.parquet", b"PAR1" + bytes(100), {}, "not a readable parquet file"),
]


def write_case(folder: Path, name: str, content: bytes | None) -> Path:
    """`content` None: a parquet file with a `text` column."""
    path = folder / name
    if content is None:
        pq.write_table(pa.table({"text": ["a", "b"]}), path)
    else:
        path.write_bytes(content)
    return path


MISSING_FIELDS = ("has all of the fields", "no column")  # the causes that are the field keys' fault


def preview_recipe(folder: Path, source: dict) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    recipe["data"]["sources"], recipe["data"]["validation"] = [source], []
    recipe["train"]["eval_every_steps"] = None  # no validation sources, so no validation cadence
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize(("name", "content", "keys", "cause"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_damaged_file_fails_the_check_and_preview_in_one_line(tmp_path, capsys, name, content, keys, cause):
    """Blamed on `path`, or on the key naming the fields when the records lack them (an override of that key is
    then blamed, not the file that set the path: tests/test_recipe_input.py)."""
    path = write_case(tmp_path, name, content)
    lacks_fields = any(words in cause for words in MISSING_FIELDS)
    key = ("template" if "template" in keys else "text_field") if lacks_fields else "path"
    with pytest.raises(ValueError, match=rf"sources\.0\.{key}: .*{path.name}.*{cause}") as error:
        validate_sources(DataConfig(sources=[SourceConfig(path=str(path), **keys)]))
    assert "\n" not in str(error.value)
    recipe = preview_recipe(tmp_path, {"path": str(path), **keys})
    assert cli_main(["data", "preview", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err and f"data.sources.0.{key}" in err


def long_jsonl_gz(folder: Path) -> Path:
    """Over 1 MB of records before the truncation, so the start-up probe reads only sound records."""
    rng = random.Random(0)
    lines = [json.dumps({"text": "".join(rng.choices("abcdef0123456789 ", k=200))}) for _ in range(8_000)]
    data = gzip.compress("\n".join(lines).encode())
    assert len(data) * 0.9 > PROBE_BYTES / 2  # random text compresses about 2x: the sound part exceeds the probe
    path = folder / "late.jsonl.gz"
    path.write_bytes(data[: int(len(data) * 0.9)])
    return path


READ_ALL = ("data.shuffle_buffer=100000", "data.shuffle_buffer_tokens=100000000")  # fill the buffer to the end


def test_truncation_past_the_probe_stops_the_reader_and_preview_naming_the_file(tmp_path, capsys):
    path = long_jsonl_gz(tmp_path)
    source = SourceConfig(path=str(path), name="late")
    validate_sources(DataConfig(sources=[source]))
    stream = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped={})
    with pytest.raises(DataError, match=rf"^source 'late': {path}: truncated or corrupt gzip file \(EOFError"):
        list(iter(stream.next_document, None))
    recipe = preview_recipe(tmp_path, {"path": str(path), "name": "late"})
    assert cli_main(["data", "preview", str(recipe), *READ_ALL, "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ntl-pretrain data preview: data error: source 'late'") and len(err.splitlines()) == 1, err


def test_bom_is_stripped_and_zstd_reads_like_plain(tmp_path):
    documents = [f"document {i}" for i in range(200)]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + RECORDS)
    (tmp_path / "bom.txt").write_bytes("\ufefffirst line\nsecond line\n".encode())
    compressor = zstandard.ZstdCompressor()
    half = len(RECORDS) // 2 + RECORDS[len(RECORDS) // 2 :].index(b"\n") + 1
    (tmp_path / "two_frames.jsonl.zst").write_bytes(
        compressor.compress(RECORDS[:half]) + compressor.compress(RECORDS[half:])
    )
    for name, expected in (
        ("bom.jsonl", documents),
        ("bom.txt", ["first line\n", "second line\n"]),
        ("two_frames.jsonl.zst", documents),
    ):
        source = SourceConfig(path=str(tmp_path / name), **({"sample_by": "line"} if name.endswith(".txt") else {}))
        validate_sources(DataConfig(sources=[source]))
        skipped: Counter = Counter()
        stream = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=skipped)
        assert list(iter(stream.next_document, None)) == expected and not skipped, name


def test_zstd_cursor_resumes_in_the_middle_of_the_file(tmp_path):
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.compress(RECORDS))
    source = SourceConfig(path=str(tmp_path / "a.jsonl.zst"))
    first = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=Counter())
    head = [first.next_document() for _ in range(77)]
    resumed = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=Counter())
    resumed.load_state_dict(first.state_dict())
    assert head + list(iter(resumed.next_document, None)) == [f"document {i}" for i in range(200)]


@pytest.mark.slow
def test_a_rank_without_usable_records_ends_the_whole_job_naming_the_source(tmp_path):
    """A parquet file of one row, on 2 ranks: rank 1's share is empty. The dry run does not read parquet (its line
    files it does: tests/test_preflight_data.py), so the rank finds it after launch. It stops with one line naming the
    source, the launcher ends the job (no rank left waiting in a collective), and `ntl-pretrain train` exits 2, as for
    any refused input, with that line last (not gloo's or DeepSpeed's), and no lock left beside the folder. The job
    died before its first step: the output folder is as it was (an earlier recipe.yaml kept, no empty metrics.jsonl),
    but for rank 0's log of the libraries' lines while it started (train/main.py, `library_log`), so the same command
    can run again."""
    source = tmp_path / "one.parquet"
    pq.write_table(pa.table({"text": ["the only record holds the number 7."]}), source)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text("# an earlier recipe\n")
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(REPO / "recipes" / "tiny-cpu.yaml"), "--nproc",
               "2", f"data.sources=[{{name: one, path: {source}}}]", "data.validation=[]",
               "train.eval_every_steps=null", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=20",
               "logging.progress_bar=false"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("ntl-pretrain: rank 1: data error: source 'one'") and "no usable document" in last, last
    assert done.stderr.count("data error") == 1 and len(last) <= 300, done.stderr[-3000:]  # the supervisor says it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.parquet", "run"]  # no run.lock beside the folder
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["logs", "recipe.yaml"]
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["libraries-rank0.log", "supervisor.log"]
    assert "rank 1: data error: source 'one'" in (tmp_path / "run" / "logs" / "supervisor.log").read_text()
    assert (tmp_path / "run" / "recipe.yaml").read_text() == "# an earlier recipe\n"
