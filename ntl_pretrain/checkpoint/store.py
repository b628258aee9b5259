"""Crash-safe DeepSpeed checkpoints under `<output_dir>/checkpoints/step_<N>/`.

A save writes to `step_<N>.tmp`, then rank 0 renames it to `step_<N>` (atomic on one filesystem) and only then
rewrites the `latest` pointer (fsynced temp file + `os.replace`). A kill at any moment therefore leaves `latest`
naming a complete checkpoint; resume still trusts the folders, not the pointer: one that is empty, dangling or
names a folder that is not a checkpoint (`is_checkpoint`) gives way to the newest checkpoint folder. Old
checkpoints beyond `keep_last` are deleted after the pointer moves.

The last file written before the rename is `manifest.json` (`ntl_pretrain.checkpoint.manifest`): every file's size and
checksum. A resume verifies the checkpoint on all ranks before anything loads (`resolve_verified_resume`): `auto`
falls back to the newest checkpoint that verifies, an explicit path that fails stops the run naming the file.

Each published folder also holds what export needs without the recipe: `hf_config/` (config.json),
`tokenizer/` and `recipe.yaml`; every rank's data-loader and RNG state (`rank_state/rank_<r>.pt`); with a
vocabulary-parallel output layer, every rank's slice (`vocab_parallel/`). Beside them, `zero_to_fp32.py` (and
`zero_to_torch.py`) convert a checkpoint to an HF folder with DeepSpeed's command line.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import resource
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.runtime.process_group import slow_work_group

STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
HF_CONFIG = "hf_config"
# DeepSpeed drops its own top-level names (`skipped_steps`, `global_steps`, ...) from the client state it hands
# back on load, so ours lives under one key of its own.
CLIENT_STATE_KEY = "ntl_pretrain"
TOKENIZER = "tokenizer"
RANK_STATE = "rank_state"
WRITE_ERRNO_CAUSES = {errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied",
                      errno.EPERM: "permission denied", errno.EROFS: "the filesystem is read-only"}  # fmt: skip
LOW_SPACE_BYTES = 64 << 20  # a checkpoint write that fails with less free than this is blamed on the full disk
logger = logging.getLogger(__name__)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict:
    """This process's random generators, as types `torch.load(weights_only=True)` reads back."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank; nothing was published, so the previous checkpoint and `latest` are untouched."""


def write_rank_state(folder: Path, state: dict) -> None:
    """This rank's state that the engine does not hold (data loader, RNGs), in a file of its own: a save moves
    nothing between ranks, and each rank writes only its own bytes."""
    path = folder / RANK_STATE / f"rank_{dist.get_rank():05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


class SavedRankStates(Sequence):
    """Every saved rank's `write_rank_state` state, `[saved rank]`, each file read when first indexed: resuming
    on the same ranks reads rank 0's and its own, on another number all of them."""

    def __init__(self, folder: Path, world_size: int):
        self.folder, self.world_size, self.loaded = folder, world_size, {}

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, rank: int) -> dict:
        if not 0 <= rank < self.world_size:
            raise IndexError(rank)
        if rank not in self.loaded:
            path = self.folder / RANK_STATE / f"rank_{rank:05d}.pt"
            self.loaded[rank] = torch.load(path, map_location="cpu", weights_only=True)
        return self.loaded[rank]


class Part(Sequence):
    """`[states[r][key] for r ...]` that indexes `states` only where asked (so no rank file is read early)."""

    def __init__(self, states: Sequence[dict], key: str):
        self.states, self.key = states, key

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, rank: int):
        return self.states[rank][self.key]


def save(
    engine,
    root: Path,
    step: int,
    client_state: dict,
    keep_last: int,
    write_extras: Callable[[Path], None],
    write_rank_files: Callable[[Path], None] | None = None,
) -> Path:
    """Save on all ranks, publish on rank 0; `write_extras(folder)` adds the export files (rank 0),
    `write_rank_files(folder)` state the engine does not hold (every rank), both before the folder is published.

    A write that fails on any rank (a full disk) fails the save on every rank with `CheckpointWriteError`. Old
    checkpoints are pruned in the background after the publish (`old_checkpoints_pruned`): deleting a 100 GB folder
    takes minutes, longer than the other ranks may wait in a collective."""
    tag, temp = f"step_{step}", root / f"step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        old_checkpoints_pruned()
        shutil.rmtree(temp, ignore_errors=True)
    dist.barrier()
    hashed: dict[str, dict] = {}
    failure = _engine_save(engine, root, temp.name, client_state, hashed)
    writes = [write_rank_files, write_extras if rank == 0 else None]
    for write in writes:
        if failure is None and write is not None:
            failure = _attempt(lambda write=write: write(temp), root)
    entries = {}
    if failure is None:
        written = manifest.files_written_by(temp, rank)
        failure = _attempt(lambda: entries.update(manifest.describe(temp, written, hashed)), root)
    failure = _write_manifest(temp, failure, entries, step)
    if failure is not None:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint {tag} was not saved: {failure}; {_previous(root)}")
    if rank == 0:
        _publish(root, temp.name, tag, step)
        _pruning.start(lambda: _prune(root, root / tag, keep_last))
        _replace_recovery_scripts(root)
    dist.barrier()
    return root / tag


