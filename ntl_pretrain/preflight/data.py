"""Pre-flight of the data at the planned world size: every training source gives every reader a document.

A reader is one data-parallel rank, or one of its `data.num_workers` workers; the readers share a source's records
in turn (data/sources.py). A source with fewer usable records than readers leaves a reader without any, which the
run finds only after launch, on one rank, once every rank has imported torch and built the model ("a whole epoch
gave reader 1 of 2 no usable document"). Here each reader reads its own share until its first document: a few
records each, at any world size (a txt source of one document a file is counted by its files' sizes, not read).
Line files (jsonl, json lines, txt) on this machine are read; parquet, arrow, remote files and hub datasets are not
(their shares are whole files or row groups, and reading them needs `datasets` or the network).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.data.files import is_remote, resolve_files, source_format
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.data.sources import SourceStream


def check_readers(recipe: Recipe, world_size: int) -> None:
    workers = max(1, recipe.data.num_workers)
    readers = world_size * workers
    for index, source in enumerate(recipe.data.sources):
        if not read_here(source):
            continue
        empty = reader_without_document(source, readers)
        if empty is not None:
            who = f"{world_size} ranks x {workers} reader{'s' if workers > 1 else ''} each"
            raise RecipeError(f"data.sources.{index}: reader {empty} of {readers} ({who}) gets no usable document "
                              f"from {source.path}: {_why(source, readers, index)}")  # fmt: skip


def read_here(source: SourceConfig) -> bool:
    """A local line file."""
    if source.format == "hub" or is_remote(source.path):
        return False
    return not SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=Counter()).reads_through_datasets()


def reader_without_document(source: SourceConfig, readers: int) -> int | None:
    """The first reader whose share of one epoch holds no usable document; None when every reader has one."""
    if whole_files(source):
        written = _written_files(source)
        return None if written >= readers else written
    for reader in range(readers):
        stream = SourceStream(source, shard=reader, num_shards=readers, cycle=False, skipped=Counter())
        if stream.next_document() is None:
            return reader
    return None


def _why(source: SourceConfig, readers: int, index: int) -> str:
    """How many documents the source holds, and the fix when its records are lines read by paragraph or file."""
    held = _documents(source, readers)
    found = f"the source holds {held} usable document{'s' if held != 1 else ''} for {readers} readers"
    if source_format(source, resolve_files(source)[0]) == "txt" and source.sample_by != "line":
        by_line = dataclasses.replace(source, sample_by="line")
        if reader_without_document(by_line, readers) is None:
            return (f"{found} (sample_by: {source.sample_by} makes each {source.sample_by} one document); its records "
                    f"are lines: set data.sources.{index}.sample_by: line")  # fmt: skip
    return f"{found}; add records, or train on fewer ranks or data.num_workers"


def _documents(source: SourceConfig, at_most: int) -> int:
    if whole_files(source):
        return min(at_most, _written_files(source))
    stream = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=Counter())
    return sum(1 for _ in zip(range(at_most), iter(stream.next_document, None), strict=False))


def whole_files(source: SourceConfig) -> bool:
    """A txt source of one document a file: its files' sizes tell what reading them whole would."""
    return source.sample_by == "document" and source_format(source, resolve_files(source)[0]) == "txt"


def _written_files(source: SourceConfig) -> int:
    return sum(1 for file in resolve_files(source) if Path(file).stat().st_size)
