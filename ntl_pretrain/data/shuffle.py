"""A seeded shuffle buffer of tokenised documents whose contents are part of the checkpoint.

HF `datasets` refills its shuffle buffer with new data on resume (its docs say so), which changes the
order of every later batch; this buffer saves its documents as token ids so that a resumed run draws
exactly the documents an uninterrupted run would have drawn.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ntl_pretrain.data.mixture import restore_rng, rng_state


class ShuffleBuffer:
    """Holds up to `size` documents and `max_tokens` tokens and hands out a uniformly random one; `size` <= 1
    keeps order. Whichever bound is reached first stops the filling: the count mixes short records, the tokens
    bound memory (and the time to the first batch) when documents are long."""

    def __init__(self, size: int, seed: str, max_tokens: int):
        self.size = size
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.documents: list[np.ndarray] = []
        self.sources: list[int] = []
        """The source index of each document, for per-source counters."""
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def keeps_order(self) -> bool:
        return self.size <= 1

    def needs_more(self) -> bool:
        if not self.documents:
            return True
        return len(self.documents) < self.size and self.tokens < self.max_tokens

    def push(self, document: np.ndarray, source: int) -> None:
        self.documents.append(document)
        self.sources.append(source)
        self.tokens += len(document)

    def pop(self) -> tuple[np.ndarray, int]:
        """A document and its source index."""
        if self.keeps_order:
            document, source = self.documents.pop(0), self.sources.pop(0)
        else:
            index = self.rng.randrange(len(self.documents))
            # Swap-remove: O(1), and the order of the rest is part of the (saved) state anyway.
            for items in (self.documents, self.sources):
                items[index], items[-1] = items[-1], items[index]
            document, source = self.documents.pop(), self.sources.pop()
        self.tokens -= len(document)
        return document, source

    def state_dict(self) -> dict:
        lengths = [len(document) for document in self.documents]
        tokens = np.concatenate(self.documents) if self.documents else np.zeros(0, dtype=np.int32)
        return {
            "rng": rng_state(self.rng),
            "tokens": torch.from_numpy(tokens),
            "lengths": torch.tensor(lengths, dtype=torch.int64),
            "sources": torch.tensor(self.sources, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict) -> None:
        restore_rng(self.rng, state["rng"])
        tokens = state["tokens"].numpy()
        ends = np.cumsum(state["lengths"].numpy()).tolist()
        starts = [0, *ends[:-1]]
        self.documents = [tokens[start:end].copy() for start, end in zip(starts, ends, strict=True)]
        self.sources = state["sources"].tolist()
        self.tokens = len(tokens)
