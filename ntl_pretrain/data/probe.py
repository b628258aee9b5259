"""A cheap look at every file of a source before a run starts: its first bytes and its first records.

A damaged or mislabelled file otherwise surfaces minutes into a run, on one rank, as a skip counter or "too few
valid records". Here each one fails the recipe with one line naming the file and the cause: an empty file, a
compression the name does not match (or a name promising one the content lacks), a parquet or arrow file named as
text, a compressed file truncated within its first records, a malformed JSON array, an unreadable parquet footer
or arrow header, or first records (a schema, for parquet and arrow) none of which holds the fields the source reads
(the message lists the fields there are). Remote files and hub datasets are
not opened here; the same causes found later during the run stop it with the same kind of message.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ntl_pretrain.data.errors import DataError, reading_errors
from ntl_pretrain.data.files import COMPRESSION_NAMES, is_remote, resolve_files, source_format
from ntl_pretrain.data.sources import UTF8_BOM, BadRecord, open_binary, parse_unit, render

if TYPE_CHECKING:
    from ntl_pretrain.data.source_config import SourceConfig

BETWEEN_ELEMENTS = re.compile(r"[\s,]*")
PROBE_RECORDS = 64
PROBE_BYTES = 1 << 20
MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bz2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PAR1", "parquet"),
    (b"ARROW1", "arrow"),
    (b"\xff\xff\xff\xff", "arrow"),  # the IPC stream format that HF `datasets` writes
)


def check_files_of(sections: dict[str, list[SourceConfig]]) -> None:
    """`check_source_files` of every source of a recipe section's lists; the error names the item
    (`sources.1.path: ...`)."""
    for section, sources in sections.items():
        for index, source in enumerate(sources):
            try:
                check_source_files(source)
            except ValueError as error:
                raise ValueError(f"{section}.{index}.{error}") from None


def check_source_files(source: SourceConfig) -> None:
    """What `SourceConfig.check` cannot see without the files: they exist, are of one format whose reader takes the
    keys set, and their first bytes and records hold what the source reads. `ValueError("<key>: ...")` otherwise."""
    formats = {source_format(source, path) for path in resolve_files(source)}
    if len(formats) > 1:
        raise ValueError(f"path: {source.path!r} mixes formats {sorted(formats)}; use one source per format")
    source.check_keys_apply(formats.pop() if formats else source.format)
    probe_source(source)


class MissingFields(DataError):
    """The records hold none of the fields the source reads: the key at fault is `text_field` or `template`."""


def probe_source(source: SourceConfig) -> None:
    """Raise `ValueError("<key>: <file>: <cause>")` for the first local file that cannot serve this source: the key
    is `path`, or the one naming the fields (`text_field`, `template`) when the records lack them, so that an
    override of that key is blamed, not the file that set the path."""
    if source.format == "hub" or is_remote(source.path):
        return
    for file in resolve_files(source):
        try:
            _probe_file(source, file)
        except MissingFields as error:
            raise ValueError(f"{'template' if source.template is not None else 'text_field'}: {error}") from None
        except DataError as error:
            raise ValueError(f"path: {error}") from None


def _probe_file(source: SourceConfig, file: str) -> None:
    fmt = source_format(source, file)
    _check_content_matches_name(file, fmt)
    if fmt in ("parquet", "arrow"):
        _check_columns(source, file, fmt)
        return
    with reading_errors(source, file), open_binary(file) as stream:
        start = stream.read(4096).removeprefix(UTF8_BOM)
        if fmt == "json" and start.lstrip().startswith(b"["):
            head = start + stream.read(PROBE_BYTES - len(start))
            whole = len(head) < PROBE_BYTES
        else:
            head, whole = start + (stream.read(PROBE_BYTES) if fmt == "txt" else _first_lines(stream)), True
    if not head.strip():
        raise DataError(f"{file}: empty file (no record)")
    if fmt == "txt":
        return
    if fmt == "json" and head.lstrip().startswith(b"["):
        records = _array_head(file, head, whole)
        _check_records(source, file, records, parse=lambda record: render(record, source))
        return
    lines = [line for line in head.splitlines() if line.strip()][:PROBE_RECORDS]
    _check_records(source, file, lines, parse=lambda line: parse_unit(line, "jsonl", source))


def _first_lines(stream) -> bytes:
    """Whole lines up to `PROBE_RECORDS` of them or `PROBE_BYTES` (a longer first line is read to its end)."""
    lines: list[bytes] = []
    size = 0
    while len(lines) < PROBE_RECORDS and size < PROBE_BYTES:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        size += len(line)
    return b"".join(lines)


def _check_content_matches_name(file: str, fmt: str) -> None:
    with open(file, "rb") as stream:
        first = stream.read(8)
    if not first:
        raise DataError(f"{file}: empty file")
    content = next((name for magic, name in MAGIC if first.startswith(magic)), None)
    suffix = Path(file).suffix.lower()
    compression = COMPRESSION_NAMES.get(suffix)
    if compression and content != compression:
        actual = f"its content is {content}" if content else f"it is not {compression}-compressed"
        raise DataError(f"{file}: named {suffix} but {actual}")
    if compression is None and content in COMPRESSION_NAMES.values():
        ending = next(ending for ending, name in COMPRESSION_NAMES.items() if name == content)
        raise DataError(
            f"{file}: {content}-compressed, but its name does not say so; name it {Path(file).name}{ending}"
        )
    if fmt in ("parquet", "arrow") and content != fmt:
        raise DataError(f"{file}: not a {fmt} file (format {fmt}, from its name or `format:`)")
    if fmt in ("jsonl", "json", "txt") and content in ("parquet", "arrow"):
        raise DataError(f"{file}: a {content} file read as {fmt}; name it .{content} or set `format: {content}`")


def _check_columns(source: SourceConfig, file: str, fmt: str) -> None:
    """A parquet footer or arrow stream header is read (a truncated file fails here) and must name every field
    the source reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            columns = pq.ParquetFile(file).schema_arrow.names
        else:
            with pa.OSFile(file) as stream:
                columns = pa.ipc.open_stream(stream).schema.names
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{file}: not a readable {fmt} file ({type(error).__name__}: {error})") from None
    missing = [name for name in source.template_fields if name not in columns]
    if missing:
        wanted = ", ".join(repr(name) for name in missing)
        raise MissingFields(f"{file}: no column {wanted}; the columns are {columns}")


