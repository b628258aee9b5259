"""A checkpoint's manifest: every file it holds, with its size and checksum, so damage after the save (a copy cut
short, a disk that filled up, bit rot) is found before anything loads.

`manifest.json` is the last file written into `step_<N>.tmp` before the folder is renamed. Each rank checksums the
files it wrote (`writer`); rank 0 also those every rank shares (config, tokenizer, recipe) and writes the
manifest, with the step the checkpoint holds (`saved_step`: the folder's name is only a label, which a user may
change). Verification is a pure function of the folder, one judgement for every command that reads a checkpoint:
`verify(folder, mode, rank, world_size)` lists what is wrong with the share of it that `rank` checks.

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
# What a resume on another number of ranks writes into a step folder after the save, and so no manifest lists: the
# universal copy, its temporary folder, and the pointer DeepSpeed's converter writes beside it (naming the copy).
DERIVED = (UNIVERSAL, f"{UNIVERSAL}.tmp", "latest_universal")
# Written by every save since manifests exist (`store.RANK_STATE`, `resume_guard.DATA_FINGERPRINT`, the first in
# the same change as the manifest): a folder holding one and no manifest lost its manifest after the save.
SAVED_WITH_A_MANIFEST = ("rank_state", "data_sources.json")
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


def all_files(folder: Path) -> list[str]:
    """Every file under `folder` (posix, relative), as a manifest of a whole folder lists them."""
    return [path.relative_to(folder).as_posix() for path in sorted(folder.rglob("*")) if path.is_file()]


def files_written_by(folder: Path, rank: int) -> list[str]:
    """Paths inside `folder` (posix, relative) that `rank` wrote: its own shards, and for rank 0 the shared files."""
    found = []
    for relative in all_files(folder):
        owner = writer(relative)
        if Path(relative).name != MANIFEST and (owner == rank or (owner is None and rank == 0)):
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


def write(folder: Path, entries: dict[str, dict], step: int | None = None) -> None:
    """`step`: the training step the checkpoint holds (what a resume continues from, whatever the folder is named);
    None for a manifest of derived files (the universal copy)."""
    document = {"version": VERSION, **({} if step is None else {"step": step}), "files": dict(sorted(entries.items()))}
    (folder / MANIFEST).write_text(json.dumps(document, indent=1) + "\n")


class DamagedCheckpointError(CommandFailed):
    """A checkpoint's files are not what its manifest says; nothing was loaded."""


class ManifestError(ValueError):
    """The manifest itself cannot be read, or is not a checkpoint manifest."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


def read(folder: Path) -> dict[str, dict] | None:
    """The manifest's file entries; None for a folder without one. A manifest that cannot be read, or whose
    content is not `{"version": 1, ["step": N,] "files": {path: {"size": bytes, "xxh3_64": digest}}}`, raises
    ManifestError."""
    document = _document(folder)
    return None if document is None else document["files"]


def saved_step(folder: Path) -> int | None:
    """The step the checkpoint in `folder` holds, as its save recorded it; None without a manifest, or for one
    written before manifests recorded the step. A malformed manifest raises ManifestError."""
    document = _document(folder)
    return None if document is None else document.get("step")


def _document(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ManifestError(path, f"unreadable ({error.strerror or error})") from error
    except ValueError as error:  # not JSON, or not UTF-8
        raise ManifestError(path, f"unreadable ({error})") from error
    _check_document(document, path)
    return document


def _check_document(document: object, path: Path) -> None:
    """A manifest document's `version`, `step` and each entry of its `files`, so that no later step meets a
    surprise type."""
    files = document.get("files") if isinstance(document, dict) else None
    if not isinstance(files, dict):
        raise ManifestError(path, f'not a checkpoint manifest (no "files" object in {_shown(document)})')
    if document.get("version") != VERSION:
        raise ManifestError(path, f"manifest version {_shown(document.get('version'))}; this ntl_pretrain reads "
                                  f"version {VERSION}")  # fmt: skip
    step = document.get("step", 0)
    if not (type(step) is int and step >= 0):
        raise ManifestError(path, f"not a checkpoint manifest (its step is {_shown(step)}, not a step number)")
    for relative, entry in files.items():
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ManifestError(path, f"not a checkpoint manifest ({relative!r} is not a path inside the checkpoint)")
        size, digest = (entry.get("size"), entry.get("xxh3_64")) if isinstance(entry, dict) else (None, None)
        if not (type(size) is int and size >= 0 and isinstance(digest, str)):
            raise ManifestError(path, f"not a checkpoint manifest (the entry of {relative} is {_shown(entry)}, not "
                                      f"{{\"size\": bytes, \"xxh3_64\": digest}})")  # fmt: skip


def _shown(value: object) -> str:
    """A JSON value as the manifest holds it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        except zipfile.BadZipFile as error:
            problems.append(Problem(folder / relative, f"not a whole torch file, truncated? ({error})"))
        except OSError as error:
            problems.append(Problem(folder / relative, f"unreadable ({error.strerror or error})"))
    return problems


