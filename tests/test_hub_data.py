"""Hub sources at many readers: one listing per run, whole files per reader, exact resume on the same list.

The "hub" is a local folder of parquet files read through the same `datasets` calls as a hub repository
(`load_dataset_builder` resolves its split's files; readers open them through the packaged parquet builder).
Listings are counted by patching `datasets.load_dataset_builder` and `DataFilesList.from_patterns` (how `datasets`
resolves file patterns); bytes by wrapping `datasets.streaming.xopen` (how a streaming builder opens its files).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections import Counter
from pathlib import Path

import datasets
import datasets.data_files
import datasets.streaming
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
from helpers.distributed import run_distributed
from test_data_loader import TINY, take, through_checkpoint

from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.data.hub import list_for_all_ranks, list_once, listing_key
from ntl_pretrain.data.sources import SourceStream

RECORDS_PER_FILE = 12


def write_hub_folder(folder: Path, files: int) -> SourceConfig:
    """A dataset repository's layout (`data/train-*.parquet`); record `j` of file `i` reads "file i record j"."""
    (folder / "data").mkdir(parents=True)
    for i in range(files):
        texts = [f"file {i} record {j} costs {i * 100 + j} yen" for j in range(RECORDS_PER_FILE)]
        pq.write_table(pa.table({"text": texts}), folder / "data" / f"train-{i:05d}-of-{files:05d}.parquet",
                       row_group_size=5)  # fmt: skip
    return SourceConfig(path=str(folder), format="hub")


class Reads:
    """Listings made and bytes read per file, by this process, while installed."""

    def __init__(self, monkeypatch, log: Path | None = None):
        self.listings, self.bytes, self.log = 0, Counter(), log
        builder, resolve, xopen = datasets.load_dataset_builder, datasets.data_files.DataFilesList.from_patterns, (
            datasets.streaming.xopen)  # fmt: skip

        def counted_builder(*args, **kwargs):
            self._listed()
            return builder(*args, **kwargs)

        def counted_resolve(*args, **kwargs):
            self._listed()
            return resolve(*args, **kwargs)

        def counted_open(file, *args, **kwargs):
            return CountingFile(xopen(file, *args, **kwargs), Path(str(file)).name, self)

        monkeypatch.setattr(datasets, "load_dataset_builder", counted_builder)
        monkeypatch.setattr(datasets.data_files.DataFilesList, "from_patterns", staticmethod(counted_resolve))
        monkeypatch.setattr(datasets.streaming, "xopen", counted_open)

    def _listed(self) -> None:
        self.listings += 1
        if self.log is not None:
            with open(self.log / f"listings-{os.getpid()}", "a") as out:
                out.write("1\n")

    def read(self, name: str, count: int) -> None:
        self.bytes[name] += count
        if self.log is not None:
            with open(self.log / f"bytes-{os.getpid()}", "a") as out:
                out.write(f"{name} {count}\n")


class CountingFile:
    def __init__(self, file, name: str, reads: Reads):
        self._file, self._name, self._reads = file, name, reads

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._reads.read(self._name, len(data))
        return data

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def documents(stream: SourceStream, count: int | None = None) -> list[str]:
    read = iter(stream.next_document, None)
    return list(read) if count is None else [next(read) for _ in range(count)]


def file_of(document: str) -> int:
    return int(document.split()[1])


def test_one_listing_and_whole_files_per_reader(tmp_path, monkeypatch) -> None:
    source = write_hub_folder(tmp_path / "hub", files=7)
    reads = Reads(monkeypatch)
    listing = list_once([source, source])[listing_key(source)]  # a source listed twice is listed once
    assert reads.listings == 2  # load_dataset_builder, and its resolution of the split's file pattern
    assert [Path(file).name for file in listing.files] == sorted(os.listdir(tmp_path / "hub" / "data"))
    reads.listings, reads.bytes = 0, Counter()

    readers, epoch = 3, []
    for shard in range(readers):
        reads.bytes.clear()
        read = documents(SourceStream(source, shard, readers, cycle=False, skipped=Counter(), listing=listing))
        mine = {f"train-{i:05d}-of-00007.parquet" for i in range(shard, 7, readers)}
        assert {file_of(text) for text in read} == {int(name[6:11]) for name in mine}  # files k, k+3, k+6
        # Bytes are asserted in the two-rank test below (fresh processes): here `datasets` may already have bound
        # its parquet module to the unpatched opener in an earlier test of this session, and then counts nothing.
        if reads.bytes:
            assert set(reads.bytes) == mine  # reads no other file, not even a footer
        epoch += read
    assert reads.listings == 0  # no reader lists
    assert sorted(epoch) == sorted(f"file {i} record {j} costs {i * 100 + j} yen" for i in range(7)
                                   for j in range(RECORDS_PER_FILE))  # fmt: skip


def test_fewer_files_than_readers_read_row_groups_dealt_in_turn(tmp_path) -> None:
    """2 files of 3 row groups (5, 5 and 2 records) at 3 readers: row group k of the 6 goes to reader k mod 3
    (tests/test_data_pieces.py counts the bytes)."""
    source = write_hub_folder(tmp_path / "hub", files=2)
    listing = list_once([source])[listing_key(source)]
    shares = [documents(SourceStream(source, k, 3, cycle=False, skipped=Counter(), listing=listing)) for k in range(3)]
    groups = [[(i, j) for j in range(g * 5, min(g * 5 + 5, RECORDS_PER_FILE))] for i in range(2) for g in range(3)]
    for reader, share in enumerate(shares):
        mine = [record for group in groups[reader::3] for record in group]
        assert share == [f"file {i} record {j} costs {i * 100 + j} yen" for i, j in mine]