def _array_head(file: str, head: bytes, whole: bool) -> list:
    """The first records of a JSON-array file; `whole` when `head` is the entire file."""
    text = head.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    try:
        if whole:
            value = json.loads(text)
            if not isinstance(value, list):
                raise DataError(f"{file}: a JSON {type(value).__name__}, expected an array of records or JSON lines")
            return value[:PROBE_RECORDS]
        records, position = [], text.index("[") + 1
        while len(records) < PROBE_RECORDS:
            position = BETWEEN_ELEMENTS.match(text, position).end()
            if text.startswith("]", position):
                break
            record, position = decoder.raw_decode(text, position)
            records.append(record)
        return records
    except json.JSONDecodeError as error:
        if not whole and error.pos >= len(text) - 1:
            return records  # the probe's byte limit cut a record; those before it are whole
        raise DataError(f"{file}: malformed JSON array ({error})") from None


def _check_records(source: SourceConfig, file: str, records: list, parse) -> None:
    """Pass when at least one of the first records gives a document; otherwise say why none does."""
    reasons: Counter = Counter()
    for record in records:
        try:
            parse(record)
            return
        except BadRecord as bad:
            reasons[bad.args[0]] += 1
    probed = f"none of the first {len(records)} records"
    if reasons["invalid_json"] + reasons["invalid_utf8"] == len(records):
        raise DataError(f"{file}: {probed} is valid UTF-8 JSON; is it JSON lines? (`format: txt` reads plain text)")
    fields = sorted({name for record in _parsed(records) for name in record})
    wanted = ", ".join(repr(name) for name in source.template_fields)
    if reasons["missing_field"]:
        raise MissingFields(f"{file}: {probed} has all of the fields {wanted}; the records have fields {fields}")
    described = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    raise DataError(f"{file}: {probed} gives a document ({described}; fields read: {wanted})")


def _parsed(records: list) -> list[dict]:
    """The records that are JSON objects (lines are parsed, array elements already are)."""
    parsed = []
    for record in records:
        if isinstance(record, bytes):
            try:
                record = json.loads(record)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        if isinstance(record, dict):
            parsed.append(record)
    return parsed
