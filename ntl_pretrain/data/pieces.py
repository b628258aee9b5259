"""Sources read below one file per reader: parquet row groups and byte ranges of line files, dealt to the readers.

A hub sample of 14 parquet files read by 128 readers (64 GPUs x 2 workers), or one remote jsonl file read by 16,
cannot give each reader whole files of its own. Reading every n-th record would make every reader download the
whole dataset (128 times the bytes at 64 GPUs). Instead the source is cut into *pieces*, each readable without
the rest of its file: a parquet row group (the footer says where it is), or a byte range of an uncompressed line
file, where a line belongs to the piece its first byte lies in (a reader skips the line in progress at its piece's
start and reads past its end to finish its last line). Piece k goes to reader k mod R, so R readers read about
1/R of the bytes each, plus the footers and the ends of their last lines.

The cut depends only on the files (their sizes and row groups) and the number of readers, never on who reads, so a
stream's content is fixed by its index like any other (`reslice.py` continues it on another world size). A stream
records the cut's digest and refuses to resume on another one (`sources.SourceStream.load_state_dict`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from ntl_pretrain.data.files import COMPRESSION_SUFFIXES, is_remote

PIECES_PER_READER = 4
"""Line files are cut into about this many byte ranges per reader (fewer, larger pieces: fewer requests; more:
shares closer to 1/R)."""
MAX_LINE_PIECE_BYTES = 64 << 20
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Piece:
    """Part `start`..`end` of file `file`: row groups [start, end) of a parquet file, bytes [start, end) of a line
    file."""

    file: int
    start: int
    end: int


def open_file(path: str) -> IO[bytes]:
    """A seekable binary file, local or remote (fsspec: a seek past the buffer is a ranged request)."""
    if is_remote(path):
        import fsspec

        return fsspec.open(path, "rb").open()
    return open(path, "rb")


def file_size(path: str) -> int:
    with open_file(path) as stream:
        return stream.seek(0, 2)


def splittable_lines(files: list[str]) -> bool:
    """Line files can be cut by bytes only where a byte offset is a position in the text: not compressed."""
    return all(not file.lower().endswith(COMPRESSION_SUFFIXES) for file in files)


def parquet_pieces(files: list[str]) -> tuple[list[Piece], list]:
    """One piece per row group, files in order, and each file's footer (`FileMetaData`: read once, so that reading
    a piece reads only its row group)."""
    import pyarrow.parquet as pq

    pieces, footers = [], []
    for index, path in enumerate(files):
        with open_file(path) as stream:
            footers.append(pq.ParquetFile(stream).metadata)
        pieces += [Piece(index, group, group + 1) for group in range(footers[-1].num_row_groups)]
    return pieces, footers


def line_pieces(sizes: list[int], readers: int) -> list[Piece]:
    """Byte ranges of about total / (readers x PIECES_PER_READER) bytes (at most MAX_LINE_PIECE_BYTES), files in
    order; a range never spans two files."""
    per_piece = min(MAX_LINE_PIECE_BYTES, max(1, -(-sum(sizes) // (readers * PIECES_PER_READER))))
    return [Piece(index, start, min(start + per_piece, size)) for index, size in enumerate(sizes)
            for start in range(0, size, per_piece)]  # fmt: skip


def digest(files: list[str], pieces: list[Piece], readers: int) -> str:
    """Names a cut: equal digests, the same pieces of the same files for the same readers."""
    text = "\n".join([*files, str(readers), *(f"{p.file}:{p.start}:{p.end}" for p in pieces)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parquet_rows(stream: IO[bytes], footer, piece: Piece, skip: int, columns: list[str] | None) -> Iterator[dict]:
    """The rows of a row-group piece as dicts, after the first `skip` (a resumed stream's position); `footer`: the
    file's metadata from `parquet_pieces`."""
    import pyarrow.parquet as pq

    seen, file = 0, pq.ParquetFile(stream, metadata=footer)
    for group in range(piece.start, piece.end):
        for batch in file.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group], columns=columns):
            if seen + batch.num_rows <= skip:
                seen += batch.num_rows
                continue
            yield from batch.slice(max(0, skip - seen)).to_pylist()
            seen += batch.num_rows


def piece_lines(stream: IO[bytes], piece: Piece, offset: int) -> Iterator[tuple[bytes, int]]:
    """(line, offset just after it) for the lines that start in the piece, from `offset`: a line start inside it
    (a resumed stream's position), or `piece.start`, where a line in progress belongs to the piece before."""
    position = offset
    if position == piece.start and position > 0:
        stream.seek(position - 1)
        if stream.read(1) != b"\n":
            position += len(stream.readline())
    stream.seek(position)
    while position < piece.end:
        line = stream.readline()
        if not line:
            return
        position += len(line)
        yield line, position
