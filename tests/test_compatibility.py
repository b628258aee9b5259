"""The versions docs/compatibility.md says were tested are the ones installed, and they satisfy pyproject's floors.

Why CI does not also install the floors (torch 2.5, deepspeed 0.19, transformers 4.56): its machine reaches only
the package registries, whose index here holds the newest torch (2.15.0) and a local CPU build of 2.13.0; any older
`pip install torch==2.5.*` resolves to a multi-GB CUDA build, if at all. So the floors are the versions whose APIs
the code needs (listed in pyproject.toml and docs/compatibility.md), and this test keeps what was actually tested
written down next to them.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CORE = ("torch", "deepspeed", "transformers", "accelerate", "datasets", "tokenizers", "pydantic")


def floors() -> dict[str, Version]:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    found = {}
    for requirement in map(Requirement, dependencies):
        minimum = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        found[requirement.name] = Version(minimum[0]) if minimum else None
    return found


def documented_versions() -> dict[str, str]:
    checked_on = (REPO / "docs" / "compatibility.md").read_text().split("Checked on", 1)[1].split(". ", 1)[0]
    return dict(re.findall(r"([a-z][\w-]*) (\d+\.\d+\.\d+)", checked_on))


def test_the_documented_versions_are_the_installed_ones_and_meet_the_floors():
    documented, minimum = documented_versions(), floors()
    for name in CORE:
        installed = importlib.metadata.version(name)
        assert Version(installed).base_version == documented[name], f"docs/compatibility.md: {name} {installed}"
        assert Version(installed) >= minimum[name], f"{name} {installed} is below pyproject's floor {minimum[name]}"


def test_the_floors_name_what_the_code_needs():
    minimum = floors()
    assert minimum["torch"] >= Version("2.5")  # torch.serialization.safe_globals (checkpoint loading)
    assert minimum["deepspeed"] >= Version("0.19")  # the ZeRO-3 internals vocab_parallel.py and reshard.py handle
    assert minimum["transformers"] >= Version("4.56")  # the dtype= keyword of from_pretrained / from_config


def test_every_model_the_package_loads_leaves_out_hub_kernels():
    """transformers 5.25 kernelizes what `from_pretrained` loads unless told not to (hub downloads; refused on the
    meta device): each model load in the package passes `**WITHOUT_HUB_KERNELS`. Tokenizer and config loads take no
    such keyword and are not counted."""
    import ast

    loads, bare = 0, []
    for path in sorted((REPO / "ntl_pretrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            called = getattr(node, "func", None)
            if not (isinstance(called, ast.Attribute) and called.attr == "from_pretrained"):
                continue
            if not (isinstance(called.value, ast.Name) and called.value.id.endswith(("ForCausalLM", "Model"))):
                continue
            loads += 1
            unpacked = {getattr(keyword.value, "id", None) for keyword in node.keywords if keyword.arg is None}
            if "WITHOUT_HUB_KERNELS" not in unpacked:
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert loads >= 4 and not bare, f"{loads} model loads; without **WITHOUT_HUB_KERNELS: {bare}"
