"""Weighted, seeded choice of the source each next training document comes from."""

from __future__ import annotations

import random

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

    def next_document(self) -> str:
        (stream,) = self.rng.choices(self.streams, weights=self.weights)
        document = stream.next_document()
        assert document is not None, "training streams cycle, so they never run out"
        return document

    def state_dict(self) -> dict:
        return {"rng": rng_state(self.rng), "sources": [stream.state_dict() for stream in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        restore_rng(self.rng, state["rng"])
        for stream, stream_state in zip(self.streams, state["sources"], strict=True):
            stream.load_state_dict(stream_state)
