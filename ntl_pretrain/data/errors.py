"""A source that cannot be read: one `DataError` line naming the source, the file and the cause."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ntl_pretrain.data.files import COMPRESSION_NAMES
from ntl_pretrain.errors import InputError

if TYPE_CHECKING:
    from ntl_pretrain.data.source_config import SourceConfig


class DataError(InputError):
    """A source that cannot be read; the one-line message names the source, the file and the cause."""

    kind = "data error"

    def one_line(self) -> str:
        """The message, also when a DataLoader worker re-raised it with the worker's traceback around it."""
        return str(self).strip().splitlines()[-1].split("DataError: ", 1)[-1]


@contextmanager
def reading_errors(source: SourceConfig, file: str) -> Iterator[None]:
    """Turn a failure to read `file` (a truncated or corrupt compressed file, malformed JSON) into a `DataError`
    naming the source and the file. Only reading happens inside: a generator's consumer runs outside it."""
    try:
        yield
    except DataError:
        raise
    except Exception as error:
        raise DataError(f"source {source.label!r}: {file}: {describe_read_error(file, error)}") from error


def describe_read_error(file: str, error: Exception) -> str:
    compression = COMPRESSION_NAMES.get(Path(file).suffix.lower())
    cause = f"{type(error).__name__}: {error}".splitlines()[0]
    if compression:
        return f"truncated or corrupt {compression} file ({cause})"
    return f"cannot read it ({cause})"
