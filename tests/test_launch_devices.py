"""`ntl-pretrain train` and launch/single_node.sh put the ranks on the GPUs CUDA_VISIBLE_DEVICES names: DeepSpeed's
runner takes `--num_gpus n` as GPUs 0..n-1 of the whole node, so on a shared node they would land on another job's."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from helpers.launches import REPO, TINY

from ntl_pretrain import cli
from ntl_pretrain.runtime import supervisor


def launched(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str], str]:
    """(exit code, the launcher command, stderr) of `ntl-pretrain train ARGV` on a node with 8 GPUs."""
    launches = []
    monkeypatch.setattr(supervisor, "supervise", lambda command, *args, **kwargs: launches.append(command) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible.split(",")) if visible else 8)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    code = cli.main(["train", str(TINY), *argv])
    return code, launches[0] if launches else [], capsys.readouterr().err


@pytest.mark.parametrize(("visible", "nproc", "selection"), [
    ("4,5", [], ["--include", "localhost:4,5"]),
    ("4,5", ["--nproc", "1"], ["--include", "localhost:4"]),
    (None, ["--nproc", "2"], ["--num_gpus", "2"]),
])  # fmt: skip
def test_the_launcher_gets_the_visible_gpus(tmp_path, monkeypatch, capsys, visible, nproc, selection):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    code, command, err = launched([*nproc, f"train.output_dir={tmp_path / 'run'}", "train.device=cuda"], monkeypatch,
                                  capsys)  # fmt: skip
    assert code == 0, err
    runner = command.index("deepspeed.launcher.runner")
    assert command[runner + 1 : runner + 3] == selection
    assert "--num_gpus" not in command or selection[0] == "--num_gpus"


def test_cpu_ranks_are_counted_and_unusable_gpu_lists_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    run = f"train.output_dir={tmp_path / 'run'}"
    code, command, _ = launched(["--nproc", "2", run, "train.device=cpu"], monkeypatch, capsys)
    assert code == 0 and "--num_gpus" in command and "--include" not in command
    code, _, err = launched(
        ["--nproc", "3", run, "train.device=cuda", "train.global_batch_size=null"], monkeypatch, capsys
    )
    assert code == 2 and "--nproc: 3 processes, but CUDA_VISIBLE_DEVICES=4,5 makes 2 GPUs visible" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2e,GPU-91ac")
    code, _, err = launched([run, "train.device=cuda"], monkeypatch, capsys)
    assert code == 2 and "selects GPUs by index" in err


@pytest.mark.parametrize(("ngpus", "expected"), [(None, []), ("1", ["--nproc", "1"])])
def test_single_node_script_leaves_the_count_to_the_visible_gpus(tmp_path, ngpus, expected):
    """The script used to count `nvidia-smi --list-gpus` (every GPU of the node, 8 here) whatever was visible."""
    for name, body in [("ntl-pretrain", 'printf "%s\\n" "$@"'), ("nvidia-smi", "seq 0 7 | sed 's/^/GPU /'")]:
        stub = tmp_path / name
        stub.write_text(f"#!/usr/bin/env bash\n{body}\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "4,5"}
    env.pop("NGPUS", None)
    if ngpus is not None:
        env["NGPUS"] = ngpus
    done = subprocess.run(["bash", str(REPO / "launch" / "single_node.sh"), "r.yaml", "a.b=1"], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    args = done.stdout.split()
    assert args == ["train", "r.yaml", *expected, "--master-port", "29500", "a.b=1"]