class _BackgroundPruning:
    """Rank 0's deletion of old checkpoints, on a thread of its own while training goes on."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, prune: Callable[[], None]) -> None:
        def run() -> None:
            try:
                prune()
            except BaseException as error:  # noqa: BLE001 - raised where the pruning is waited for
                self.error = error

        self.thread = threading.Thread(target=run, name="checkpoint-pruning", daemon=True)
        self.thread.start()

    def join(self) -> None:
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error


_pruning = _BackgroundPruning()


def old_checkpoints_pruned() -> None:
    """Wait for the pruning the last save started (rank 0): before the next save, and before the rank exits."""
    _pruning.join()


def _engine_save(engine, root: Path, tag: str, client_state: dict, hashed: dict[str, dict]) -> str | None:
    """`engine.save_checkpoint`, with a failed file write recorded instead of raised: DeepSpeed's save has
    collectives after its writes (ZeRO-3 re-gathers persistent parameters, then a barrier) that the other ranks
    wait in, so the failing rank must go through them too before the ranks agree on the outcome.

    DeepSpeed's torch writer is handed a file that checksums the bytes on their way to disk, and `hashed` gets
    each file's manifest entry (keyed by its path inside `root / tag`): the shards are not read back to checksum."""
    failures: list[str | None] = []
    write = engine.checkpoint_engine.save
    hashes_while_writing = type(engine.checkpoint_engine).__name__ == "TorchCheckpointEngine"

    def write_hashed(state_dict, path) -> None:
        with manifest.HashingWriter(Path(path)) as file:
            write(state_dict, file)  # torch.save takes a file object where DeepSpeed passes a path
        hashed[Path(path).relative_to(root / tag).as_posix()] = file.entry()

    def write_unless_failed(state_dict, path) -> None:
        if not any(failures):  # after one failed write the others are skipped: the save is lost anyway
            failures.append(_attempt(lambda: (write_hashed if hashes_while_writing else write)(state_dict, path), root))

    engine.checkpoint_engine.save = write_unless_failed
    try:
        client = {CLIENT_STATE_KEY: client_state}
        save = partial(engine.save_checkpoint, str(root), tag=tag, client_state=client, save_latest=False)
        failures.append(_attempt(save, root))
    finally:
        del engine.checkpoint_engine.save  # the class's method again
    return next((failure for failure in failures if failure is not None), None)


def _attempt(write: Callable[[], object], folder: Path) -> str | None:
    """None when `write` (into `folder`) succeeds, else what went wrong on this rank, in words."""
    try:
        write()
    except (OSError, RuntimeError) as error:  # torch.save's zip writer reports a failed write as a RuntimeError
        return f"rank {dist.get_rank()}: {_describe_write_error(error, folder)}"
    return None


def _describe_write_error(error: Exception, folder: Path) -> str:
    """The error, with its cause named where it is one a user can fix: a full disk (ENOSPC, or any failed write with
    less than `LOW_SPACE_BYTES` left: torch's zip writer then says only "unexpected pos 128 vs 0"), a file-size limit
    (EFBIG, or that short write under `ulimit -f`), a quota, a permission or a read-only filesystem."""
    raw = f"{type(error).__name__}: {error}"
    code = error.errno if isinstance(error, OSError) else None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if code == errno.ENOSPC or "No space left on device" in str(error) or (free is not None and free < LOW_SPACE_BYTES):
        left = "" if free is None else f", {free:,} bytes free"
        return f"the disk is full ({folder}{left}; {raw})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code == errno.EFBIG or (limit != resource.RLIM_INFINITY and "unexpected pos" in str(error)):
        shown = "" if limit == resource.RLIM_INFINITY else f": {limit:,} bytes (ulimit -f)"
        return f"a file reached the file-size limit{shown} ({folder}; {raw})"
    if code in WRITE_ERRNO_CAUSES:
        return f"{WRITE_ERRNO_CAUSES[code]} ({folder}; {raw})"
    return raw


