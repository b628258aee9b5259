"""Tokenise documents in calls bounded by their size, so that memory follows the text, not the document count.

A fast tokenizer holds far more than the ids while it runs (token strings, offsets, per-byte alignments: a few
hundred bytes per character of text), so one call on a 50 MB document, or on 64 of them, needs gigabytes. Calls here
take at most `max_chars` characters: short documents are grouped, and a longer one is cut into pieces whose ids are
joined; `encode_piece` tokenises one piece of a document kept as UTF-8 (`pipeline.StreamedDocument`).

A piece starts at a space followed by a non-space character, where byte-level BPE pre-tokenizers (GPT-2, Llama 3,
Qwen) start a new pre-token anyway, so the joined ids equal the whole document's. SentencePiece-style tokenizers
that prefix every call with "▁" get the piece without its leading space, which that prefix restores. At start-up
the encoder checks which of the two joins reproduces a whole encoding; a tokenizer for which neither does gets
each document in one call (its memory then grows with the longest document).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
from transformers import PreTrainedTokenizerBase

from ntl_pretrain.data.packing import ANSWER
from ntl_pretrain.data.sources import QAText

# Tokenised whole and in the two pieces at " sat", to learn how pieces join for this tokenizer.
JOIN_PROBE = ("The cat sat on the mat, 12 times.", 7)


def read_batch(documents: Iterator[tuple[int, str]], max_documents: int, max_chars: int) -> list[tuple[int, str]]:
    """(source, text) pairs for one tokenizer batch: up to `max_documents`, ending early once the texts reach
    `max_chars` characters or `documents` ends."""
    batch: list[tuple[int, str]] = []
    chars = 0
    while len(batch) < max_documents and chars < max_chars:
        document = next(documents, None)
        if document is None:
            break
        batch.append(document)
        chars += len(document[1])
    return batch


def piece_bounds(text: str | bytes, max_length: int) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive pieces of about `max_length` characters (or UTF-8 bytes) or fewer, each after
    the first starting at a space that precedes a non-space; a stretch without such a space stays in one piece,
    however long. In UTF-8 a space byte is always a whole character, so byte pieces decode on their own."""
    start = 0
    while True:
        end = piece_end(text, start, max_length)
        yield start, end
        if end == len(text):
            return
        start = end


def piece_end(text: str | bytes, start: int, max_length: int) -> int:
    """Where the piece starting at `start` ends (see `piece_bounds`)."""
    if len(text) - start <= max_length:
        return len(text)
    space = " " if isinstance(text, str) else b" "
    cut = text.rfind(space, start + max_length // 2, start + max_length)
    while cut > start + max_length // 2 and not _starts_word(text, cut + 1):
        cut = text.rfind(space, start + max_length // 2, cut)
    if cut > start + max_length // 2:
        return cut
    cut = text.find(space, start + max_length)
    while cut != -1 and not _starts_word(text, cut + 1):
        cut = text.find(space, cut + 1)
    return len(text) if cut == -1 else cut


def _starts_word(text: str | bytes, index: int) -> bool:
    """Whether a non-space character starts at `index`."""
    following = text[index : index + 4]
    if not isinstance(following, str):
        following = following.decode("utf-8", errors="ignore")
    return bool(following) and not following[0].isspace()


class DocumentEncoder:
    """Fast tokenisation in size-bounded calls; every document ends with EOS so that packed documents stay apart."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_chars: int = 1 << 16):
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to separate documents")
        self.eos_id = int(tokenizer.eos_token_id)
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # encode_batch_fast skips offsets, which packing never uses (tokenizers >= 0.21); Q/A records need them.
        self.encode_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        self.encode_with_offsets = getattr(backend, "encode_batch", None)
        self.piece_join = self._piece_join()

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        """int32 ids of each text, EOS last; a Q/A record's (`QAText`) carry its label-role bits (packing.py)."""
        qa = [index for index, text in enumerate(texts) if isinstance(text, QAText)]
        if not qa:
            return self._plain(texts)
        documents = self._plain([text for text in texts if not isinstance(text, QAText)])[::-1]
        tagged = dict(zip(qa, self._tagged([texts[index] for index in qa]), strict=True))
        return [tagged[index] if index in tagged else documents.pop() for index in range(len(texts))]

    def _tagged(self, texts: list[QAText]) -> list[np.ndarray]:
        """Ids with `ANSWER` on every token that overlaps the answer's characters and on the EOS, and the text's
        `outside_flags` on the others. Q/A records are short: each is tokenised whole."""
        if self.encode_with_offsets is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path!r}: Q/A sources need a fast tokenizer (offsets)")
        documents = []
        for text, encoding in zip(texts, self.encode_with_offsets(list(texts), add_special_tokens=False), strict=True):
            ids = np.array([*encoding.ids, self.eos_id], dtype=np.int32)
            ends = np.array([end for _, end in encoding.offsets] + [len(text) + 1])
            starts = np.array([start for start, _ in encoding.offsets] + [len(text)])
            in_answer = (ends > text.answer_start) & (starts < text.answer_end)
            in_answer[-1] = True
            documents.append(ids | np.where(in_answer, ANSWER, text.outside_flags).astype(np.int32))
        return documents

    def _plain(self, texts: list[str]) -> list[np.ndarray]:
        # Each call's ids become int32 at once: as Python ints a long document's ids would take ~9x the memory.
        pieces_per_document: list[list[np.ndarray]] = [[] for _ in texts]
        for call in self._calls(self._pieces(texts)):
            for (document, _), ids in zip(call, self._encode([piece for _, piece in call]), strict=True):
                pieces_per_document[document].append(np.array(ids, dtype=np.int32))
        eos = np.array([self.eos_id], dtype=np.int32)
        return [np.concatenate([*pieces, eos]) for pieces in pieces_per_document]

    def encode_piece(self, data: bytes, start: int, continues: bool) -> tuple[np.ndarray, int]:
        """The ids of the piece of UTF-8 `data` starting at byte `start` (with EOS when it is the last) and where it
        ends; `continues` when the piece is not the document's first."""
        end = piece_end(data, start, self.max_chars)
        skip_space = continues and self.piece_join == "drop_space"
        piece = data[start + skip_space : end].decode("utf-8")
        ids = np.array(self._encode([piece])[0], dtype=np.int32)
        if end == len(data):
            ids = np.append(ids, np.int32(self.eos_id))
        return ids, end

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.encode_batch is not None:
            return [encoding.ids for encoding in self.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _pieces(self, texts: list[str]) -> Iterator[tuple[int, str]]:
        """(document index, piece text), lazily: a long document's pieces exist one call at a time."""
        for document, text in enumerate(texts):
            if self.piece_join is None or len(text) <= self.max_chars:
                yield document, text
                continue
            for start, end in piece_bounds(text, self.max_chars):
                skip_space = start > 0 and self.piece_join == "drop_space"
                yield document, text[start + skip_space : end]

    def _calls(self, pieces: Iterable[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
        call: list[tuple[int, str]] = []
        chars = 0
        for piece in pieces:
            call.append(piece)
            chars += len(piece[1])
            if chars >= self.max_chars:
                yield call
                call, chars = [], 0
        if call:
            yield call

    def _piece_join(self) -> str | None:
        """How ids of pieces cut before a space join into the whole text's: "keep_space", "drop_space" or None."""
        text, cut = JOIN_PROBE
        whole, head = self._encode([text, text[:cut]])
        for join, tail in (("keep_space", text[cut:]), ("drop_space", text[cut + 1 :])):
            if head + self._encode([tail])[0] == whole:
                return join
        return None
