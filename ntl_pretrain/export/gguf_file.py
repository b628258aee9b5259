"""A GGUF file checked before conversion: it exists (`pkg:` paths allowed) and starts with the GGUF magic (at once:
`convert-gguf` refuses such a file in one line before it says anything), and its whole header and tensor table parse
(seconds: a tokenizer's vocabulary is in the header)."""

from __future__ import annotations

from pathlib import Path

from ntl_pretrain.errors import InputError
from ntl_pretrain.package_files import resolve_path

GGUF_MAGIC = b"GGUF"


def checked_gguf(gguf: str) -> Path:
    """The resolved path of a readable GGUF file; `FileNotFoundError` or `InputError` naming it otherwise."""
    path = gguf_path(gguf)
    check_gguf_readable(path)
    return path


def gguf_path(gguf: str) -> Path:
    """The resolved path of a file that starts as a GGUF file does (reads 4 bytes)."""
    path = resolve_path(gguf).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file ({path})")
    with path.open("rb") as file:
        if file.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise InputError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return path


def check_gguf_readable(path: Path) -> None:
    """The whole header and tensor table parse (gguf's reader maps the file and reads no tensor data): a file cut
    short or damaged is refused naming it, rather than failing inside transformers' loader."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as error:  # struct.error, ValueError, IndexError ... whatever the damage makes the parser meet
        raise InputError(f"{path}: damaged or truncated GGUF file ({type(error).__name__}: {error})") from error
