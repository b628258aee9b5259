"""What a command may write, and how: nothing a user did not ask to lose.

`check_output`, before any work: an output that is one of the command's inputs, or a folder that holds one, is
refused whatever the flags (a new file inside an input folder is fine: eval.json beside a run's metrics); a
symlink, or an existing file or non-empty folder, is refused unless the command was given `--overwrite` (a user
names an existing path by mistake more often than on purpose) or it is the command's own earlier output (`ours`).
`write_file` and `write_folder` then write beside the target and rename into place, so an interrupted write leaves
the old target or none, never half of one, and `--overwrite` of a symlink replaces the link, not what it points to.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from ntl_pretrain.errors import InputError, check_can_write

SIGNATURE = "ntl-pretrain"
"""In the metadata of every image this project writes (`IMAGE_METADATA`), so that a later command recognises it."""
IMAGE_METADATA = {"Software": SIGNATURE}


def check_output(label: str, path: Path, inputs: Iterable[Path | str] = (), overwrite: bool = False,
                 folder: bool = False, ours: Callable[[Path], bool] | None = None) -> None:  # fmt: skip
    """Raise `InputError` naming `label` when `path` may not be written (module docstring). `ours(path)`: whether
    an existing file is this command's own earlier output (a report it regenerates), which it may replace."""
    path = Path(path).expanduser()
    target = path.resolve()
    if path.exists() and path.is_dir() != folder:
        check_can_write(label, path, folder=folder)  # a file where a folder goes, or the reverse: says which
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if target == source or target in source.parents:
            raise InputError(f"{label}: {path} is (or holds) the input {given}; write elsewhere")
    if path.is_symlink():
        if not overwrite:
            raise InputError(f"{label}: {path} is a symlink to {os.readlink(path)}; name another path, or give "
                             f"--overwrite to replace the link (never what it points to)")  # fmt: skip
        return check_can_write(label, path.parent, folder=True)
    if path.exists() and not overwrite and not _empty_folder(path) and not (ours and path.is_file() and ours(path)):
        kind = "folder" if path.is_dir() else "file"
        raise InputError(f"{label}: {path} exists ({kind}); name a new path, or give --overwrite to replace it")
    check_can_write(label, path, folder=folder)


def check_outputs_in(label: str, folder: Path, names: Iterable[str], overwrite: bool = False) -> None:
    """`check_output` of each file a command writes under `folder` (a corpus generator's `<set>/<split>.jsonl`)."""
    check_can_write(label, Path(folder).expanduser(), folder=True)
    for name in names:
        check_output(label, Path(folder).expanduser() / name, overwrite=overwrite)


def starts_with(marker: bytes, within: int = 4096) -> Callable[[Path], bool]:
    """A predicate for `ours`: `marker` appears in the file's first `within` bytes."""

    def found(path: Path) -> bool:
        with path.open("rb") as file:
            return marker in file.read(within)

    return found


def _empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _beside(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{what}-{os.getpid()}")


def write_file(path: Path, write: Callable[[Path], None]) -> Path:
    """`write(temporary)` beside `path`, then renamed over it (a symlink at `path` is replaced, not followed)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _beside(path, "partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def write_text(path: Path, text: str) -> Path:
    return write_file(path, lambda partial: partial.write_text(text, encoding="utf-8"))


def write_folder(path: Path, write: Callable[[Path], None]) -> Path:
    """`write(temporary folder)` beside `path`, then renamed into place; an existing `path` (checked by
    `check_output`) is moved aside first and removed once the new folder is in place."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial, old = _beside(path, "partial"), _beside(path, "old")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        write(partial)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            path.rename(old)
        partial.rename(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return path
