"""Read one source as a stream of document strings, sharded over readers, with a resumable cursor.

A *reader* is one (data-parallel rank, DataLoader worker) pair. Reader `shard` of `num_shards` takes the
records whose index within the epoch is `shard` modulo `num_shards`, so readers are disjoint and together
cover every record once per epoch. The cursor records where the next record starts, so a resumed stream
continues exactly after the last record handed out, however often it is resumed.

Line formats (jsonl, txt) are read here rather than through HF `datasets`: its json builder aborts the
whole stream on the first invalid line and its text builder on the first invalid UTF-8 byte, while a
recipe must skip and count such records; a byte offset also makes resuming O(1). Parquet, arrow, JSON
arrays and hub datasets stream through HF `datasets`, whose `state_dict()` restores an unshuffled stream
exactly (no HF shuffle buffer is used: ours in `shuffle.py` keeps its contents in the state).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING

from ntl_pretrain.data import pieces
from ntl_pretrain.data.errors import DataError, reading_errors
from ntl_pretrain.data.files import COMPRESSION_SUFFIXES, is_remote, resolve_files, source_format
from ntl_pretrain.data.hub import HubListing, list_source
from ntl_pretrain.data.label_bits import NO_CE, NO_NTL

if TYPE_CHECKING:
    from ntl_pretrain.data.source_config import SourceConfig

UTF8_BOM = b"\xef\xbb\xbf"
SKIP_REASONS = ("invalid_utf8", "invalid_json", "not_a_record", "missing_field", "not_string", "empty")
HF_FORMATS = ("parquet", "arrow", "hub")


class BadRecord(Exception):
    """A record that cannot become a document; `args[0]` is one of `SKIP_REASONS`."""


@dataclass
class Cursor:
    """Where a source's stream stands: the next record is the first one after this point."""

    epoch: int = 0
    file_index: int = 0
    offset: int = 0
    """Byte offset of the next unread unit in the current file (line formats)."""
    unit_index: int = 0
    """Records seen so far in this epoch by any reader; the sharding key."""
    hf_state: dict | None = None
    """HF `IterableDataset.state_dict()` after the last record (HF formats)."""
    documents_this_epoch: int = 0
    whole_files: bool = True
    """HF formats: a reader with at least one file to itself reads whole files. False for a stream saved before
    there was this choice (`split_dataset_by_node` decided), so that it resumes where it was."""
    listing: str | None = None
    """Hub sources: the digest of the file list the stream reads (`hub.HubListing.digest`)."""
    listed_at: str | None = None
    """Hub sources: the commit the list was made at."""
    by_pieces: bool = True
    """A source with fewer files than readers (or one remote line file) is read by pieces (`pieces.py`) when it
    has at least one per reader. False for a stream saved before there was this choice: it resumes as it was."""
    cut: str | None = None
    """The digest of the cut this reader reads by pieces (`pieces.digest`); None when it reads by records."""
    piece: int = 0
    """Reading by pieces: the index, among this reader's pieces, of the one being read; `offset` is then the byte
    offset of the next line (line files) or the rows already read of it (parquet)."""


class QAText(str):
    """The text of a Q/A record (a source with an answer field) and where, in characters, its answer is: the
    encoder marks the answer's tokens (`packing.ANSWER`) and, for `ce_labels`/`ntl_labels: answer`, the labels
    outside it (`label_bits.NO_CE`, `label_bits.NO_NTL`). A `str`, so the mixture and batching pass it on unchanged."""

    answer_start: int
    answer_end: int
    outside_flags: int
    """Flags of the tokens outside the answer."""


def render(record: object, source: SourceConfig) -> str:
    """The document text of one parsed record (a `QAText` for a Q/A source), or `BadRecord(reason)`."""
    if not isinstance(record, dict):
        raise BadRecord("not_a_record")
    for name in source.template_fields:
        value = record.get(name)
        if value is None:
            raise BadRecord("missing_field")
        if not isinstance(value, str):
            raise BadRecord("not_string")
    text = record[source.text_field] if source.template is None else source.template.format_map(record)
    if not text.strip():
        raise BadRecord("empty")
    return text if source.answer is None else qa_text(text, record, source)


