"""DeepSpeed launches of the tiny recipe shared by the multi-node, world-size resume, console and eval tests, and
helpers that every test of a tiny-recipe run uses (the partition-everything ZeRO-3 config, metrics.jsonl records).

The 2-"node" run (two `--no_ssh` launchers on this machine, one rank each) is both what `test_multinode.py` checks
and the uninterrupted 2-rank run that `test_resume_world_size.py` resumes from; it is cached for the session so
that the expensive launch happens once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from helpers.distributed import free_port
from ntl_pretrain.reporting.metrics import written_records

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 6  # micro-batch 1: 6, 3 and 2 micro-batches per step on 1, 2 and 3 ranks
PER_DOCUMENT_STEPS = 4
RUNNER = [sys.executable, "-m", "deepspeed.launcher.runner"]
LAUNCH_TIMEOUT_S = 400
_session_runs: dict[str, Path] = {}


# What a slow command says as it goes (`console.ongoing`): `train`'s and `eval`'s checks off a terminal once they have
# run 3 s, `convert-gguf` and `export` at once; progress lines, not part of a refusal that may follow them last.
PROGRESS = re.compile(r"ntl-pretrain: checking \S+ before launch: [^()]+ \(\d+ s\)"
                      r"|ntl-pretrain eval: \S+: [^()]+ \(\d+ s\)"
                      r"|ntl-pretrain (convert-gguf|export): \S+ -> \S+: [^()]+( \(\d+ s\))?")  # fmt: skip


def said_beyond_progress(stderr: str) -> list[str]:
    """The lines of `stderr` but the progress lines."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS.fullmatch(line)]


def recipe_overrides(output_dir: Path, ds_config: Path) -> list[str]:
    return [
        f"train.output_dir={output_dir}", f"deepspeed.config={ds_config}", f"train.max_steps={STEPS}",
        "data.seq_len=32", "train.micro_batch_size=1", f"train.global_batch_size={GLOBAL_BATCH}",
        f"checkpoint.every_steps={SAVE_AT}", "checkpoint.keep_last=2", "train.eval_every_steps=null",
        "logging.progress_bar=false", "train.resume=auto",
    ]  # fmt: skip


def partition_all_config(folder: Path) -> Path:
    """ZeRO-3 that partitions every parameter of the tiny model (the shipped config keeps small ones whole)."""
    config = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = folder / "zero3_partition_all.json"
    path.write_text(json.dumps(config))
    return path


def records(output_dir: Path, split: str | None = None) -> dict[int, dict]:
    """Last record per step of one kind in a run's metrics.jsonl: training steps (split None), "validation" or
    generation "eval" (a resumed run appends repeated steps)."""
    found = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == split:
            found[record["step"]] = record
    return found


def assert_model_reproduces_logged_validation(
    model, tokenizer, run_dir: Path, step: int, micro_batch_size: int, ranks: int = 2
) -> None:
    """Plain transformers, run on exactly the validation batches each of the run's `ranks` ranks evaluated, gives
    the CE and NTL the run logged at `step`."""
    import pytest
    import torch

    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.data import build_dataloader
    from ntl_pretrain.evaluation.validation import packed_forward
    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.numbers import NumberVocab

    recipe = load_recipe(run_dir / "recipe.yaml")
    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    sums = torch.zeros(4, dtype=torch.float64)
    for rank in range(ranks):
        loader = build_dataloader(recipe.data, tokenizer, micro_batch_size=micro_batch_size, dp_rank=rank,
                                  dp_world_size=ranks, seed=recipe.seed, split="validation")  # fmt: skip
        for _, batch in zip(range(recipe.train.eval_max_batches), loader, strict=False):
            with torch.no_grad():
                logits = packed_forward(model, batch["input_ids"], batch["position_ids"])
            out = ce_ntl_loss(logits, batch["labels"], nv, kind="was", reduction="sum")
            sums += torch.tensor([out.ce, out.ntl, out.num_tokens, out.num_number_tokens], dtype=torch.float64)
    logged = records(run_dir, "validation")[step]
    assert [logged["val_tokens"], logged["val_number_tokens"]] == [int(sums[2]), int(sums[3])]
    assert sums[0] / sums[2] == pytest.approx(logged["val_ce"], rel=1e-5)
    assert sums[1] / sums[3] == pytest.approx(logged["val_ntl"], rel=1e-5)


