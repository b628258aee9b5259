"""Sources read below one file per reader (issue 41): parquet row groups and byte ranges of line files dealt to the
readers, so that R readers read about 1/R of the bytes each; every record once per epoch; an exact resume inside a
piece; a stream saved before pieces resumes as it was read.

Bytes are counted by wrapping `pieces.open_file` (every piece and footer is opened through it). A remote line file
is a `file://` URL (fsspec, as for https:// or s3://); the hub is a local folder read through `datasets`' listing.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_loader import through_checkpoint
from test_hub_data import documents

from ntl_pretrain.data import pieces
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.data.hub import list_once, listing_key
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.data.sources import SourceStream

READERS = 8


def record_text(file: int, index: int, rng: random.Random) -> str:
    """Incompressible (random hex), so that a file's bytes are its records' and shares of bytes mean something."""
    noise = "".join(rng.choice("0123456789abcdef") for _ in range(rng.randrange(80, 300)))
    return f"file {file} record {index} {noise}"


def write_parquet_hub(folder: Path, files: int = 2, records: int = 12_000) -> tuple[SourceConfig, list[str]]:
    """A dataset repository of `files` parquet files (~2 MB each, row groups of 500 rows); every record's text."""
    rng, texts = random.Random(0), []
    (folder / "data").mkdir(parents=True)
    for i in range(files):
        mine = [record_text(i, j, rng) for j in range(records)]
        pq.write_table(pa.table({"text": mine}), folder / "data" / f"train-{i}.parquet", row_group_size=500)
        texts += mine
    return SourceConfig(path=str(folder), format="hub"), texts


def write_jsonl(path: Path, records: int, file: int = 0) -> list[str]:
    """A jsonl file with a byte-order mark, blank lines and lines far longer than a piece."""
    rng = random.Random(file)
    texts = [record_text(file, j, rng) * (40 if j % 97 == 0 else 1) for j in range(records)]
    lines = [json.dumps({"text": text}) + ("\n\n" if j % 13 == 0 else "\n") for j, text in enumerate(texts)]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(lines).encode())
    return texts


class CountedOpens:
    """Bytes each `SourceStream` read through `pieces.open_file` while installed, keyed by the stream's shard."""

    def __init__(self, monkeypatch):
        self.bytes, self.shard = Counter(), None
        opened = pieces.open_file

        def counted(path):
            return CountingStream(opened(path), self)

        monkeypatch.setattr(pieces, "open_file", counted)