def qa_text(text: str, record: dict, source: SourceConfig) -> QAText:
    """`text` with its answer's span: the template up to the answer field, rendered, gives where the answer starts."""
    head = source.template.split("{" + source.answer + "}", 1)[0]
    document = QAText(text)
    document.answer_start = len(head.format_map(record))
    document.answer_end = document.answer_start + len(record[source.answer])
    document.outside_flags = (NO_CE if source.ce_labels == "answer" else 0) | (
        NO_NTL if source.ntl_labels == "answer" else 0
    )
    return document


def parse_unit(raw: bytes, fmt: str, source: SourceConfig) -> str:
    """Decode one line-format unit (a jsonl line or a txt line/paragraph/file) into document text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord("invalid_utf8") from None
    if fmt == "txt":
        if not text.strip():
            raise BadRecord("empty")
        return text
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        raise BadRecord("invalid_json") from None
    return render(record, source)


def open_binary(path: str) -> IO[bytes]:
    if path.endswith(".zst"):
        raw = fsspec_open(path) if is_remote(path) else open(path, "rb")
        return io.BufferedReader(ZstdReader(raw))
    if is_remote(path) or path.endswith(COMPRESSION_SUFFIXES):
        return fsspec_open(path, compression="infer")
    return open(path, "rb")


def fsspec_open(path: str, compression: str | None = None) -> IO[bytes]:
    import fsspec

    return fsspec.open(path, "rb", compression=compression).open()


class ZstdReader(io.RawIOBase):
    """Decompressed bytes of a (multi-frame) zstd stream. Unlike `zstandard`'s own stream reader it raises
    `EOFError` when the input ends inside a frame, as gzip, bz2 and xz do, so a truncated file is not read as a
    short one."""

    def __init__(self, raw: IO[bytes]):
        import zstandard

        self.raw, self.zstandard = raw, zstandard
        self.decompressor = zstandard.ZstdDecompressor().decompressobj()
        self.in_frame = False
        self.pending = memoryview(b"")
        """Decompressed bytes not yet handed out (one chunk's output may exceed the caller's buffer)."""
        self.position = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        while not self.pending:
            compressed = self.raw.read(1 << 16)
            if not compressed:
                if self.in_frame:
                    raise EOFError("zstd file ended before the end of its last frame")
                return 0
            self.pending = memoryview(self._decompress(compressed))
        count = min(len(buffer), len(self.pending))
        buffer[:count] = self.pending[:count]
        self.pending = self.pending[count:]  # a view: no copy of the rest
        self.position += count
        return count

    def _decompress(self, compressed: bytes) -> bytes:
        output = []
        while compressed:
            self.in_frame = True
            output.append(self.decompressor.decompress(compressed))
            if not self.decompressor.eof:
                break
            compressed, self.in_frame = self.decompressor.unused_data, False
            self.decompressor = self.zstandard.ZstdDecompressor().decompressobj()
        return b"".join(output)

    def close(self) -> None:
        self.raw.close()
        super().close()


def seek_forward(stream: IO[bytes], offset: int) -> None:
    """Move to `offset` from the start of a freshly opened stream; a zstd stream can only read its way there."""
    if stream.seekable():
        stream.seek(offset)
        return
    while stream.tell() < offset and stream.read(min(1 << 20, offset - stream.tell())):
        pass


def iter_units(stream: IO[bytes], sample_by: str) -> Iterator[tuple[bytes, int]]:
    """(unit bytes, offset just after it); blank lines are separators, never units."""
    if sample_by == "document":
        data = stream.read()
        if data.strip():
            yield data, stream.tell()
        return
    paragraph: list[bytes] = []
    for line in iter(stream.readline, b""):
        if line.strip():
            if sample_by == "line":
                yield line, stream.tell()
            else:
                paragraph.append(line)
        elif paragraph:
            yield b"".join(paragraph), stream.tell()
            paragraph = []
    if paragraph:
        yield b"".join(paragraph), stream.tell()


class SourceStream:
    """The documents of one source for one reader; infinite (epochs cycle) when `cycle` is set."""

    def __init__(
        self,
        source: SourceConfig,
        shard: int,
        num_shards: int,
        cycle: bool,
        skipped: Counter,
        listing: HubListing | None = None,
    ):
        """`listing`: a hub source's file list, made once for the run (`hub.list_for_all_ranks`); without one the
        stream lists the source itself, when it is made."""
        self.source = source
        self.shard, self.num_shards = shard, num_shards
        self.cycle = cycle
        self.skipped = skipped
        self.files = resolve_files(source)
        self.format = source_format(source, self.files[0])
        self.listing = listing
        self.cursor = self._fresh_cursor(epoch=0)
        self._documents: Iterator[str] | None = None
        self._cut: Cut | None | bool = False  # False: not worked out yet (it reads footers or sizes)

    def state_dict(self) -> dict:
        return asdict(self.cursor)

    def load_state_dict(self, state: dict) -> None:
        # Saved before `whole_files`: HF's own sharding; before `by_pieces`: every n-th record below a file per reader.
        self.cursor = Cursor(**{"whole_files": False, "by_pieces": False, **state})
        self._documents, self._cut = None, False
        if self.cursor.listing is not None and self.cursor.listing != self._hub_listing().digest:
            pin = f"set hub_revision: {self.cursor.listed_at}" if self.cursor.listed_at else "restore its files"
            raise DataError(
                f"source {self.source.label!r} ({self.source.path}): the hub dataset's files are not the ones the "
                f"checkpoint was reading (listed at {self.cursor.listed_at or 'a local folder'}, now at "
                f"{self._hub_listing().revision or 'a local folder'}); {pin} on this source to resume exactly"
            )

    def _fresh_cursor(self, epoch: int) -> Cursor:
        kept = {"whole_files": self.cursor.whole_files, "by_pieces": self.cursor.by_pieces,
                "cut": self.cursor.cut} if epoch else {}  # fmt: skip
        if self.format != "hub":
            return Cursor(epoch=epoch, **kept)
        return Cursor(epoch=epoch, listing=self._hub_listing().digest, listed_at=self._hub_listing().revision,
                      **kept)  # fmt: skip

    def _hub_listing(self) -> HubListing:
        if self.listing is None:
            with reading_errors(self.source, self.source.path):
                self.listing = list_source(self.source)
        return self.listing

    def next_document(self) -> str | None:
        """The next document of this reader's shard; None when a finite stream is exhausted."""
        while True:
            if self._documents is None:
                self._documents = self._read_epoch()
            document = next(self._documents, None)
            if document is not None:
                return document
            if not self.cycle:
                return None
            self._start_next_epoch()

    def _start_next_epoch(self) -> None:
        if self.cursor.documents_this_epoch == 0:
            skipped = ", ".join(f"{count} {reason}" for reason, count in sorted(self.skipped.items())) or "none"
            raise DataError(
                f"source {self.source.label!r} ({self.source.path}): a whole epoch gave reader {self.shard} of "
                f"{self.num_shards} no usable document (records skipped so far: {skipped}); the source has too few "
                f"valid records for this many readers (data-parallel ranks x workers){self._fewer_documents_hint()}"
            )
        self.cursor = self._fresh_cursor(epoch=self.cursor.epoch + 1)
        self._documents = None

    def _fewer_documents_hint(self) -> str:
        """A txt source read by paragraph or file holds fewer documents than lines."""
        if self.format != "txt" or self.source.sample_by == "line":
            return ""
        return f"; a txt source read by {self.source.sample_by} has one document per {self.source.sample_by}: if " \
            "its records are lines, set sample_by: line"  # fmt: skip

    def _read_epoch(self) -> Iterator[str]:
        cut = self._pieces_cut()
        line_format = "txt" if self.format == "txt" else "jsonl"
        if cut is not None:
            units = self._piece_units(cut)
            parse = (lambda record: render(record, self.source)) if cut.kind == "parquet" else (
                lambda raw: parse_unit(raw, line_format, self.source))  # fmt: skip
        elif self.reads_through_datasets():
            units, parse = self._hf_records(), lambda record: render(record, self.source)
        else:
            units, parse = self._line_units(), lambda raw: parse_unit(raw, line_format, self.source)
        for raw in units:
            try:
                document = parse(raw)
            except BadRecord as bad:
                self.skipped[bad.args[0]] += 1
                continue
            self.cursor.documents_this_epoch += 1
            yield document

    def _pieces_cut(self) -> Cut | None:
        """The cut this reader reads by pieces, or None to read by records (or whole files); worked out once."""
        if self._cut is False:
            self._cut = self._make_cut() if self.cursor.by_pieces else None
        if self._cut is not None:
            if self.cursor.cut is None:
                self.cursor.cut = self._cut.digest
            elif self.cursor.cut != self._cut.digest:
                raise DataError(
                    f"source {self.source.label!r} ({self.source.path}): its files changed since the checkpoint "
                    f"(sizes or row groups: the cut into pieces differs); restore them to resume exactly"
                )
        return self._cut

    def _make_cut(self) -> Cut | None:
        """A cut when the source needs one (fewer files than readers, or a remote line file) and it gives every
        reader at least one piece; else None (every n-th record: each reader reads the whole stream)."""
        found = self._files_to_cut()
        if found is None:
            return None
        kind, files = found
        with reading_errors(self.source, self.source.path):
            if kind == "parquet":
                cut, footers = pieces.parquet_pieces(files)
            else:
                cut, footers = pieces.line_pieces([pieces.file_size(file) for file in files], self.num_shards), []
        if len(cut) < self.num_shards:
            return None
        return Cut(kind, files, cut, pieces.digest(files, cut, self.num_shards), footers)

    def _files_to_cut(self) -> tuple[str, list[str]] | None:
        """("parquet" | "lines", the files) for a source that would otherwise read all of itself in every reader."""
        if self.format == "hub":
            listing = self._hub_listing()
            files = list(listing.files)
            if len(files) >= self.num_shards or set(listing.config_kwargs) - {"columns"}:
                return None
            if listing.builder == "parquet":
                return "parquet", files
            jsonl = all(file.lower().endswith(".jsonl") for file in files) and not listing.config_kwargs
            return ("lines", files) if listing.builder == "json" and jsonl else None
        if self.format == "parquet" and len(self.files) < self.num_shards:
            return "parquet", self.files
        line_file = self.format == "jsonl" or (self.format == "txt" and self.source.sample_by == "line")
        if line_file and is_remote(self.files[0]) and pieces.splittable_lines(self.files):
            return "lines", self.files
        return None

    def _piece_units(self, cut: Cut) -> Iterator[bytes | dict]:
        """This reader's pieces (every num_shards-th of the cut), from the cursor: rows (parquet) or lines."""
        cursor, mine = self.cursor, cut.pieces[self.shard :: self.num_shards]
        columns = self._hub_listing().config_kwargs.get("columns") if self.format == "hub" else None
        while cursor.piece < len(mine):
            piece = mine[cursor.piece]
            path = cut.files[piece.file]
            with reading_errors(self.source, path), pieces.open_file(path) as stream:
                if cut.kind == "parquet":
                    for row in pieces.parquet_rows(stream, cut.footers[piece.file], piece, cursor.offset, columns):
                        cursor.offset += 1
                        cursor.unit_index += 1
                        yield row
                else:
                    for line, end in pieces.piece_lines(stream, piece, cursor.offset or piece.start):
                        first = end == len(line)  # the file's first line: it may start with a byte-order mark
                        cursor.offset = end
                        if line.strip():
                            cursor.unit_index += 1
                            yield line.removeprefix(UTF8_BOM) if first else line
            cursor.piece += 1
            cursor.offset = 0

    def reads_through_datasets(self) -> bool:
        """Parquet, arrow, a JSON array and hub datasets are read by HF `datasets`; line files line by line."""
        return self.format in HF_FORMATS or (self.format == "json" and _is_json_array(self.files[0]))

    def _owns(self, unit_index: int) -> bool:
        return unit_index % self.num_shards == self.shard

    def _line_units(self) -> Iterator[bytes]:
        sample_by = self.source.sample_by if self.format == "txt" else "line"
        cursor = self.cursor
        while cursor.file_index < len(self.files):
            file = self.files[cursor.file_index]
            with reading_errors(self.source, file), open_binary(file) as stream:
                seek_forward(stream, cursor.offset)
                for raw, end in iter_units(stream, sample_by):
                    owned = self._owns(cursor.unit_index)
                    cursor.unit_index += 1
                    first = cursor.offset == 0
                    cursor.offset = end
                    if owned:
                        yield raw.removeprefix(UTF8_BOM) if first else raw
            cursor.file_index += 1
            cursor.offset = 0

    def _hf_records(self) -> Iterator[dict]:
        # HF's `state_dict()` of the sharded stream resumes exactly, also when resumed again.
        with reading_errors(self.source, self.source.path):
            dataset = self._my_share(self._hf_dataset())
            if self.cursor.hf_state is not None:
                dataset.load_state_dict(self.cursor.hf_state)
            # `.iter()` rather than `iter(dataset)`: inside a DataLoader worker the latter re-shards by worker.
            for batch in dataset.iter(batch_size=1):
                self.cursor.hf_state = dataset.state_dict()
                yield {key: values[0] for key, values in batch.items()}

    def _my_share(self, dataset):
        """Whole files (`n_shards` is the file count) when every reader can have at least one: file `k` goes to
        reader `k mod readers`, which downloads and decodes only its own. With fewer files than readers, every n-th
        record: each reader reads the whole stream to keep its share (docs/data.md, "Sharding"). HF's own
        `split_dataset_by_node` hands out whole files only when the readers divide the file count (the same files
        as here), and every n-th record otherwise."""
        from datasets.distributed import split_dataset_by_node

        if self.cursor.whole_files and dataset.n_shards >= self.num_shards:
            return dataset.shard(num_shards=self.num_shards, index=self.shard, contiguous=False)
        return split_dataset_by_node(dataset, rank=self.shard, world_size=self.num_shards)

    def _hf_dataset(self):
        from datasets import load_dataset

        if self.format == "hub":
            return self._hub_listing().open()
        builder = {"parquet": "parquet", "arrow": "arrow", "json": "json"}[self.format]
        return load_dataset(builder, data_files=self.files, split="train", streaming=True)


@dataclass(frozen=True)
class Cut:
    """A source cut into pieces (`pieces.py`): how they are read, the files they index, the pieces in order."""

    kind: str
    """"parquet" (row groups) or "lines" (byte ranges of line files)."""
    files: list[str]
    pieces: list[pieces.Piece]
    digest: str
    footers: list
    """Parquet: each file's `FileMetaData`, read when the cut was made."""


def _is_json_array(path: str) -> bool:
    """A `.json` file holding one JSON array goes to HF's json builder; JSON lines are read line by line."""
    with open_binary(path) as stream:
        head = stream.read(4096).removeprefix(UTF8_BOM).lstrip()
    return head.startswith(b"[")
