"""One live run per output folder: `<train.output_dir>.lock` beside it, held by rank 0 for the run's life.

`ntl-pretrain train` checks it before any process starts (`check_free`, pre-flight) and rank 0 takes it before the
run writes anything (`acquire`), so a second command on a live run is refused (exit code 2) and writes nothing.
The file says who holds it: host, pid, the process's start time, when the run started and the Slurm job. A lock is
taken over when its holder is gone: a process that no longer runs on this host (pid and start time), or an
earlier attempt of this Slurm job (a requeued job keeps its id, and Slurm runs one attempt at a time). Any other
lock is refused, naming its holder and the way out: delete the file once that run is known to be over.

Shared file systems: the file is created with `O_CREAT | O_EXCL`, atomic on local file systems, NFS v3 and later,
Lustre and GPFS. A holder's liveness can be checked only on its own host, so a lock left by a node that died is
refused on every other node until it is deleted (or the same Slurm job is requeued).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from pathlib import Path

import psutil

from ntl_pretrain.config.recipe import RecipeError

LOCK_SUFFIX = ".lock"
logger = logging.getLogger(__name__)


class RunLocked(RecipeError):
    """The output folder belongs to a run that is still alive (or may be: on another host)."""


def lock_path(output_dir: str | Path) -> Path:
    """`<output_dir>.lock`, beside the folder: taking the lock neither creates nor changes the run's folder, so a
    run that dies before its first step leaves it as it was. Of the resolved folder: two spellings of one folder (a
    symlink, `..`) are one lock."""
    folder = Path(output_dir).expanduser().resolve()
    return folder.with_name(folder.name + LOCK_SUFFIX)


def this_process() -> dict:
    """The lock record of this process."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": psutil.Process().create_time(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }


def check_free(output_dir: str | Path) -> None:
    """Raise `RunLocked` when a live run holds the folder; reads only."""
    path = lock_path(output_dir)
    holder = _read(path)
    if holder is not None and not _gone(holder):
        raise RunLocked(_refusal(path, holder))


def acquire(output_dir: str | Path) -> Path:
    """Take the lock (creating the folder it lies in), taking over one whose holder is gone; raise `RunLocked`
    otherwise."""
    path = lock_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json.dumps(this_process()).encode()
    while True:
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is not None and not _gone(holder):
                raise RunLocked(_refusal(path, holder)) from None
            logger.warning("%s: taking over the lock of a run that is gone (%s)", path, _who(holder))
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(handle, "wb") as file:
            file.write(record)
            os.fsync(file.fileno())
        return path


def release(path: Path | None) -> None:
    """Delete the lock if this process holds it."""
    if path is None:
        return
    holder = _read(path)
    if holder is not None and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def clear_if_gone(output_dir: str | Path) -> None:
    """Delete the lock of a run whose holder is gone: rank 0 killed by the launcher once another rank failed cannot
    release it itself."""
    path = lock_path(output_dir)
    holder = _read(path)
    if holder is not None and "unreadable" not in holder and _gone(holder):
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    """The holder's record; None without a lock. A file that is not a record (torn by a crash while it was being
    written) is refused like a live holder: nothing says whose it is."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # no lock, or no folder (pre-flight names a file in its way)
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = None
    return holder if isinstance(holder, dict) else {"unreadable": text[:80]}


def _gone(holder: dict) -> bool:
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job is not None and holder.get("slurm_job") == slurm_job:
        return True
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        process = psutil.Process(holder["pid"])
        # A zombie has exited: an init that does not reap would otherwise keep the lock forever.
        return process.create_time() != holder.get("process_start") or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _who(holder: dict | None) -> str:
    if holder is None or "unreadable" in holder:
        return "an unreadable lock file"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, running since {holder.get('started')}"


def _refusal(path: Path, holder: dict) -> str:
    return (
        f"train.output_dir: {path.with_suffix('')} is in use by another run ({_who(holder)}); wait for it or stop "
        f"it, or use another train.output_dir; if that run is over (its node died), delete {path}"
    )
