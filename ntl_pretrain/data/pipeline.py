"""One reader's pipeline: sources -> mixture -> batched tokenisation -> shuffle -> pack -> micro-batches.

A reader runs in one process (the training process or one DataLoader worker) and owns all of its state,
so `state_dict()` taken between two batches restarts the reader at exactly the next batch.
Shapes: B micro-batch rows, T = seq_len.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.counters import EPOCH_PREFIX, source_key, zero_counters
from ntl_pretrain.data.encoding import DocumentEncoder, read_batch
from ntl_pretrain.data.hub import HubListing, listing_key
from ntl_pretrain.data.mixture import Mixture
from ntl_pretrain.data.packing import Packer, make_batch
from ntl_pretrain.data.shuffle import ShuffleBuffer
from ntl_pretrain.data.sources import QAText, SourceStream

Batch = dict[str, torch.Tensor]


def reader_seed(seed: int, reader: int, purpose: str) -> str:
    """String seeds: `random.Random` hashes them with SHA-512, stable across processes and runs."""
    return f"ntl_pretrain/{purpose}/seed={seed}/reader={reader}"


@dataclass
class StreamedDocument:
    """A document with more characters than the shuffle buffer holds tokens. It passes the buffer by and is
    tokenised one piece at a time as the packer asks for tokens, so that its ids never pile up and the first batch
    does not wait for all of them (a 50 MB document takes a minute to tokenise). Documents that long would fill
    the buffer alone, so little mixing is lost. It is kept as immutable UTF-8 bytes, so that a state refers to
    them rather than copying them (the loader snapshots every few batches)."""

    source: int
    data: bytes
    offset: int = 0
    """Bytes of `data` already tokenised."""

    def state_dict(self) -> dict:
        return {"source": self.source, "data": self.data, "offset": self.offset}

    @classmethod
    def from_state(cls, state: dict) -> StreamedDocument:
        return cls(state["source"], state["data"], state["offset"])


class TrainReader:
    """Infinite micro-batches for reader `reader` of `num_readers` (ranks x workers)."""

    def __init__(
        self,
        cfg: DataConfig,
        encoder: DocumentEncoder,
        micro_batch_size: int,
        reader: int,
        num_readers: int,
        seed: int,
        hub_listings: Mapping[tuple, HubListing] | None = None,
    ):
        """`hub_listings`: the run's one listing of each hub source (`hub.list_for_all_ranks`); a hub source
        missing from it is listed by this reader."""
        self.cfg, self.encoder, self.micro_batch_size = cfg, encoder, micro_batch_size
        self.skipped: dict[str, Counter] = {source.label: Counter() for source in cfg.sources}
        self.counts: Counter = Counter()
        streams = [
            SourceStream(
                source,
                reader,
                num_readers,
                cycle=True,
                skipped=self.skipped[source.label],
                listing=(hub_listings or {}).get(listing_key(source)),
            )  # fmt: skip
            for source in cfg.sources
        ]
        self.mixture = Mixture(streams, [source.weight for source in cfg.sources], reader_seed(seed, reader, "mixture"))
        self.documents = self.mixture.documents()
        self.shuffle = ShuffleBuffer(
            cfg.shuffle_buffer, reader_seed(seed, reader, "shuffle"), max_tokens=cfg.shuffle_buffer_tokens
        )
        self.packer = Packer(cfg.seq_len)
        self.streamed: StreamedDocument | None = None
        # Above both bounds, so that a streamed document always ends its tokenizer batch (see `read_batch`).
        self.stream_above_chars = max(cfg.shuffle_buffer_tokens, cfg.tokenize_batch_chars)

    def next_batch(self) -> Batch:
        blocks = [self.next_block() for _ in range(self.micro_batch_size)]
        self.counts["batches"] += 1
        return make_batch(
            np.stack(blocks), self.encoder.eos_id, self.cfg.per_document_attention, label_roles=self.cfg.label_roles
        )

    def next_block(self) -> np.ndarray:
        """The next `seq_len + 1` tokens of this reader's stream (a micro-batch row)."""
        while not self.packer.has_block():
            self.packer.add(self._next_tokens())
        return self.packer.take_block()

    def _next_tokens(self) -> np.ndarray:
        """A document from the shuffle buffer, or the next piece of a streamed document."""
        while self.streamed is None and self.shuffle.needs_more():
            self._read_batch()
        # In stream order (no shuffling) the documents read before the streamed one go first.
        if self.streamed is not None and not (self.shuffle.keeps_order and len(self.shuffle)):
            return self._next_piece()
        document, source = self.shuffle.pop()
        self._count(source, document, starts_document=True)
        return document

    def _read_batch(self) -> None:
        batch = read_batch(self.documents, self.cfg.tokenize_batch, self.cfg.tokenize_batch_chars)
        # A Q/A record is tokenised whole, so that its answer's tokens can be marked (encoding.py).
        last = batch[-1][1]
        if self.encoder.piece_join is not None and len(last) > self.stream_above_chars and not isinstance(last, QAText):
            source, text = batch.pop()
            self.streamed = StreamedDocument(source, text.encode("utf-8"))
        for (source, _), document in zip(batch, self.encoder([text for _, text in batch]), strict=True):
            self.shuffle.push(document, source)

    def _next_piece(self) -> np.ndarray:
        streamed = self.streamed
        starts_document = streamed.offset == 0
        ids, streamed.offset = self.encoder.encode_piece(streamed.data, streamed.offset, continues=not starts_document)
        if streamed.offset == len(streamed.data):
            self.streamed = None
        self._count(streamed.source, ids, starts_document)
        return ids

    def _count(self, source: int, tokens: np.ndarray, starts_document: bool) -> None:
        label = self.cfg.sources[source].label
        self.counts[source_key(label, "documents")] += starts_document
        self.counts[source_key(label, "tokens")] += len(tokens)

    def state_dict(self) -> dict:
        return {
            "mixture": self.mixture.state_dict(),
            "shuffle": self.shuffle.state_dict(),
            "packer": self.packer.state_dict(),
            "streamed": None if self.streamed is None else self.streamed.state_dict(),
            "skipped": {label: dict(skipped) for label, skipped in self.skipped.items()},
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])
        self.shuffle.load_state_dict(state["shuffle"])
        self.packer.load_state_dict(state["packer"])
        self.streamed = None if state["streamed"] is None else StreamedDocument.from_state(state["streamed"])
        for label, skipped in self.skipped.items():
            skipped.clear()
            skipped.update(state["skipped"][label])
        self.counts.clear()
        self.counts.update(state["counts"])

    def progress(self) -> dict[str, float]:
        """This reader's counters (`counters.zero_counters` names them): totals and per source."""
        progress = zero_counters(self.cfg)
        progress["batches"] = float(self.counts["batches"])
        for source, stream in zip(self.cfg.sources, self.mixture.streams, strict=True):
            progress[f"{EPOCH_PREFIX}{source.label}"] = float(stream.cursor.epoch)
            for name in ("documents", "tokens"):
                progress[source_key(source.label, name)] = float(self.counts[source_key(source.label, name)])
                progress[name] += progress[source_key(source.label, name)]
            for reason, count in self.skipped[source.label].items():
                progress[source_key(source.label, f"skipped/{reason}")] = float(count)
                progress[f"skipped/{reason}"] += count
        return progress


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def validation_batches(
    cfg: DataConfig,
    encoder: DocumentEncoder,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    skipped: Counter,
    hub_listings: Mapping[tuple, HubListing] | None = None,
) -> Iterator[Batch]:
    """One pass over the validation sources, in order, without shuffling, each source packed on its own.

    Every rank reads the whole (small) held-out stream and keeps blocks `dp_rank` modulo `dp_world_size`, so
    ranks are disjoint and complete. All ranks then yield the same number of batches, padding the last with
    label-free rows: a ZeRO-3 forward is collective and would hang if one rank ran out of batches early.
    """
    rows: list[np.ndarray] = []
    num_labels: list[int] = []
    num_blocks = batches = 0
    for index, (block, block_labels) in enumerate(_validation_blocks(cfg, encoder, skipped, hub_listings or {})):
        num_blocks = index + 1
        if index % dp_world_size == dp_rank:
            rows.append(block)
            num_labels.append(block_labels)
        if len(rows) == micro_batch_size:
            yield _validation_batch(rows, num_labels, encoder.eos_id, cfg)
            rows, num_labels, batches = [], [], batches + 1
    batches_per_rank = ceil_div(ceil_div(num_blocks, dp_world_size), micro_batch_size)
    for _ in range(batches, batches_per_rank):
        padding = micro_batch_size - len(rows)
        rows += [np.full(cfg.seq_len + 1, encoder.eos_id, dtype=np.int32)] * padding
        num_labels += [0] * padding
        yield _validation_batch(rows, num_labels, encoder.eos_id, cfg)
        rows, num_labels = [], []