def _write_manifest(temp: Path, failure: str | None, entries: dict, step: int) -> str | None:
    """Rank 0 gathers every rank's file entries (or failure) and writes the manifest (with the `step` saved);
    returns the save's failure, the same on every rank."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((failure, entries), gathered, dst=0)
    outcome = [None]
    if rank == 0:
        failures = [found for found, _ in gathered if found is not None]
        if not failures:
            merged = {relative: entry for _, found in gathered for relative, entry in found.items()}
            written = _attempt(lambda: manifest.write(temp, merged, step), temp.parent)
            failures = [written] if written is not None else []
        outcome = ["; ".join(failures) if failures else None]
    dist.broadcast_object_list(outcome, src=0)
    return outcome[0]


def _previous(root: Path) -> str:
    """What a failed save left to resume from: the checkpoint `latest` names, untouched."""
    previous = latest(root)
    if previous is None:
        return "there is no earlier checkpoint"
    if pointer_problem(root) is not None:
        return f"the newest checkpoint {previous.name} is untouched"
    return f"the previous checkpoint {previous.name} is untouched and `latest` still names it"


def _replace_recovery_scripts(root: Path) -> None:
    """DeepSpeed's `zero_to_fp32.py` / `zero_to_torch.py` beside the checkpoints would write the trainer module's
    state dict; ours write an HF folder from the same command lines (`ntl_pretrain/export/zero_to_fp32.py`)."""
    script = Path(__file__).parents[1] / "export" / "zero_to_fp32.py"
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        shutil.copyfile(script, root / name)
        (root / name).chmod(0o755)


def _publish(root: Path, temp_tag: str, tag: str, step: int) -> None:
    """Rename the whole save into `tag` and point `latest` at it. A folder of that name is replaced only when it
    holds this step (re-saving a step after a resume from an earlier one); anything else there (a checkpoint of
    another step renamed to it, a folder that is no checkpoint) is no save of this step, and is kept aside."""
    final = root / tag
    if is_checkpoint(final) and step_held(final) == step:
        shutil.rmtree(final)
    elif final.exists():
        kept = moved_aside(final, "kept")
        logger.warning("checkpoint %s: the folder there held %s, not this save's step: moved it to %s", tag,
                       _held(kept), kept)  # fmt: skip
    os.replace(root / temp_tag, final)
    write_pointer(root, tag)


def _held(folder: Path) -> str:
    return f"the checkpoint of step {step_held(folder)}" if holds_checkpoint(folder) else "no checkpoint"


def moved_aside(folder: Path, suffix: str) -> Path:
    """Rename `folder` to `<name>.<suffix>` (`-2`, `-3`, ... when taken), never over anything; the new path."""
    kept, number = folder.with_name(f"{folder.name}.{suffix}"), 1
    while kept.exists():
        number += 1
        kept = folder.with_name(f"{folder.name}.{suffix}-{number}")
    os.replace(folder, kept)
    return kept


def write_pointer(root: Path, tag: str) -> None:
    """Point `latest` at `tag`: the new name is on disk (fsync) before it replaces the old pointer, and the
    replacement is on disk before this returns, so a crash leaves one pointer or the other, never an empty one."""
    pointer = root / f"{LATEST}.tmp"
    with pointer.open("w") as file:
        file.write(tag)
        file.flush()
        os.fsync(file.fileno())
    os.replace(pointer, root / LATEST)
    folder = os.open(root, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _prune(root: Path, published: Path, keep_last: int) -> None:
    """Delete the checkpoints older than `keep_last - 1` steps before the one just published (which is whole).
    Newer ones (left by a run that resumed from an earlier, intact checkpoint) are kept: the rotation never
    removes one it has not replaced."""
    older = [folder for folder in published_steps(root) if step_of(folder) < step_of(published)]
    for old in older[: max(len(older) - (keep_last - 1), 0)]:
        try:
            shutil.rmtree(old)
        except OSError as error:  # a folder someone else owns or holds open: the run goes on, the folder stays
            logger.warning("checkpoint.keep_last: cannot delete %s (%s); delete it by hand", old, error)


def step_of(folder: Path) -> int:
    """The number in a `step_<N>` folder's name: a label, ordering the folders; `step_held` is the step."""
    return int(STEP_DIR.match(folder.name).group(1))


