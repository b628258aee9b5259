"""`launch/slurm/train.sbatch` under a fake Slurm environment: the dry run prints each node's exact launcher command,
and the real path hands srun a command in which every node expands its own rank."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
RECIPE = ["recipes/tiny-cpu.yaml", "train.global_batch_size=96", "train.output_dir=/scratch/my run"]
# Runs the payload of `srun ... bash -c PAYLOAD` once per node, as Slurm would, with that node's SLURM_NODEID.
FAKE_SRUN = '#!/bin/bash\necho "srun $*" >> "$LOG"\nfor id in 0 1 2; do SLURM_NODEID=$id "${@: -3}"; done\n'
# Logs the launcher's arguments instead of launching; anything else goes to the real interpreter.
FAKE_PYTHON = """#!/bin/bash
if [[ "$2" == deepspeed.launcher.runner ]]; then printf "%s|" "$@" >> "$LOG"; echo >> "$LOG"
else exec {python} "$@"; fi
"""

pytestmark = pytest.mark.slow  # each call validates the recipe in a fresh Python (~5 s)


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A job of three nodes with 4 GPUs each, as Slurm would export it; no scontrol on PATH."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    return {
        **env,
        "PATH": f"{fake_bin}:/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "NTL_PYTHON": sys.executable,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-a[07-08],gpu-b3",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_GPUS_PER_NODE": "h100:4",
        "SLURM_SUBMIT_DIR": str(REPO),
        "NTL_SLURM_DIR": str(tmp_path / "job"),
        **extra,
    }


def run_sbatch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *args], cwd=REPO, env=env, capture_output=True, text=True)


def expected_command(rank: int, hostfile: Path, port: int = 24242, python: str = sys.executable) -> list[str]:
    """The supervisor (stop signals reach the ranks) around DeepSpeed's per-node launcher."""
    return [python, "-m", "ntl_pretrain.runtime.supervisor", "--", python, "-m", "deepspeed.launcher.runner",
            "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank), "--master_addr", "gpu-a07",
            "--master_port", str(port), "--module", "ntl_pretrain.train", *RECIPE]  # fmt: skip