class CountingStream:
    def __init__(self, stream, counts: CountedOpens):
        self._stream, self._counts = stream, counts

    def read(self, size: int = -1) -> bytes:
        return self._counted(self._stream.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._counted(self._stream.readline(size))

    def _counted(self, data: bytes) -> bytes:
        self._counts.bytes[self._counts.shard] += len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def read_every_share(source: SourceConfig, counts: CountedOpens, **stream) -> list[list[str]]:
    shares = []
    for shard in range(READERS):
        counts.shard = shard
        shares.append(documents(SourceStream(source, shard, READERS, cycle=False, skipped=Counter(), **stream)))
    return shares


def test_two_parquet_files_at_eight_readers_read_a_quarter_of_the_bytes_each_and_every_record_once(
    tmp_path, monkeypatch
):
    source, texts = write_parquet_hub(tmp_path / "hub")
    listing = list_once([source])[listing_key(source)]
    dataset_bytes = sum(path.stat().st_size for path in (tmp_path / "hub" / "data").iterdir())
    counts = CountedOpens(monkeypatch)
    shares = read_every_share(source, counts, listing=listing)
    assert sorted(sum(shares, [])) == sorted(texts)  # every record once
    assert all(share for share in shares)
    assert max(counts.bytes.values()) <= dataset_bytes / 4, (dict(counts.bytes), dataset_bytes)
    # together about the dataset once, not the whole dataset per reader (every n-th record of the stream, before)
    assert sum(counts.bytes.values()) < 1.5 * dataset_bytes


def test_a_remote_line_file_is_read_by_byte_ranges_that_lose_and_repeat_no_line(tmp_path, monkeypatch):
    path = tmp_path / "corpus.jsonl"
    texts = write_jsonl(path, records=3_000)
    source = SourceConfig(path=f"file://{path}")
    counts = CountedOpens(monkeypatch)
    shares = read_every_share(source, counts)
    assert sorted(sum(shares, [])) == sorted(texts)  # the long lines, the BOM'd first line and blank lines included
    assert max(counts.bytes.values()) <= path.stat().st_size / 4, dict(counts.bytes)


@pytest.mark.parametrize("kind", ["parquet", "lines"])
def test_resume_inside_a_piece_is_exact_and_refused_when_the_files_changed(tmp_path, kind):
    if kind == "parquet":
        source, _ = write_parquet_hub(tmp_path / "hub", records=2_000)
        stream_args = {"listing": list_once([source])[listing_key(source)]}
    else:
        path = tmp_path / "corpus.jsonl"
        write_jsonl(path, records=2_000)
        source, stream_args = SourceConfig(path=f"file://{path}"), {}

    def stream() -> SourceStream:
        return SourceStream(source, 3, READERS, cycle=True, skipped=Counter(), **stream_args)

    share = len(documents(SourceStream(source, 3, READERS, cycle=False, skipped=Counter(), **stream_args)))
    whole = documents(stream(), share + 50)  # into the second epoch
    for cut_at in (1, 77, share - 1, share + 3):
        first = stream()
        head = documents(first, cut_at)
        resumed = stream()
        resumed.load_state_dict(through_checkpoint(first.state_dict()))
        assert head + documents(resumed, len(whole) - cut_at) == whole, cut_at
    assert first.state_dict()["cut"] is not None
    saved = {**first.state_dict(), "cut": "0" * 16}
    changed = stream()
    changed.load_state_dict(saved)
    with pytest.raises(DataError, match=r"its files changed since the checkpoint .*cut into pieces differs"):
        documents(changed, 1)


def test_a_stream_saved_before_pieces_resumes_by_every_nth_record(tmp_path):
    source, texts = write_parquet_hub(tmp_path / "hub", records=600)
    listing = list_once([source])[listing_key(source)]
    legacy = SourceStream(source, 1, 3, cycle=False, skipped=Counter(), listing=listing)
    legacy.load_state_dict({key: value for key, value in legacy.state_dict().items()
                            if key not in ("by_pieces", "cut", "piece")})  # fmt: skip
    read = documents(legacy)
    assert read == [text for position, text in enumerate(texts) if position % 3 == 1]


def test_too_few_pieces_for_the_readers_falls_back_to_every_nth_record(tmp_path):
    source, texts = write_parquet_hub(tmp_path / "hub", records=600)  # 2 files x 2 row groups: 4 pieces
    listing = list_once([source])[listing_key(source)]
    shares = [documents(SourceStream(source, k, 5, cycle=False, skipped=Counter(), listing=listing)) for k in range(5)]
    assert sorted(sum(shares, [])) == sorted(texts)
    assert all({text.split()[1] for text in share} == {"0", "1"} for share in shares)  # every reader reads both


def test_a_run_reading_pieces_resumes_on_another_number_of_ranks_with_the_same_batches(tmp_path, monkeypatch):
    """4 ranks read 2 local parquet files by row groups; saved after 2 optimizer steps and resumed on 3 ranks (and
    on 1), every later step holds the uninterrupted run's rows: the pieces are the streams', not the ranks'."""
    from test_resume_world_size import data_config, global_steps, loaders, resumed

    folder = tmp_path / "corpus"
    write_parquet_hub(folder, records=1_500)  # 2 files x 3 row groups: 6 pieces for 4 readers
    cfg = data_config()
    cfg.sources = [SourceConfig(path=str(folder / "data"))]
    cuts, cut = [], pieces.parquet_pieces
    monkeypatch.setattr(pieces, "parquet_pieces", lambda files: cuts.append(files) or cut(files))
    reference = global_steps(loaders(cfg, 4, 1), 5)
    saving = loaders(cfg, 4, 1)
    global_steps(saving, 2)
    states = [loader.state_dict() for loader in saving]
    assert cuts  # the streams read by pieces
    for world, micro_batch_size in ((3, 2), (1, 4)):
        for step, rows in enumerate(global_steps(resumed(cfg, states, world, micro_batch_size), 3), start=2):
            assert torch.equal(rows, reference[step]), (world, step)
