"""Weighted, seeded choice of the source each next training document comes from."""

from __future__ import annotations

import random
from collections.abc import Iterator

from ntl_pretrain.data.sources import SourceStream


def rng_state(rng: random.Random) -> list:
    """`random.Random.getstate()` as plain lists (checkpoint client state stays plain Python)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def restore_rng(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class Mixture:
    """Draws each document's source with probability proportional to its weight; every source cycles
    through its epochs independently, so a small source repeats while a large one is still in epoch 0."""

    def __init__(self, streams: list[SourceStream], weights: list[float], seed: str):
        self.streams = streams
        self.weights = weights
        self.rng = random.Random(seed)

    def documents(self) -> Iterator[tuple[int, str]]:
        """(source index, text) of each next document, drawn only when asked for (the state stays exact)."""
        while True:
            yield self.next_document()

    def next_document(self) -> tuple[int, str]:
        (source,) = self.rng.choices(range(len(self.streams)), weights=self.weights)
        document = self.streams[source].next_document()
        assert document is not None, "training streams cycle, so they never run out"
        return source, document

    def state_dict(self) -> dict:
        return {"rng": rng_state(self.rng), "sources": [stream.state_dict() for stream in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        restore_rng(self.rng, state["rng"])
        for stream, stream_state in zip(self.streams, state["sources"], strict=True):
            stream.load_state_dict(stream_state)
