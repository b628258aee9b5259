"""The DeepSpeed JSONs users edit live in the checkout's top-level `configs/`, one copy each (issue 59): the package's
`pkg:ntl_pretrain/config/<name>.json` is that file in a checkout and in an editable install, and a copy of it in a
wheel; recipes that name `<checkout>/configs/zero3.json` load as they did before the files moved into the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.package_files import resolve_path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
TINY = REPO / "recipes" / "tiny-cpu.yaml"
SHIPPED = sorted(path.name for path in CONFIGS.glob("*.json"))


def test_configs_holds_the_one_copy_the_package_finds():
    assert SHIPPED == ["zero3.json", "zero3_offload.json"]
    packaged = sorted((REPO / "ntl_pretrain" / "config").glob("*.json"))
    assert [path.name for path in packaged] == SHIPPED  # no JSON of the package's own that configs/ lacks
    for path in packaged:
        assert path.is_symlink() and path.resolve() == (CONFIGS / path.name).resolve(), f"{path}: a second copy"
        assert resolve_path(f"pkg:ntl_pretrain/config/{path.name}").resolve() == (CONFIGS / path.name).resolve()


@pytest.mark.parametrize("name", SHIPPED)
def test_a_recipe_naming_the_checkout_configs_folder_loads(name, tmp_path, monkeypatch):
    """`deepspeed.config: ../configs/zero3.json` in a recipe of recipes/ (the docs' spelling before issue 50), or the
    folder's path given any other way, is the packaged default's file."""
    old_style = tmp_path / "old.yaml"
    old_style.write_text(f"base: {TINY}\ndeepspeed: {{config: {os.path.relpath(CONFIGS / name, tmp_path)}}}\n")
    monkeypatch.chdir(REPO)
    for recipe, overrides in [(old_style, []), (TINY, [f"deepspeed.config=configs/{name}"])]:
        recipe, config = load_run(recipe, overrides, world_size=2)
        assert Path(recipe.deepspeed.config) == CONFIGS / name
        written = json.loads((CONFIGS / name).read_text())["zero_optimization"]
        sized = {key: value for key, value in written.items() if value != "auto"}  # "auto": the trainer sizes it
        assert config["zero_optimization"].items() >= sized.items()


def copy_for_a_build(into: Path) -> Path:
    """What setuptools reads, links kept as links (as git checks them out)."""
    into.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, into / name)
    for name in ("ntl_pretrain", "configs"):
        shutil.copytree(REPO / name, into / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    return into


def pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "--quiet"],
                          cwd=cwd, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_wheel_ships_the_configs_and_an_editable_install_reads_them(tmp_path):
    pytest.importorskip("setuptools", minversion="68")  # --no-build-isolation: the build backend of this env
    source = copy_for_a_build(tmp_path / "source")
    pip("wheel", ".", "--wheel-dir", str(tmp_path / "dist"), cwd=source)
    (wheel,) = (tmp_path / "dist").glob("ntl_pretrain-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in SHIPPED:
            assert archive.read(f"ntl_pretrain/config/{name}") == (CONFIGS / name).read_bytes(), name
    prefix = tmp_path / "editable"
    # --ignore-installed: pip would otherwise uninstall the environment's own ntl_pretrain (the one under test)
    pip("install", "--prefix", str(prefix), "--ignore-installed", "--editable", ".", cwd=source)
    (site_packages,) = prefix.glob("lib/python*/site-packages")
    # -S: only the editable install's finder, not the package this interpreter's environment already holds.
    script = ("import site, sys; site.addsitedir(sys.argv[1]); from ntl_pretrain.package_files import resolve_path; "
              "print(resolve_path('pkg:ntl_pretrain/config/zero3.json').resolve())")  # fmt: skip
    found = subprocess.run([sys.executable, "-S", "-c", script, str(site_packages)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env={"PATH": os.environ["PATH"]})  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(source / "configs" / "zero3.json")