def test_resume_is_exact_and_refused_when_the_files_changed(tmp_path) -> None:
    source = write_hub_folder(tmp_path / "hub", files=5)
    listing = list_once([source])[listing_key(source)]

    def stream(**kwargs) -> SourceStream:
        return SourceStream(source, 1, 2, cycle=True, skipped=Counter(), **{"listing": listing, **kwargs})

    whole = documents(stream(), 2 * RECORDS_PER_FILE + 5)
    first = stream()
    head = documents(first, 7)
    resumed = stream()
    resumed.load_state_dict(through_checkpoint(first.state_dict()))
    assert head + documents(resumed, len(whole) - 7) == whole  # across a file and an epoch boundary
    assert resumed.state_dict()["listed_at"] is None and resumed.state_dict()["listing"] == listing.digest

    changed = dataclasses.replace(listing, files=listing.files[:-1])
    with pytest.raises(DataError, match=r"hub dataset's files are not the ones the checkpoint was reading"):
        stream(listing=changed).load_state_dict(first.state_dict())
    pinned = dataclasses.replace(listing, files=tuple(f.replace(str(tmp_path), "hf://datasets/o/d@abc123") for f in
                                                      listing.files))  # fmt: skip
    saved = {**first.state_dict(), "listed_at": "abc123", "listing": pinned.digest}
    with pytest.raises(DataError, match=r"listed at abc123.*set hub_revision: abc123 on this source"):
        stream().load_state_dict(saved)


def test_a_stream_saved_before_whole_files_resumes_the_way_it_was_sharded(tmp_path) -> None:
    """A state without `whole_files` was written when HF's `split_dataset_by_node` chose the sharding: with 5 files
    for 2 readers it kept every other record, and a resume of it must continue that way."""
    source = write_hub_folder(tmp_path / "hub", files=5)
    listing = list_once([source])[listing_key(source)]
    legacy = SourceStream(source, 1, 2, cycle=False, skipped=Counter(), listing=listing)
    legacy.load_state_dict({key: value for key, value in legacy.state_dict().items() if key != "whole_files"})
    read = documents(legacy)
    assert len(read) == 5 * RECORDS_PER_FILE // 2 and {file_of(text) for text in read} == set(range(5))


def test_hub_revision_is_only_for_hub_sources(tmp_path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="hub_revision: only for format: hub"):
        SourceConfig(path=str(tmp_path / "a.jsonl"), hub_revision="main").check()


def _list_on_two_ranks(hub: str, log: str, missing: str) -> None:
    # A launched rank's DataLoader forks its workers (Linux); this rank, made by `mp.spawn`, would spawn them,
    # and a spawned worker would not have the counting patches.
    multiprocessing.set_start_method("fork", force=True)
    monkeypatch = pytest.MonkeyPatch()
    Reads(monkeypatch, Path(log))
    (Path(log) / f"rank-{os.getpid()}").touch()  # its reads are rank 0's listing, not a reader's
    source = SourceConfig(path=hub, format="hub")
    listings = list_for_all_ranks([source], group=None)
    assert [Path(f).name for f in listings[listing_key(source)].files] == sorted(os.listdir(Path(hub) / "data"))
    cfg = DataConfig(sources=[source], seq_len=16, num_workers=2, shuffle_buffer=8)
    loader = build_dataloader(cfg, TINY, micro_batch_size=2, dp_rank=dist.get_rank(), dp_world_size=2, seed=3,
                              hub_listings=listings)  # fmt: skip
    take(loader, 6)
    bad = SourceConfig(path=missing, format="hub")
    with pytest.raises(DataError, match=f"source '{missing}'"):
        list_for_all_ranks([bad])  # rank 0's failure, raised on every rank
    monkeypatch.undo()


def test_two_ranks_with_two_workers_list_once_and_read_disjoint_files(tmp_path) -> None:
    write_hub_folder(tmp_path / "hub", files=6)
    log = tmp_path / "log"
    log.mkdir()
    run_distributed(_list_on_two_ranks, 2, str(tmp_path / "hub"), str(log), str(tmp_path / "no-such-dataset"))
    listed_by = list(log.glob("listings-*"))
    # Only rank 0 lists: the builder and its pattern for the dataset, the builder alone for the missing one.
    assert len(listed_by) == 1 and len(listed_by[0].read_text().split()) == 2 + 1
    ranks = {path.name.split("-")[1] for path in log.glob("rank-*")}
    readers = [{line.split()[0] for line in path.read_text().splitlines()} for path in log.glob("bytes-*")
               if path.name.split("-")[1] not in ranks]  # fmt: skip
    # 4 readers (2 ranks x 2 workers) over 6 files: each reads its own 1 or 2 files and no other
    assert len(readers) == 4 and sum(len(files) for files in readers) == 6
    assert set().union(*readers) == {f"train-{i:05d}-of-00006.parquet" for i in range(6)}
