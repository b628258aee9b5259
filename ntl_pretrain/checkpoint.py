"""Crash-safe DeepSpeed checkpoints under `<output_dir>/checkpoints/step_<N>/`.

A save writes to `step_<N>.tmp`, then rank 0 renames it to `step_<N>` (atomic on one filesystem) and only then
rewrites the `latest` pointer (temp file + `os.replace`). A kill at any moment therefore leaves `latest`
naming a complete checkpoint. Old checkpoints beyond `keep_last` are deleted after the pointer moves.

Each published folder also holds what export needs without the recipe: `hf_config/` (config.json),
`tokenizer/` and `recipe.yaml`; with a vocabulary-parallel output layer, every rank's slice (`vocab_parallel/`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
HF_CONFIG = "hf_config"
# DeepSpeed drops its own top-level names (`skipped_steps`, `global_steps`, ...) from the client state it hands
# back on load, so ours lives under one key of its own.
CLIENT_STATE_KEY = "ntl_pretrain"
TOKENIZER = "tokenizer"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    `write_rank_files(folder)` state the engine does not hold (every rank), both before the folder is published."""
    tag, temp_tag = f"step_{step}", f"step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(root / temp_tag, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=temp_tag, client_state={CLIENT_STATE_KEY: client_state}, save_latest=False)
    if write_rank_files is not None:
        write_rank_files(root / temp_tag)
    if rank == 0:
        write_extras(root / temp_tag)
    dist.barrier()
    if rank == 0:
        _publish(root, temp_tag, tag)
        _prune(root, keep_last)
    dist.barrier()
    return root / tag


def _publish(root: Path, temp_tag: str, tag: str) -> None:
    final = root / tag
    if final.exists():  # re-saving a step after a resume: the new copy replaces it
        shutil.rmtree(final)
    os.replace(root / temp_tag, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(tag)
    os.replace(pointer, root / LATEST)


def _prune(root: Path, keep_last: int) -> None:
    for old in published_steps(root)[:-keep_last]:
        shutil.rmtree(old)


def published_steps(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    pointer = root / LATEST
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if folder.is_dir():
            return folder
    steps = published_steps(root)
    return steps[-1] if steps else None


def resolve_resume(resume: str | None, output_dir: str) -> Path | None:
    """`auto`: the latest checkpoint in output_dir (None on a fresh run); else the given step folder."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(checkpoints_root(output_dir))
    folder = Path(resume).expanduser()
    if not STEP_DIR.match(folder.name):
        found = latest(folder) or latest(checkpoints_root(folder))
        if found is None:
            raise FileNotFoundError(f"train.resume: no checkpoint in {folder}")
        folder = found
    return folder


def load(engine, folder: Path) -> dict:
    """Load weights, optimizer and scheduler state; returns the client state saved with them."""
    path, client_state = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if path is None:
        raise FileNotFoundError(f"cannot load checkpoint {folder}")
    return client_state[CLIENT_STATE_KEY]