def test_dry_run_prints_every_nodes_exact_command(tmp_path):
    done = run_sbatch(slurm_env(tmp_path), "--dry-run", *RECIPE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    hostfile = tmp_path / "job" / "hostfile"
    assert lines[0] == "# nodes=3 processes_per_node=4 world_size=12 master=gpu-a07:24242"  # 20000 + 4242
    assert lines[2:5] == ["#   gpu-a07 slots=4", "#   gpu-a08 slots=4", "#   gpu-b3 slots=4"]
    for rank, (host, line) in enumerate(zip(["gpu-a07", "gpu-a08", "gpu-b3"], lines[5:8], strict=True)):
        prefix = f"[{host}] cd {REPO} && "
        assert line.startswith(prefix)
        assert shlex.split(line[len(prefix) :]) == expected_command(rank, hostfile)
    assert (
        lines[8]
        == "# exit code 75 (stopped by SIGUSR1 before train.max_steps, with a checkpoint): scontrol requeue 4242"
    )
    assert not hostfile.exists(), "a dry run writes nothing"


def test_scontrol_expands_the_node_list_where_installed_and_overrides_apply(tmp_path):
    env = slurm_env(tmp_path, MASTER_PORT="31000", NPROC_PER_NODE="2", SLURM_JOB_NUM_NODES="2",
                    SLURM_JOB_NODELIST="whatever[1-2]")  # fmt: skip
    executable(tmp_path / "bin" / "scontrol", '#!/bin/bash\n[[ "$*" == "show hostnames whatever[1-2]" ]] && '
                                              'printf "gpu-a07\\nnode-x\\n"\n')  # fmt: skip
    done = run_sbatch(env, "--dry-run", "recipes/tiny-cpu.yaml", "train.global_batch_size=32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "# nodes=2 processes_per_node=2 world_size=4 master=gpu-a07:31000"
    assert "[node-x] " in done.stdout and "--node_rank 1 " in done.stdout


def test_srun_gets_one_command_in_which_each_node_expands_its_rank(tmp_path):
    """A fake srun runs the payload once per node with SLURM_NODEID set; a fake python prints the launcher args."""
    printed = tmp_path / "launches.txt"
    executable(tmp_path / "bin" / "srun", FAKE_SRUN)
    fake_python = executable(tmp_path / "python", FAKE_PYTHON.format(python=sys.executable))
    done = run_sbatch(slurm_env(tmp_path, LOG=str(printed), NTL_PYTHON=str(fake_python)), *RECIPE)
    assert done.returncode == 0, done.stderr
    srun, *launches = printed.read_text().splitlines()
    assert srun.startswith("srun --nodes 3 --ntasks-per-node 1 --kill-on-bad-exit=1 bash -c ")
    hostfile = tmp_path / "job" / "hostfile"
    assert hostfile.read_text() == "gpu-a07 slots=4\ngpu-a08 slots=4\ngpu-b3 slots=4\n"
    for rank, launch in enumerate(launches):
        assert launch.split("|")[:-1] == expected_command(rank, hostfile, python=str(fake_python))[5:]


@pytest.mark.parametrize(("code", "requeued"), [(75, True), (0, False), (1, False)])
def test_a_run_stopped_by_its_signal_requeues_the_job(tmp_path, code, requeued):
    """Exit code 75 (the ranks saved and stopped on SIGUSR1 before max_steps) requeues; others pass through."""
    log = tmp_path / "log.txt"
    executable(tmp_path / "bin" / "srun", f'#!/bin/bash\necho srun >> "$LOG"\nexit {code}\n')
    executable(tmp_path / "bin" / "scontrol", '#!/bin/bash\nif [[ $1 == show ]]; then printf "gpu-a07\\ngpu-a08\\n"; '
                                              'else echo "scontrol $*" >> "$LOG"; fi\n')  # fmt: skip
    env = slurm_env(tmp_path, LOG=str(log), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-a[07-08]")
    done = run_sbatch(env, "recipes/tiny-cpu.yaml", "train.global_batch_size=64")
    assert done.returncode == code, done.stderr
    assert log.read_text().splitlines() == ["srun", *(["scontrol requeue 4242"] if requeued else [])]


def test_sigterm_to_the_batch_shell_still_requeues_a_run_that_stopped_with_75(tmp_path):
    """Slurm signals the batch shell with the job's processes: it must live to read srun's 75 and requeue."""
    log = tmp_path / "log.txt"
    executable(tmp_path / "bin" / "srun", '#!/bin/bash\nkill -TERM $PPID\nsleep 0.5\necho srun >> "$LOG"\nexit 75\n')
    executable(tmp_path / "bin" / "scontrol", '#!/bin/bash\nif [[ $1 == show ]]; then printf "gpu-a07\\ngpu-a08\\n"; '
                                              'else echo "scontrol $*" >> "$LOG"; fi\n')  # fmt: skip
    env = slurm_env(tmp_path, LOG=str(log), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-a[07-08]")
    done = run_sbatch(env, "recipes/tiny-cpu.yaml", "train.global_batch_size=64")
    assert done.returncode == 75, done.stderr
    assert log.read_text().splitlines() == ["srun", "scontrol requeue 4242"]


def test_refuses_outside_an_allocation_and_a_global_batch_the_world_cannot_split(tmp_path):
    env = slurm_env(tmp_path)
    del env["SLURM_JOB_NODELIST"]
    done = run_sbatch(env, "--dry-run", *RECIPE)
    assert done.returncode != 0 and "SLURM_JOB_NODELIST" in done.stderr
    done = run_sbatch(slurm_env(tmp_path), "--dry-run", "recipes/tiny-cpu.yaml", "train.global_batch_size=16")
    assert done.returncode != 0 and "not a multiple of train.micro_batch_size (8) x world size (12 ranks" in done.stderr
