"""Book-length documents: tokenised in pieces with the same ids, in bounded memory, first batch without delay."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from real_tokenizers import TOKENIZER_FILES, real_tokenizer
from transformers import AutoTokenizer

from ntl_pretrain.data.commands import CORPUS
from ntl_pretrain.data.encoding import DocumentEncoder, piece_bounds

DOCUMENT_MB = 2


def mixed_text() -> str:
    prose = "\n\n".join(json.loads(line)["text"] for line in open(CORPUS / "prose" / "train.jsonl"))
    odd = "  double  spaces\tand 12345 numbers 3.14 ,  — ünïcödé 日本語 text\n \n"
    return prose[:60_000] + odd * 40


def test_pieces_start_at_a_space_before_a_word_and_cover_the_text():
    text = "a" * 30 + "  " + "b" * 10 + " c" * 40 + "\n" + "d" * 100
    bounds = list(piece_bounds(text, 16))
    assert "".join(text[start:end] for start, end in bounds) == text
    assert all(start == end_before for (_, end_before), (start, _) in zip(bounds, bounds[1:], strict=False))
    for start, _ in bounds[1:]:
        assert text[start] == " " and not text[start + 1].isspace()
    last = text[bounds[-1][0] :]
    assert last.endswith("\n" + "d" * 100) and len(last) > 100  # no space to cut at: the stretch stays whole


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
    import json, resource, sys, time
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
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = DataConfig(sources=[SourceConfig(path=str(folder / "books.jsonl"))], seq_len=128)
    start = time.perf_counter()
    next(iter(build_dataloader(cfg, tokenizer, micro_batch_size=8, dp_rank=0, dp_world_size=1, seed=0)))
    first_batch = time.perf_counter() - start
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    book = json.loads(open(folder / "books.jsonl").readline())["text"]
    start = time.perf_counter()
    tokenizer(book, add_special_tokens=False)
    one_book = time.perf_counter() - start
    print(json.dumps({"growth": growth, "first_batch": first_batch, "one_book": one_book}))
    """
)


@pytest.mark.slow
def test_reader_over_2mb_documents_stays_in_memory_bound_and_starts_quickly(tmp_path):
    """Defaults hold ~1M tokens of 2 MB documents (2 of them here), not 1,000 documents; each tokenizer call takes
    ~1M characters. The peak is measured before the one-document reference call, which holds all its tokens."""
    run = subprocess.run(
        [sys.executable, "-c", READER, str(tmp_path), str(CORPUS), str(DOCUMENT_MB)],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    document_bytes = DOCUMENT_MB * 2**20
    assert measured["growth"] < 40 * document_bytes, f"peak grew {measured['growth'] / document_bytes:.1f}x a document"
    assert measured["first_batch"] < 5 * measured["one_book"], measured