def step_held(folder: Path) -> int | None:
    """The step a checkpoint continues from: the one its manifest records (`manifest.saved_step`), whatever the
    folder is named; for a checkpoint saved before manifests recorded it (or with a manifest that verification
    calls damaged) the number in its name; None for a folder of another name without one."""
    try:
        recorded = manifest.saved_step(folder)
    except manifest.ManifestError:
        recorded = None
    if recorded is not None:
        return recorded
    return step_of(folder) if STEP_DIR.match(folder.name) else None


def published_steps(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def is_checkpoint(folder: Path) -> bool:
    """A step folder that holds a checkpoint (`holds_checkpoint`): an empty or stray `step_<N>` is not one, and no
    resume starts from it."""
    return bool(STEP_DIR.match(folder.name)) and holds_checkpoint(folder)


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder`, whatever its name, holds a saved checkpoint, whole or damaged: its manifest, DeepSpeed's
    model states (checkpoints saved before manifests), or a file only a save writes (`manifest.SAVED_WITH_A_MANIFEST`:
    one whose manifest was lost)."""
    if not folder.is_dir():
        return False
    return ((folder / manifest.MANIFEST).is_file() or any(folder.glob("*mp_rank_*_model_states.pt"))
            or manifest.sign_of_a_manifest(folder) is not None)  # fmt: skip


def checkpoint_steps(root: Path) -> list[Path]:
    """The published step folders that are checkpoints (`is_checkpoint`), oldest first by the step each holds."""
    return sorted((folder for folder in published_steps(root) if is_checkpoint(folder)), key=step_held)


def pointer_problem(root: Path) -> str | None:
    """What is wrong with `root/latest` (None when it names a checkpoint, or is absent in a folder without any)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return f"{pointer} is missing" if checkpoint_steps(root) else None
    tag = pointer.read_text().strip()
    if not tag:
        return f"{pointer} is empty"
    if not is_checkpoint(root / tag):
        what = "does not exist" if not (root / tag).exists() else "is not a checkpoint"
        return f"{pointer} names {tag}, which {what}"
    return None


def latest(root: Path) -> Path | None:
    """The checkpoint `latest` names; when the pointer is missing, empty, dangling or names something that is not a
    checkpoint, the newest checkpoint folder."""
    if pointer_problem(root) is None and (root / LATEST).is_file():
        return root / (root / LATEST).read_text().strip()
    steps = checkpoint_steps(root)
    return steps[-1] if steps else None


def resolve_resume(resume: str | None, output_dir: str) -> Path | None:
    """`auto`: the latest checkpoint in output_dir (None on a fresh run); else the given step folder."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(checkpoints_root(output_dir))
    folder = Path(resume).expanduser()
    if STEP_DIR.match(folder.name) and not is_checkpoint(folder):
        raise FileNotFoundError(f"train.resume: {folder} is not a checkpoint (no {manifest.MANIFEST}, no model states)")
    if not STEP_DIR.match(folder.name) and holds_checkpoint(folder):
        raise FileNotFoundError(f"train.resume: {folder} holds a checkpoint, but a resume needs it in a folder named "
                                "step_<N> (the step it saved): copy or rename it")  # fmt: skip
    if not STEP_DIR.match(folder.name):
        found = latest(folder) or latest(checkpoints_root(folder))
        if found is None:
            raise FileNotFoundError(f"train.resume: no checkpoint in {folder}")
        folder = found
    return folder


@dataclass(frozen=True)
class ResumePoint:
    folder: Path | None
    """The verified step folder to load; None on a fresh run."""
    skipped: list[dict] = field(default_factory=list)
    """`{"checkpoint", "problems"}` of newer checkpoints `auto` passed over because they failed verification
    (plus `"kept_as"` once `set_aside` has moved them)."""


def resolve_verified_resume(resume: str | None, output_dir: str, mode: manifest.VerifyMode) -> ResumePoint:
    """`resolve_resume`, verified on all ranks before anything loads (`choose_resume`, each candidate judged by
    `agree_on_problems`); rank 0 warns of each damaged checkpoint `auto` passes over."""

    def warn(folder: Path, problems: list[str]) -> None:
        if dist.get_rank() == 0:
            logger.warning("train.resume: auto: skipping %s", damage_report(folder, problems))

    return choose_resume(resume, output_dir, lambda folder: agree_on_problems(folder, mode), warn)


def choose_resume(
    resume: str | None,
    output_dir: str,
    problems_of: Callable[[Path], list[str]],
    on_skip: Callable[[Path, list[str]], None] = lambda folder, problems: None,
) -> ResumePoint:
    """`resolve_resume`, each candidate judged by `problems_of` ([] when it verifies) before anything loads: the
    ranks' judgement (`resolve_verified_resume`), and pre-flight's on one process. `auto` takes the newest checkpoint
    that verifies (the one `latest` names first), telling `on_skip` of each it passes over, and raises
    `manifest.DamagedCheckpointError` when there are checkpoints and none verifies; so does an explicit folder that
    fails."""
    if resume != "auto":
        folder = resolve_resume(resume, output_dir)
        if folder is not None and (problems := problems_of(folder)):
            raise manifest.DamagedCheckpointError(f"train.resume: {damage_report(folder, problems)}")
        return ResumePoint(folder)
    skipped = []
    for folder in newest_first(checkpoints_root(output_dir)):
        problems = problems_of(folder)
        if not problems:
            return ResumePoint(folder, skipped)
        on_skip(folder, problems)
        skipped.append({"checkpoint": str(folder), "problems": problems})
    if skipped:  # starting afresh would overwrite the damaged checkpoints with a run that forgot them
        newest = skipped[0]
        more = f"; {len(skipped) - 1} more damaged" if len(skipped) > 1 else ""
        raise manifest.DamagedCheckpointError(
            f"train.resume: auto: no checkpoint in {checkpoints_root(output_dir)} verifies ({newest['checkpoint']}: "
            f"{newest['problems'][0]}{more}); repair or move them away to start afresh"
        )
    return ResumePoint(None)


def set_aside(skipped: list[dict]) -> None:
    """Move the damaged checkpoints `auto` skipped to `step_<N>.damaged` (`-2`, ... when taken), out of the way of
    the run's own save of that step and of the `keep_last` rotation, never deleted; record each new place as
    `kept_as`. Rank 0 only (it publishes every save), once the run has passed its checks: no rank reads them."""
    for entry in skipped:
        damaged = Path(entry["checkpoint"])
        kept = moved_aside(damaged, "damaged")
        entry["kept_as"] = str(kept)
        logger.warning("train.resume: auto: moved the damaged checkpoint %s to %s (delete it when done)", damaged, kept)


def damage_report(folder: Path, problems: list[str]) -> str:
    return f"checkpoint {folder} is damaged, nothing was loaded from it: {'; '.join(problems)}"


def newest_first(root: Path) -> list[Path]:
    """Published checkpoints, the one `latest` names first, then the others from the highest step down."""
    steps = checkpoint_steps(root)[::-1]
    pointed = latest(root)
    return [pointed, *(folder for folder in steps if folder != pointed)] if pointed is not None else steps


def agree_on_problems(folder: Path, mode: manifest.VerifyMode) -> list[str]:
    """`manifest.verify` on every rank, each its share of the checkpoint's files, and one all-gather gives every rank
    all findings, so all ranks decide alike and none waits for a peer that stopped. The all-gather waits in the
    slow-work group: reading a share of a large checkpoint takes minutes, and some ranks' shares (rank 0's shared
    files, a slower disk) take longer than others'."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = [str(problem) for problem in manifest.verify(folder, mode, rank, world_size) or []]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine, group=slow_work_group())  # hashing a share can take minutes
    return sorted({problem for found in gathered for problem in found})


def verify_before_reading(folder: Path, mode: manifest.VerifyMode = "checksum") -> None:
    """Raise `manifest.DamagedCheckpointError` naming every bad file; for one process (export, eval, the
    universal converter's command)."""
    problems = manifest.verify(folder, mode)
    if problems:
        raise manifest.DamagedCheckpointError(damage_report(folder, [str(problem) for problem in problems]))


def checkpoints_in(path: Path) -> list[Path]:
    """The checkpoint `path` (recognised by its content, whatever its name; or a `step_<N>` folder, to be judged),
    or every published checkpoint of a run directory or its `checkpoints/` folder."""
    if STEP_DIR.match(path.name) or holds_checkpoint(path):
        return [path]
    return published_steps(path) or published_steps(checkpoints_root(path))


def load(engine, folder: Path) -> dict:
    """Load weights, optimizer and scheduler state; returns the client state saved with them."""
    path, client_state = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if path is None:
        raise FileNotFoundError(f"cannot load checkpoint {folder}")
    return client_state[CLIENT_STATE_KEY]


def remove_leftover_saves(output_dir: str | Path) -> list[Path]:
    """Delete `step_<N>.tmp` folders a killed save left behind (never published, so never loaded); rank 0."""
    root = checkpoints_root(output_dir)
    leftovers = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    for folder in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
        logger.warning("removed %s, left by a save that did not finish", folder)
    return leftovers