def _validation_batch(rows: list[np.ndarray], num_labels: list[int], eos_id: int, cfg: DataConfig) -> Batch:
    """With an `answer_mask` when some validation source is a Q/A source (validation scores all labels)."""
    return make_batch(
        np.stack(rows), eos_id, cfg.per_document_attention, np.array(num_labels), answer_mask=cfg.answer_labels
    )


def _validation_blocks(
    cfg: DataConfig, encoder: DocumentEncoder, skipped: Counter, hub_listings: Mapping[tuple, HubListing]
) -> Iterator[tuple[np.ndarray, int]]:
    """(block, number of labels in it): each source packed on its own (full blocks, then its padded remainder), so
    that a source's blocks, and its validation numbers, do not depend on which other sources are listed."""
    for index, source in enumerate(cfg.validation):
        packer = Packer(cfg.seq_len)
        listing = hub_listings.get(listing_key(source))
        stream = SourceStream(source, shard=0, num_shards=1, cycle=False, skipped=skipped, listing=listing)
        documents = ((index, text) for text in iter(stream.next_document, None))
        while batch := read_batch(documents, cfg.tokenize_batch, cfg.tokenize_batch_chars):
            for document in encoder([text for _, text in batch]):
                packer.add(document)
                while packer.has_block():
                    yield packer.take_block(), cfg.seq_len
        last_block, last_labels = packer.take_last_block(encoder.eos_id)
        if last_labels > 0:
            yield last_block, last_labels
