"""Hub datasets listed once per run, and read by every reader from that one list.

Were each reader to call `load_dataset(name, streaming=True)`, a run would list the dataset once per reader (64
ranks x 2 workers: 128 listings of the repository at start, which the hub answers with HTTP 429 sooner or later).
Instead rank 0 lists (`load_dataset_builder`, which resolves the split's files at the dataset's current commit, or
at the source's `hub_revision`) and broadcasts the list; every reader then opens the files through the dataset's
packaged builder (`parquet`, `json`, ...) given the resolved `DataFilesList`, which `datasets` takes as it is,
without listing again. Which files a reader reads is `sources.SourceStream`'s business (whole files when there are
at least as many files as readers).

The files' URLs name the commit they were listed at (`hf://datasets/<name>@<commit>/...`), so a reader's position
holds exactly as long as the list does; a resume checks that it has not changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from ntl_pretrain.data.errors import DataError, reading_errors

if TYPE_CHECKING:
    from ntl_pretrain.data.source_config import SourceConfig

# Builder-config fields that say where the data is, not how to read it; every other field set by the dataset card
# (a parquet `columns`, a csv `sep`, a json `field`) travels with the list.
LOCATION_FIELDS = {"name", "version", "data_dir", "data_files", "description", "features"}


@dataclass(frozen=True)
class HubListing:
    """One hub source's split: the packaged builder that reads it and its files, in the hub's order."""

    builder: str
    files: tuple[str, ...]
    origin_metadata: tuple = ()
    """Per file, what `datasets` keys its caches by (an etag); passed back with the files."""
    config_kwargs: dict = field(default_factory=dict)
    features: object | None = None
    """`datasets.Features` from the dataset card, when it declares them."""

    @property
    def digest(self) -> str:
        """Names the list: equal digests, the same files at the same commit."""
        return hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]

    @property
    def revision(self) -> str | None:
        """The commit the files were listed at (None for a local folder)."""
        found = re.search(r"@([^/]+)/", self.files[0]) if self.files else None
        return found.group(1) if found else None

    def open(self):
        """A streaming `IterableDataset` over every file; nothing is read until it is iterated."""
        from datasets import load_dataset
        from datasets.data_files import DataFilesList

        metadata = list(self.origin_metadata) or [None] * len(self.files)
        data_files = {"train": DataFilesList(list(self.files), metadata)}
        return load_dataset(self.builder, data_files=data_files, split="train", streaming=True,
                            features=self.features, **self.config_kwargs)  # fmt: skip


def listing_key(source: SourceConfig) -> tuple:
    return (source.path, source.hub_config, source.hub_split, source.hub_revision)


def list_source(source: SourceConfig) -> HubListing:
    """The one listing of `source`'s split (network: the hub's API)."""
    from datasets import load_dataset_builder

    builder = load_dataset_builder(source.path, source.hub_config, revision=source.hub_revision)
    splits = builder.config.data_files or {}
    if not splits.get(source.hub_split):
        raise ValueError(f"no data files for split {source.hub_split!r} (the dataset has {sorted(splits)})")
    files = splits[source.hub_split]
    config = builder.config
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in LOCATION_FIELDS}
    defaults = {f.name: getattr(type(config)(), f.name) for f in fields(config) if f.name in kwargs}
    listing = HubListing(
        builder=builder.name,
        files=tuple(files),
        origin_metadata=tuple(getattr(files, "origin_metadata", ())),
        config_kwargs={name: value for name, value in kwargs.items() if value != defaults[name]},
        features=builder.info.features,
    )
    if listing.features is None:
        # Without them every reader would open the first file to read its schema (a parquet footer); read once here.
        listing = dataclasses.replace(listing, features=listing.open().features)
    return listing


def hub_sources(sources: Iterable[SourceConfig]) -> list[SourceConfig]:
    return [source for source in sources if source.format == "hub"]


def list_once(sources: Iterable[SourceConfig]) -> dict[tuple, HubListing]:
    """Every hub source listed by this process (each distinct source once); `ValueError` naming the source."""
    listings: dict[tuple, HubListing] = {}
    for source in hub_sources(sources):
        if listing_key(source) not in listings:
            with reading_errors(source, source.path):
                listings[listing_key(source)] = list_source(source)
    return listings


def list_for_all_ranks(sources: Iterable[SourceConfig], group=None) -> dict[tuple, HubListing]:
    """`list_once` on rank 0, broadcast to every rank of `group` (a listing can take minutes: give a group with a
    long timeout). A failure on rank 0 is raised on every rank, so that none waits for a list that never comes."""
    import torch.distributed as dist

    sources = hub_sources(sources)
    if not sources:
        return {}
    if not dist.is_initialized():
        return list_once(sources)
    message: list = [None]
    if dist.get_rank() == 0:
        try:
            message = [list_once(sources)]
        except DataError as error:
            message = [error.one_line()]
    dist.broadcast_object_list(message, src=0, group=group)
    if isinstance(message[0], str):
        raise DataError(message[0])
    return message[0]