def verify(folder: Path, mode: VerifyMode = "checksum", rank: int = 0, world_size: int = 1) -> list[Problem] | None:
    """The one judgement of a checkpoint, for every command that reads one (a resume, `verify`, `export`, `eval`,
    the universal converter): what is wrong with the files `rank` of `world_size` checks (`share`; one process
    checks them all). The folder must hold exactly the files its manifest lists, each as listed, apart from the
    manifest itself and what a resume derives from them (`DERIVED`); a file the manifest does not list is damage
    (loaders find files by name: DeepSpeed's shard patterns, the tokenizer folder), named by rank 0. Without a
    manifest: damage when the folder is of a format saved with one (`SAVED_WITH_A_MANIFEST`: the manifest was
    lost after the save); else it was saved before manifests existed, and the one thing that can be told is
    whether each torch file is whole (`check_whole`): None (unverifiable) when they are."""
    try:
        entries = read(folder)
    except ManifestError as error:
        return [Problem(error.path, error.what)]
    if entries is None:
        if (sign := sign_of_a_manifest(folder)) is not None:
            return [Problem(folder / MANIFEST, f"missing, though the folder holds {sign}, which only saves that write "
                                               "a manifest have: it was removed or lost after the save")]  # fmt: skip
        return check_whole(folder, share(torch_files(folder), rank, world_size)) or None
    if not entries:  # a save writes a manifest only after its files: an empty one vouches for nothing
        return [Problem(folder / MANIFEST, "lists no file; a checkpoint's manifest lists every file it saved")]
    added = unlisted(folder, entries) if rank == 0 else []
    return added + check(folder, share(entries, rank, world_size), mode)


def universal_damage(universal: Path, mode: VerifyMode = "checksum") -> str | None:
    """Why a step's universal copy (`reshard.py`, written with its own manifest of every file in it) cannot be
    trusted, or None when it is as written. It is derived from the step's shards, so damage costs a conversion,
    never the checkpoint: a copy without a manifest (written before copies had one) is distrusted alike."""
    try:
        entries = read(universal)
    except ManifestError as error:
        return error.what
    if entries is None:
        return f"no {MANIFEST} (written before universal copies had one)"
    problems = [*unlisted(universal, entries), *check(universal, entries, mode)]
    if not problems:
        return None
    return str(problems[0]) + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def sign_of_a_manifest(folder: Path) -> str | None:
    """The first of `SAVED_WITH_A_MANIFEST` the folder holds (`rank_state/`), or None."""
    found = next((name for name in SAVED_WITH_A_MANIFEST if (folder / name).exists()), None)
    return None if found is None else found + ("/" if (folder / found).is_dir() else "")


def unlisted(folder: Path, entries: dict[str, dict]) -> list[Problem]:
    """Files the folder holds that its manifest does not list, but for the manifest itself and what a resume
    derives (`DERIVED`): added after the save, so nothing vouches for them."""
    vouched = {MANIFEST, *entries}
    held = [relative for relative in all_files(folder) if relative.split("/")[0] not in DERIVED]
    return [Problem(folder / relative, "not in the manifest") for relative in held if relative not in vouched]
