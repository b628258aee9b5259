"""Turn a Project Gutenberg plain-text book into train/validation jsonl documents.

The book's body (between the START and END markers, without the Gutenberg licence boilerplate, which
is how Gutenberg permits redistributing a public-domain text) is cut into documents of a fixed number of
lines; the last chapter is held out for validation so that no validation passage appears in training.
"""

from __future__ import annotations

import re
from pathlib import Path

from ntl_pretrain.data.arithmetic import write_jsonl
from ntl_pretrain.errors import InputError

START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)
END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE)
CHAPTER = re.compile(r"^CHAPTER [IVXLC]+\.?$", re.MULTILINE)


def book_body(text: str) -> str:
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    start, end = START.search(text), END.search(text)
    if start is None or end is None:
        raise ValueError("not a Project Gutenberg text: START/END markers not found")
    return text[start.end() : end.start()].strip()


def chunk_lines(text: str, lines_per_document: int) -> list[str]:
    lines = [line for line in text.split("\n") if line.strip()]
    chunks = (lines[i : i + lines_per_document] for i in range(0, len(lines), lines_per_document))
    return ["\n".join(chunk) for chunk in chunks]


def split_book(text: str, lines_per_document: int = 20) -> dict[str, list[dict[str, str]]]:
    """Documents `{"text": ...}` of the whole book but its last chapter (train) and of the last chapter."""
    body = book_body(text)
    chapters = list(CHAPTER.finditer(body))
    if not chapters:
        raise ValueError("no chapter heading (a line `CHAPTER <roman numeral>`) to hold out for validation")
    last_chapter = chapters[-1].start()
    return {
        "train": [{"text": doc} for doc in chunk_lines(body[:last_chapter], lines_per_document)],
        "validation": [{"text": doc} for doc in chunk_lines(body[last_chapter:], lines_per_document)],
    }


def import_book(book: Path, out_dir: Path, lines_per_document: int = 20) -> list[Path]:
    """Write `<out_dir>/{train,validation}.jsonl`; a book that is not a Gutenberg text is refused naming it."""
    try:
        splits = split_book(book.read_text(encoding="utf-8"), lines_per_document)
    except ValueError as error:  # also UnicodeDecodeError
        raise InputError(f"{book}: {error}") from error
    written = []
    for split, documents in splits.items():
        path = out_dir / f"{split}.jsonl"
        write_jsonl(path, documents)
        written.append(path)
    return written
