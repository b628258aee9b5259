"""Which files a source names and how each is read: local paths, globs and folders resolved in a fixed order,
remote URLs and hub datasets passed through, the reader format told from the suffix. Reads no file content (that
is `probe.py`'s and `sources.py`'s work)."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import TYPE_CHECKING

from ntl_pretrain.package_files import resolve_path

if TYPE_CHECKING:
    from ntl_pretrain.data.source_config import SourceConfig

FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt", ".arrow": "arrow"}
COMPRESSION_NAMES = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
COMPRESSION_SUFFIXES = tuple(COMPRESSION_NAMES)


def is_remote(path: str) -> bool:
    return "://" in path


def resolve_files(source: SourceConfig) -> list[str]:
    """The files of a source in a fixed (sorted) order; raises `ValueError` naming the path if none exist."""
    if source.format == "hub" or is_remote(source.path):
        return [source.path]
    try:
        path = resolve_path(source.path)  # `pkg:` inside an installed package
    except FileNotFoundError as error:  # a `pkg:` path naming a package that is not installed
        raise ValueError(f"path: {error}") from error
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    elif glob.has_magic(str(path)):
        files = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    else:
        files = [str(path)] if path.is_file() else []
    if not files:
        raise ValueError(f"path: no file matches {source.path!r} (looked for {path})")
    return files


def source_format(source: SourceConfig, file: str) -> str:
    """The reader format of one file; raises `ValueError` naming the file when it cannot be told."""
    if source.format != "auto":
        return source.format
    name = file.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    suffix = Path(name).suffix
    if suffix not in FORMAT_BY_SUFFIX:
        raise ValueError(
            f"path: cannot tell the format of {file!r} from its suffix {suffix!r}; expected one of "
            f"{sorted(FORMAT_BY_SUFFIX)} or set `format:`"
        )
    return FORMAT_BY_SUFFIX[suffix]
