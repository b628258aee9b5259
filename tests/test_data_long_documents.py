"""Book-length documents: tokenised in pieces with the same ids, in bounded memory, first batch without delay."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.real_tokenizers import TOKENIZER_FILES, real_tokenizer
from transformers import AutoTokenizer

from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader
from ntl_pretrain.data.commands import CORPUS
from ntl_pretrain.data.encoding import DocumentEncoder, piece_bounds

DOCUMENT_MB = 2


def mixed_text() -> str:
    prose = "\n\n".join(json.loads(line)["text"] for line in open(CORPUS / "prose" / "train.jsonl"))
    odd = "  double  spaces\tand 12345 numbers 3.14 ,  — ünïcödé 日本語 text\n \n"
    return prose[:20_000] + odd * 40


def test_pieces_start_at_a_space_before_a_word_and_cover_the_text():
    text = "a" * 30 + "  " + "b" * 10 + " ç日" * 40 + "\n" + "d" * 100
    for whole in (text, text.encode()):  # characters, or the UTF-8 bytes a streamed document is kept as
        bounds = list(piece_bounds(whole, 16))
        assert whole[:0].join(whole[start:end] for start, end in bounds) == whole
        assert all(start == end_before for (_, end_before), (start, _) in zip(bounds, bounds[1:], strict=False))
        for start, end in bounds[1:]:
            piece = whole[start:end] if isinstance(whole, str) else whole[start:end].decode()
            assert piece[0] == " " and not piece[1].isspace()
        last = whole[bounds[-1][0] :]
        assert last.endswith(whole[-101:]) and len(last) > 100  # no space to cut at: the stretch stays whole


@pytest.mark.parametrize("name", ["tiny", *TOKENIZER_FILES])
def test_piecewise_tokenisation_gives_the_whole_documents_ids(name):
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer") if name == "tiny" else real_tokenizer(name)
    text = mixed_text()
    whole = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    encoder = DocumentEncoder(tokenizer, max_chars=2000)
    assert encoder.piece_join is not None
    assert encoder([text, "short one", text])[2].tolist() == whole


READER = textwrap.dedent(
    """
    import json, re, sys
    from pathlib import Path
    from transformers import AutoTokenizer
    from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader
    from ntl_pretrain.data.encoding import DocumentEncoder

    folder, corpus, mb = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    tokenizer = AutoTokenizer.from_pretrained(corpus / "tiny-tokenizer")
    words = [json.loads(line)["text"] for line in open(corpus / "prose" / "train.jsonl")]
    base = " ".join(words)
    with open(folder / "books.jsonl", "w") as out:
        for index in range(6):
            book = f"Book {index}. " + base * (mb * 2**20 // len(base) + 1)
            out.write(json.dumps({"text": book[: mb * 2**20]}) + "\\n")
    DocumentEncoder(tokenizer)(["warm up the tokenizer"])
    def peak_bytes():
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

    tokenised = [0]  # characters handed to the tokenizer: work counted, not timed (a busy machine cannot fail it)
    encode = DocumentEncoder._encode
    def counted(self, texts):
        tokenised[0] += sum(map(len, texts))
        return encode(self, texts)
    DocumentEncoder._encode = counted

    open("/proc/self/clear_refs", "w").write("5")  # the peak so far (imports, writing the corpus) restarts here
    before = peak_bytes()
    cfg = DataConfig(sources=[SourceConfig(path=str(folder / "books.jsonl"))], seq_len=128)
    next(iter(build_dataloader(cfg, tokenizer, micro_batch_size=8, dp_rank=0, dp_world_size=1, seed=0)))
    growth = peak_bytes() - before
    book = json.loads(open(folder / "books.jsonl").readline())["text"]
    print(json.dumps({"growth": growth, "first_batch_chars": tokenised[0], "book_chars": len(book)}))
    """
)


@pytest.mark.slow
def test_reader_over_2mb_documents_stays_in_memory_bound_and_starts_quickly(tmp_path):
    """Defaults hold ~1M tokens of 2 MB documents (2 of them here), not 1,000 documents; each tokenizer call takes
    ~1M characters; the first batch tokenises pieces of the first book, not whole books (counted in characters,
    not seconds)."""
    run = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path), str(CORPUS), str(DOCUMENT_MB)],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    document_bytes = DOCUMENT_MB * 2**20
    assert measured["growth"] < 15 * document_bytes, f"peak grew {measured['growth'] / document_bytes:.1f}x a document"
    # the first batch waits for some pieces of a book (65,600 characters seen), not for a whole book, let alone six
    assert measured["first_batch_chars"] < measured["book_chars"], measured


def long_and_short_corpus(folder) -> tuple[SourceConfig, list[str]]:
    text = mixed_text()
    documents = []
    for index in range(12):
        length = 5000 + 700 * index if index % 3 == 0 else 40 + index
        documents.append(f"Document {index}: " + text[index * 997 : index * 997 + length])
    (folder / "d.jsonl").write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    return SourceConfig(path=str(folder / "d.jsonl")), documents


def small_bounds(source: SourceConfig, shuffle_buffer: int) -> DataConfig:
    """Bounds small enough that the corpus's 5,000+ character documents stream through the reader in pieces."""
    return DataConfig(
        sources=[source], seq_len=64, shuffle_buffer=shuffle_buffer, shuffle_buffer_tokens=800, tokenize_batch_chars=600
    )


def test_streamed_documents_give_the_whole_documents_ids_in_stream_order(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    source, documents = long_and_short_corpus(tmp_path)
    reader = build_dataloader(
        small_bounds(source, 0), tokenizer, micro_batch_size=4, dp_rank=0, dp_world_size=1, seed=0
    )
    batches = iter(reader)
    stream = [
        t for d in documents for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]
    rows = [row for _ in range(len(stream) // 64 // 4) for row in next(batches)["input_ids"].tolist()]
    assert rows == [stream[k * 64 : k * 64 + 64] for k in range(len(rows))]


def test_resume_inside_a_streamed_document_reproduces_the_uninterrupted_run(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    source, _ = long_and_short_corpus(tmp_path)
    cfg = small_bounds(source, 8)

    def loader():
        return build_dataloader(cfg, tokenizer, micro_batch_size=2, dp_rank=0, dp_world_size=1, seed=3)

    expected = [batch["input_ids"] for batch in itertools.islice(loader(), 60)]
    got, state, streamed = [], None, 0
    for count in (5, 17, 38):
        resumed = loader()
        if state is not None:
            resumed.load_state_dict(state)
        got += [batch["input_ids"] for batch in itertools.islice(resumed, count)]
        state = resumed.state_dict()
        snapshot = state["readers"][0]["snapshot"]
        streamed += snapshot is not None and snapshot["streamed"] is not None
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert streamed, "no saved state fell inside a streamed document"
