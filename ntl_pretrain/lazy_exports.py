"""A package's public names imported from their modules on first use (PEP 562 module `__getattr__`).

`data/` and `evaluation/` export names whose modules import torch, while the recipe schema imports their `config`
modules: eager re-exports would make every `ntl-pretrain --help` pay for torch."""

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """The `__getattr__` for `package`: `homes` maps each exported name to the module that defines it."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
