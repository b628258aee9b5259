"""`launch/wheelhouse.sh` refuses bad arguments before it runs pip (building a wheelhouse downloads ~150 MB, so the
build itself is checked by hand: docs/multinode.md, "Air-gapped clusters")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "wheelhouse.sh"


def run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # A python that fails loudly: none of these calls may get as far as pip.
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(tmp_path / "no-python-here")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "OUT_DIR missing"),
        (("--python-version", "3.12"), "OUT_DIR missing"),
        (("{tmp}/out", "--platform"), "--platform needs a value"),
        (("{tmp}/out", "--platform", "--python-version", "3.12"), "--platform needs a value"),
        (("{tmp}/out", "--pyhton-version", "3.12"), "unknown option --pyhton-version"),
        (("{tmp}/out", "{tmp}/other"), "one OUT_DIR only"),
    ],
)
def test_bad_arguments_exit_2_with_the_usage(tmp_path, args, message):
    result = run(*(arg.replace("{tmp}", str(tmp_path)) for arg in args), tmp_path=tmp_path)
    assert result.returncode == 2, result
    assert f"wheelhouse.sh: {message}" in result.stderr
    assert "usage: launch/wheelhouse.sh OUT_DIR" in result.stderr
    assert not (tmp_path / "out").exists()


def test_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "old.whl").write_text("from another target")
    result = run(str(tmp_path), tmp_path=tmp_path)
    assert result.returncode == 2
    assert f"wheelhouse.sh: {tmp_path} is not empty" in result.stderr
    assert [path.name for path in tmp_path.iterdir()] == ["old.whl"]


def test_refuses_a_file_as_out_dir(tmp_path):
    (tmp_path / "file").write_text("")
    result = run(str(tmp_path / "file"), tmp_path=tmp_path)
    assert result.returncode == 2 and "is a file, not a folder" in result.stderr


def test_only_refuses_a_missing_or_unpinned_list_before_pip(tmp_path):
    result = run(str(tmp_path / "out"), "--only", str(tmp_path / "absent.txt"), tmp_path=tmp_path)
    assert result.returncode == 2 and f"--only: {tmp_path / 'absent.txt'} is not a file" in result.stderr
    pins = tmp_path / "pins.txt"
    pins.write_text("# comment\ndeepspeed==0.19.8  # pinned\neinops\n")
    result = run(str(tmp_path / "out"), "--only", str(pins), tmp_path=tmp_path)
    assert result.returncode == 2 and "'einops' is not name==version" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_gpu_wheel_list_pins_every_line():
    lines = [line.partition("#")[0].strip() for line in (REPO / "launch" / "gpu-wheels.txt").read_text().splitlines()]
    pins = [line for line in lines if line]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][A-Za-z0-9.+!_-]*", pin) for pin in pins), pins
    assert any(pin.startswith("deepspeed==") for pin in pins)
