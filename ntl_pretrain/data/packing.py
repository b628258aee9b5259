"""Pack EOS-terminated documents into fixed-length blocks and turn blocks into training samples.

Shapes: B micro-batch rows, T = seq_len. A block holds T+1 tokens: inputs are its first T, labels its
last T (labels are already shifted; the loss head does not shift again). Consecutive blocks overlap by
one token, so every token after the first is a label exactly once and nothing is padded.

Label roles: the bits of `label_bits` above each token id, taken off again by `make_batch`.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from ntl_pretrain.data.label_bits import ANSWER, NO_CE, NO_NTL, TOKEN_BITS  # noqa: F401 - also packing's names

IGNORE_INDEX = -100


class Packer:
    """Concatenates documents and cuts them into blocks of `seq_len + 1` tokens.

    A block costs O(seq_len) however long the pending documents are: the packer keeps the documents as they
    came and an offset into the first, rather than re-joining what is pending for every block (a book-length
    document would otherwise be copied once per block, quadratic in its length).
    """

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.pending: deque[np.ndarray] = deque()
        self.offset = 0
        """Tokens of `pending[0]` already behind the stream position."""
        self.pending_tokens = 0

    def add(self, document: np.ndarray) -> None:
        self.pending.append(document)
        self.pending_tokens += len(document)

    def has_block(self) -> bool:
        return self.pending_tokens >= self.seq_len + 1

    def take_block(self) -> np.ndarray:
        """The next `seq_len + 1` tokens; the last of them stays as the first input of the next block."""
        block = self._peek(self.seq_len + 1)
        self._advance(self.seq_len)
        return block

    def take_last_block(self, pad_id: int) -> tuple[np.ndarray, int]:
        """What is left at the end of a finite stream, padded to a block, and its number of labels."""
        tokens = self._remaining()
        self.pending, self.offset, self.pending_tokens = deque(), 0, 0
        num_labels = max(0, len(tokens) - 1)
        block = np.full(self.seq_len + 1, pad_id, dtype=np.int32)
        block[: len(tokens)] = tokens
        return block, num_labels

    def _peek(self, count: int) -> np.ndarray:
        """A copy of the next `count` pending tokens (there are at least that many)."""
        parts, start, missing = [], self.offset, count
        for document in self.pending:
            part = document[start : start + missing]
            parts.append(part)
            missing -= len(part)
            if missing == 0:
                break
            start = 0
        return np.concatenate(parts)

    def _advance(self, count: int) -> None:
        self.pending_tokens -= count
        while count:
            left_in_first = len(self.pending[0]) - self.offset
            if left_in_first > count:
                self.offset += count
                return
            count -= left_in_first
            self.pending.popleft()
            self.offset = 0

    def _remaining(self) -> np.ndarray:
        if not self.pending:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([self.pending[0][self.offset :], *list(self.pending)[1:]])

    def state_dict(self) -> dict:
        return {"tokens": torch.from_numpy(self._remaining())}

    def load_state_dict(self, state: dict) -> None:
        tokens = state["tokens"].numpy().copy()
        self.pending, self.offset, self.pending_tokens = deque([tokens]), 0, len(tokens)


def make_batch(
    blocks_BT1: np.ndarray,
    eos_id: int,
    per_document_attention: bool,
    num_labels_B: np.ndarray | None = None,
    *,
    label_roles: bool = False,
    answer_mask: bool = False,
) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels` and `position_ids`, each int64 `[B, T]`, from blocks of T+1 tokens.

    With `per_document_attention`, positions restart at 0 after every EOS and the label of an EOS (the
    next document's first token, which the document cannot predict) is ignored. `num_labels_B` marks
    padded tails (finite streams): labels from that index on are ignored.
    `label_roles`: `labels` are the CE labels and `ntl_labels` (int64 [B, T]) the NTL labels, each ignored where
    its source restricts that loss to answers; without it one `labels` serves both. `answer_mask`: also a bool
    [B, T] `answer_mask`, the labels that belong to a Q/A record's answer (or its EOS).
    """
    tokens = torch.from_numpy(blocks_BT1.astype(np.int64))
    blocks, flags_BT = tokens & TOKEN_BITS, tokens[:, 1:] & ~TOKEN_BITS
    input_ids_BT, labels_BT = blocks[:, :-1], blocks[:, 1:].clone()
    B, T = input_ids_BT.shape
    steps_BT = torch.arange(T).expand(B, T)
    if per_document_attention:
        is_eos_BT = input_ids_BT == eos_id
        labels_BT[is_eos_BT] = IGNORE_INDEX
        starts_BT = torch.zeros(B, T, dtype=torch.bool)
        starts_BT[:, 0] = True
        starts_BT[:, 1:] = is_eos_BT[:, :-1]
        last_start_BT = torch.where(starts_BT, steps_BT, 0).cummax(dim=1).values
        position_ids_BT = steps_BT - last_start_BT
    else:
        position_ids_BT = steps_BT.clone()
    if num_labels_B is not None:
        labels_BT[steps_BT >= torch.from_numpy(num_labels_B).unsqueeze(1)] = IGNORE_INDEX
    batch = {"input_ids": input_ids_BT.contiguous(), "labels": labels_BT, "position_ids": position_ids_BT.contiguous()}
    if answer_mask:
        batch["answer_mask"] = (flags_BT & ANSWER).bool() & (labels_BT != IGNORE_INDEX)
    if label_roles:
        batch["ntl_labels"] = torch.where((flags_BT & NO_NTL).bool(), IGNORE_INDEX, labels_BT)
        batch["labels"] = torch.where((flags_BT & NO_CE).bool(), IGNORE_INDEX, labels_BT)
    return batch