def environment() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def as_a_user_runs_it() -> dict[str, str]:
    """A single-process command's environment without DS_ACCELERATOR, so that DeepSpeed prints what it prints to a
    user on a machine without a GPU."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("DS_ACCELERATOR", None)
    return env


def start(launcher_args: list[str], output_dir: Path, ds_config: Path, log: Path) -> subprocess.Popen:
    command = [*RUNNER, *launcher_args, "--module", "ntl_pretrain.train", str(TINY),
               *recipe_overrides(output_dir, ds_config)]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_all(processes: list[subprocess.Popen], logs: list[Path]) -> None:
    for process, log in zip(processes, logs, strict=True):
        assert process.wait(timeout=LAUNCH_TIMEOUT_S) == 0, log.read_text()[-4000:]


def single_launcher_run(output_dir: Path, ds_config: Path, ranks: int) -> Path:
    """One `deepspeed --num_gpus ranks` launcher (on CPU, the count is processes)."""
    log = output_dir.parent / f"{output_dir.name}.log"
    wait_all([start(["--num_gpus", str(ranks), "--master_port", str(free_port())], output_dir, ds_config, log)], [log])
    return output_dir


def per_document_run(tmp_path_factory, attention: str) -> Path:
    """Session-cached 2-rank run of the tiny recipe with `data.per_document_attention` and the given attention
    backend, which validates over the whole split after its last step. The split is the first records of the
    recipe's two validation sources, so that validating it (in the run and again in the tests) stays quick."""
    key = f"per_document_{attention}"
    if key not in _session_runs:
        folder = tmp_path_factory.mktemp(key)
        output_dir, log = folder / "run", folder / "log.txt"
        overrides = [
            f"train.output_dir={output_dir}", f"train.max_steps={PER_DOCUMENT_STEPS}", "data.seq_len=64",
            "train.micro_batch_size=4", "train.global_batch_size=8", f"checkpoint.every_steps={PER_DOCUMENT_STEPS}",
            f"train.eval_every_steps={PER_DOCUMENT_STEPS}", "train.eval_max_batches=null", "logging.progress_bar=false",
            "data.per_document_attention=true", f"model.attention={attention}", "train.resume=null",
            f"data.validation={json.dumps(short_validation_sources(folder))}",
        ]  # fmt: skip
        command = [*RUNNER, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "ntl_pretrain.train",
                   str(TINY), *overrides]  # fmt: skip
        process = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_all([process], [log])
        _session_runs[key] = output_dir
    return _session_runs[key]


def short_validation_sources(folder: Path) -> list[dict]:
    """The first 61 arithmetic and 23 word-problem validation records (odd block counts: ranks get unequal shares,
    and each source ends in a partial block)."""
    corpus = REPO / "ntl_pretrain" / "corpus"
    sources = []
    for name, count in (("arithmetic", 61), ("word_problems", 23)):
        path = folder / f"{name}.jsonl"
        lines = (corpus / name / "validation.jsonl").read_text().splitlines(keepends=True)[:count]
        path.write_text("".join(lines))
        sources.append({"name": name, "path": str(path), "template": "{question} {answer}"})
    return sources


def unattended_run(tmp_path_factory) -> tuple[Path, str]:
    """Session-cached 4-step run on one CPU rank through `ntl-pretrain train`, its stderr a pipe (not a terminal, as in
    a Slurm log): gradient accumulation 2, validation every 2 steps, a console line every 3 (and none by time), steps
    2-3 profiled.
    Returns the run directory and its console (stdout and stderr together, as a log file holds them)."""
    if "unattended" not in _session_runs:
        output_dir = tmp_path_factory.mktemp("unattended") / "run"
        # lines by steps alone (no time-based ones), so that which steps are printed does not depend on the load
        console = train_one_rank(output_dir, "train.global_batch_size=4", "train.eval_every_steps=2",
                                 "train.eval_max_batches=2", "logging.console_every_steps=3",
                                 "logging.console_every_seconds=0", "logging.profile_steps=[2,2]", steps=4)  # fmt: skip
        _session_runs["unattended"] = (output_dir, console)
    return _session_runs["unattended"]


def train_one_rank(output_dir: Path, *extra: str, steps: int = 2) -> str:
    """A few tiny steps on one CPU rank through `ntl-pretrain train`; its console (stdout and stderr together)."""
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "1",
               f"train.output_dir={output_dir}", f"train.max_steps={steps}", "data.seq_len=32",
               "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_every_steps=null",
               *extra]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    assert sorted(records(output_dir)) == list(range(1, steps + 1))
    return done.stdout


def two_node_commands(hostfile: Path, port: int) -> list[list[str]]:
    """The launcher arguments of node 0 and node 1: both on this machine, told apart by the hostfile's two names."""
    return [
        [
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
        ]  # fmt: skip
        for rank in (0, 1)
    ]


def two_node_run(tmp_path_factory) -> Path:
    """Session-cached run of two `--no_ssh` launchers with one rank each (world size 2)."""
    if "two_node" not in _session_runs:
        folder = tmp_path_factory.mktemp("two_node")
        hostfile = folder / "hostfile"
        hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
        ds_config, output_dir = partition_all_config(folder), folder / "run"
        logs = [folder / f"node{rank}.log" for rank in (0, 1)]
        nodes = [
            start(args, output_dir, ds_config, log)
            for args, log in zip(two_node_commands(hostfile, free_port()), logs, strict=True)
        ]
        wait_all(nodes, logs)
        _session_runs["two_node"] = output_dir
    return _session_runs["two_node"]


def step_records(output_dir: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run appends the steps it repeats)."""
    records = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") is None:
            records[record["step"]] = record
    return records


def logged_steps(output_dir: Path) -> list[int]:
    """The training steps a live run has logged so far (its metrics.jsonl's whole lines: one may be half written)."""
    return [record["step"] for record in written_records(output_dir / "metrics.jsonl") if "split" not in record]


def wait_for(condition, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Poll `condition` until it holds; fail with the log's tail if the process ends or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, "timed out: " + log.read_text()[-2000:]
        time.sleep(0.05)
