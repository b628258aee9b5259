"""Sources: formats, bad records, start-up errors, reader sharding and cursor resume."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ntl_pretrain.data import DataConfig, SourceConfig, validate_sources
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.data.sources import SourceStream


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def jsonl_docs(n: int, prefix: str = "doc") -> list[bytes]:
    return [json.dumps({"text": f"{prefix} {i}", "id": i}).encode() for i in range(n)]


def read_all(source: SourceConfig, shard: int = 0, num_shards: int = 1) -> tuple[list[str], Counter]:
    skipped: Counter = Counter()
    stream = SourceStream(source, shard, num_shards, cycle=False, skipped=skipped)
    return list(iter(stream.next_document, None)), skipped


def test_bad_records_are_skipped_and_counted(tmp_path):
    lines = [
        b'{"text": "good one"}',
        b'{"text": "broken',  # invalid JSON
        b'{"other": "x"}',  # missing field
        b'{"text": 42}',  # not a string
        b'{"text": "   "}',  # empty document
        b'{"text": "caf\xff"}',  # invalid UTF-8
        b"[1, 2]",  # not a record
        b"",  # blank line: a separator, not a record
        b'{"text": "good two"}',
    ]
    source = SourceConfig(path=str(write_lines(tmp_path / "mixed.jsonl", lines)))
    documents, skipped = read_all(source)
    assert documents == ["good one", "good two"]
    assert skipped == Counter(invalid_json=1, missing_field=1, not_string=1, empty=1, invalid_utf8=1, not_a_record=1)


def test_template_renders_fields(tmp_path):
    lines = [b'{"question": "What is 2 + 3?", "answer": "5"}', b'{"question": "Q only"}']
    source = SourceConfig(path=str(write_lines(tmp_path / "qa.jsonl", lines)), template="{question} {answer}")
    documents, skipped = read_all(source)
    assert documents == ["What is 2 + 3? 5"]
    assert skipped == Counter(missing_field=1)


@pytest.mark.parametrize(
    ("sample_by", "expected"),
    [
        ("line", ["a b\n", "c\n", "d\n"]),
        ("paragraph", ["a b\nc\n", "d\n"]),
        ("document", ["a b\nc\n\nd\n"]),
    ],
)
def test_txt_units(tmp_path, sample_by, expected):
    path = tmp_path / "book.txt"
    path.write_text("a b\nc\n\nd\n")
    documents, _ = read_all(SourceConfig(path=str(path), sample_by=sample_by))
    assert documents == expected


def test_txt_invalid_utf8_paragraph_is_skipped(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"fine\n\nbad \xc3\x28 byte\n\nalso fine\n")
    documents, skipped = read_all(SourceConfig(path=str(path)))
    assert documents == ["fine\n", "also fine\n"]
    assert skipped == Counter(invalid_utf8=1)


def test_gzip_glob_and_folder_sources(tmp_path):
    (tmp_path / "shards").mkdir()
    with gzip.open(tmp_path / "shards" / "b.jsonl.gz", "wb") as out:
        out.write(b"\n".join(jsonl_docs(2, "b")) + b"\n")
    write_lines(tmp_path / "shards" / "a.jsonl", jsonl_docs(2, "a"))
    expected = ["a 0", "a 1", "b 0", "b 1"]  # files in sorted order
    assert read_all(SourceConfig(path=str(tmp_path / "shards" / "*.jsonl*")))[0] == expected
    assert read_all(SourceConfig(path=str(tmp_path / "shards")))[0] == expected


def test_hf_formats_parquet_arrow_json_array(tmp_path):
    texts = [f"row {i}" for i in range(7)]
    table = pa.table({"text": texts, "n": list(range(7))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "t.json").write_text(json.dumps([{"text": text} for text in texts]))
    for name in ("t.parquet", "t.arrow", "t.json"):
        assert read_all(SourceConfig(path=str(tmp_path / name)))[0] == texts, name


def test_missing_file_and_unknown_format_fail_at_start_naming_the_path(tmp_path):
    (tmp_path / "data.csv").write_text("text\nx\n")
    good = SourceConfig(path=str(write_lines(tmp_path / "ok.jsonl", jsonl_docs(1))))
    missing = DataConfig(sources=[good, SourceConfig(path=str(tmp_path / "nope.jsonl"))])
    with pytest.raises(ValueError, match=r"sources\.1\.path: no file matches .*nope\.jsonl"):
        validate_sources(missing)
    unknown = DataConfig(sources=[good], validation=[SourceConfig(path=str(tmp_path / "data.csv"))])
    with pytest.raises(ValueError, match=r"validation\.0\.path: cannot tell the format of .*data\.csv"):
        validate_sources(unknown)
    with pytest.raises(ValueError, match="sources: at least one"):
        validate_sources(DataConfig())


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_shards_are_disjoint_and_complete(tmp_path, num_shards, fmt):
    texts = [f"doc {i}" for i in range(40)]
    if fmt == "jsonl":
        lines = jsonl_docs(40)
        lines[5] = b"{broken"  # bad records still take their turn in the rotation
        path = write_lines(tmp_path / "d.jsonl", lines)
        texts.remove("doc 5")
    else:
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=7)
    results = [read_all(SourceConfig(path=str(path)), shard, num_shards) for shard in range(num_shards)]
    seen = [text for documents, _ in results for text in documents]
    assert sorted(seen) == sorted(texts)
    assert len(set(seen)) == len(seen)
    records = [len(documents) + skipped.total() for documents, skipped in results]
    # jsonl: record k to reader k mod n; parquet (fewer files than readers): row group k (7 records) to reader k mod n
    assert max(records) - min(records) <= (1 if fmt == "jsonl" else 7)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_cursor_resumes_exactly_twice_across_epochs(tmp_path, fmt):
    texts = [f"doc {i}" for i in range(11)]
    if fmt == "jsonl":
        path = write_lines(tmp_path / "d.jsonl", jsonl_docs(11))
    else:
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    source = SourceConfig(path=str(path))

    def stream() -> SourceStream:
        return SourceStream(source, shard=1, num_shards=2, cycle=True, skipped=Counter())

    reference = stream()
    expected = [reference.next_document() for _ in range(20)]
    mine = texts[1::2] if fmt == "jsonl" else texts[4:8]  # every other record; row group 1 of 3 (pieces.py)
    assert expected[: len(mine)] == mine and expected[len(mine) : 2 * len(mine)] == mine  # epochs cycle
    resumed, got = stream(), []
    for stop in (3, 8, 20):  # checkpoint, restart in a fresh object, twice (mid-epoch and across epochs)
        got += [resumed.next_document() for _ in range(stop - len(got))]
        state = resumed.state_dict()
        resumed = stream()
        resumed.load_state_dict(state)
    assert got == expected
    assert resumed.state_dict()["epoch"] == 20 // len(mine) - 1


def test_too_few_records_for_the_readers_is_an_error(tmp_path):
    source = SourceConfig(path=str(write_lines(tmp_path / "one.jsonl", jsonl_docs(1))))
    stream = SourceStream(source, shard=1, num_shards=2, cycle=True, skipped=Counter())
    with pytest.raises(DataError, match="too few valid records"):
        stream.next_document()


def test_recipe_naming_a_missing_source_fails_at_load(tmp_path):
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.config.recipe import RecipeError

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {model_type: llama}\ntokenizer: {path: tok}\n"
        f"data:\n  sources:\n    - {{path: {tmp_path / 'absent.jsonl'}}}\n"
    )
    with pytest.raises(RecipeError, match=r"r\.yaml: data\.sources\.0\.path: no file matches .*absent\.jsonl"):
        load_recipe(recipe)
