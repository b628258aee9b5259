"""A checkpoint's manifest: every file it holds, with its size and checksum, so damage after the save (a copy cut
short, a disk that filled up, bit rot) is found before anything loads.

`manifest.json` is the last file written into `step_<N>.tmp` before the folder is renamed. Each rank checksums the
files it wrote (`writer`); rank 0 also those every rank shares (config, tokenizer, recipe) and writes the
manifest. Verification is a pure function of the folder: `check(folder, entries, mode)` lists what is wrong.

Checksum: xxHash3 (64-bit) over the file in 8 MiB blocks, several GB/s on one core (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash

from ntl_pretrain.errors import CommandFailed

MANIFEST = "manifest.json"
# The folder `reshard.py` converts a step's shards into, after the save: derived from files the manifest vouches for.
UNIVERSAL = "universal"
VERSION = 1
BLOCK_BYTES = 8 << 20
VerifyMode = Literal["checksum", "size"]
# Files one rank writes: DeepSpeed's ZeRO shards (`[bf16_]zero_pp_rank_<r>_mp_rank_00_*.pt`) and our per-rank
# files (`<folder>/rank_<r>.pt`). Everything else is written once, by rank 0.
RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_|/rank_(\d+)\.pt$")


def writer(relative: str) -> int | None:
    """The rank that wrote the file at `relative` (a path inside the step folder); None for rank 0's shared ones."""
    found = RANK_FILE.search(relative)
    return None if found is None else int(found.group(1) or found.group(2))


def files_written_by(folder: Path, rank: int) -> list[str]:
    """Paths inside `folder` (posix, relative) that `rank` wrote: its own shards, and for rank 0 the shared files."""
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name == MANIFEST:
            continue
        relative = path.relative_to(folder).as_posix()
        owner = writer(relative)
        if owner == rank or (owner is None and rank == 0):
            found.append(relative)
    return found


def checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with path.open("rb") as file:
        while block := file.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def describe(folder: Path, relatives: list[str], hashed: dict[str, dict] | None = None) -> dict[str, dict]:
    """{relative path: {"size", "xxh3_64"}} of files just written; those in `hashed` (checksummed while they were
    written, `HashingWriter`) are not read again."""
    hashed = hashed or {}
    return {
        relative: hashed.get(relative)
        or {"size": (folder / relative).stat().st_size, "xxh3_64": checksum(folder / relative)}
        for relative in relatives
    }


class HashingWriter:
    """A file opened for writing that checksums what passes through it: `torch.save(obj, HashingWriter(path))` then
    `.entry()` is the file's manifest entry, without reading it back (for a 100 GB checkpoint, minutes of I/O)."""

    def __init__(self, path: Path):
        self.name = str(path)  # as a file object's: what error messages and fault injection name
        self.file = path.open("wb")
        self.digest, self.size = xxhash.xxh3_64(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def entry(self) -> dict:
        return {"size": self.size, "xxh3_64": self.digest.hexdigest()}


def write(folder: Path, entries: dict[str, dict]) -> None:
    document = {"version": VERSION, "files": dict(sorted(entries.items()))}
    (folder / MANIFEST).write_text(json.dumps(document, indent=1) + "\n")


class DamagedCheckpointError(CommandFailed):
    """A checkpoint's files are not what its manifest says; nothing was loaded."""


class ManifestError(ValueError):
    """The manifest itself cannot be read."""


def read(folder: Path) -> dict[str, dict] | None:
    """The manifest's file entries; None for a checkpoint written without one (before manifests existed)."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
        files = document["files"]
        if not all({"size", "xxh3_64"} <= set(entry) for entry in files.values()):
            raise KeyError("size/xxh3_64")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"{path}: unreadable manifest ({type(error).__name__}: {error})") from error
    return files


@dataclass(frozen=True)
class Problem:
    """One file of a checkpoint that is not what the manifest says."""

    path: Path
    what: str
    """`missing`, `size N bytes, manifest says M`, `checksum ...` or `unreadable ...`."""

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def check(folder: Path, entries: dict[str, dict], mode: VerifyMode = "checksum") -> list[Problem]:
    """What is wrong with the files `entries` lists (sizes always, checksums unless mode is `size`); never raises."""
    problems = []
    for relative, expected in sorted(entries.items()):
        path = folder / relative
        what = _check_file(path, expected, mode)
        if what is not None:
            problems.append(Problem(path, what))
    return problems


def _check_file(path: Path, expected: dict, mode: VerifyMode) -> str | None:
    try:
        size = path.stat().st_size
        if size != expected["size"]:
            return f"size {size} bytes, manifest says {expected['size']}"
        if mode == "checksum" and (found := checksum(path)) != expected["xxh3_64"]:
            return f"checksum xxh3_64 {found}, manifest says {expected['xxh3_64']}"
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    return None


def share(entries: dict[str, dict], rank: int, world_size: int) -> dict[str, dict]:
    """The entries `rank` of `world_size` verifies: the files its saved counterpart wrote (saved rank r goes to
    rank r mod world_size, so a checkpoint of any size is covered), and on rank 0 the shared files."""
    return {relative: entry for relative, entry in entries.items() if (writer(relative) or 0) % world_size == rank}


def torch_files(folder: Path) -> dict[str, dict]:
    """The `.pt` files of a checkpoint without a manifest, as entries for `share` and `check_whole`."""
    return {path.relative_to(folder).as_posix(): {} for path in sorted(folder.rglob("*.pt")) if path.is_file()}


def check_whole(folder: Path, entries: dict[str, dict]) -> list[Problem]:
    """Without a manifest, the one thing a file can be checked for: each `.pt` of `entries` is a whole torch file
    (a zip archive whose central directory, written last, is there; a truncated one has none). Reads only the end
    of each file."""
    problems = []
    for relative in sorted(entries):
        try:
            zipfile.ZipFile(folder / relative).close()
        except (zipfile.BadZipFile, OSError) as error:
            problems.append(Problem(folder / relative, f"not a whole torch file, truncated? ({error})"))
    return problems


def verify(folder: Path, mode: VerifyMode = "checksum") -> list[Problem] | None:
    """Every file of one checkpoint, in this process: the manifest lists every file the folder holds, and each is as
    listed; without a manifest, its torch files' ends (`check_whole`), and None (unverifiable) when they are whole."""
    try:
        entries = read(folder)
    except ManifestError as error:
        return [Problem(folder / MANIFEST, str(error).split(": ", 1)[1])]
    if entries is None:
        return check_whole(folder, torch_files(folder)) or None
    if not entries:  # a save writes a manifest only after its files: an empty one vouches for nothing
        return [Problem(folder / MANIFEST, "lists no file; a checkpoint's manifest lists every file it saved")]
    return unlisted(folder, entries) + check(folder, entries, mode)


def unlisted(folder: Path, entries: dict[str, dict]) -> list[Problem]:
    """Files the folder holds that its manifest does not list (but for the manifest itself and reshard's derived
    folder): added after the save, so nothing vouches for them."""
    derived = (folder / UNIVERSAL, folder / f"{UNIVERSAL}.tmp")
    held = [path for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / MANIFEST
            and not any(path.is_relative_to(parent) for parent in derived)]  # fmt: skip
    return [Problem(path, "not in the manifest") for path in held if path.relative_to(folder).as_posix() not in entries]
