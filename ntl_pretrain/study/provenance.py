"""Which code ran a study run, recorded in its `study.json` (`code`) so that a reader of the archived runs need not
trust a commit message: the commit of the git checkout the running package was imported from, and whether that
checkout had uncommitted changes to tracked files; the package version when it is not a checkout (a pip install).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import ntl_pretrain

SOURCE = Path(ntl_pretrain.__file__).resolve().parent.parent


def code_version() -> dict[str, str | bool]:
    """{"commit": <sha>, "dirty": bool} for a checkout, else {"version": <package version>}."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"version": ntl_pretrain.__version__}
    changes = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(changes)}


def _git(*args: str) -> str | None:
    """git's output in the package's source folder; None outside a checkout or without git."""
    try:
        done = subprocess.run(["git", "-C", str(SOURCE), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def unclean_warning(code: dict[str, str | bool]) -> str | None:
    """What to say before runs start that will record `code` (`code_version`) as other than one clean commit, naming
    where the package was imported from; None for a clean commit. Started from another checkout's folder, a
    study imports that checkout: `python -m` puts the working folder before PYTHONPATH."""
    if "commit" in code and not code.get("dirty"):
        return None
    state = "has uncommitted changes" if code.get("dirty") else "is not a git checkout"
    return (
        f"warning: the code these runs import ({SOURCE}) {state}; each run records it (`code` in study.json). A "
        "protocol's runs come from a clean clone of its commit, started in the clone's own folder."
    )


def describe(code: dict | None) -> str:
    """A run's code in a report cell: the short commit (`+changes` when dirty), the version, or `not recorded`."""
    if not code:
        return "not recorded"
    if "commit" in code:
        return code["commit"][:10] + (" +changes" if code.get("dirty") else "")
    return f"version {code['version']}"
