"""Runs refuse what they cannot honour (`ntl_pretrain.train.resume_guard`).

A real 2-rank checkpoint of the tiny recipe is resumed with a changed `hidden_size`, `num_hidden_layers`, tokenizer
file and data source file, two of them on 2 ranks (the world size that wrote it) and two on 1: every launch must
exit 2 naming the key, and leave every file of the run as it was. A changed `optimizer.lr` is applied from the
resumed step: the logged rates must be the uninterrupted run's times new/old. Ranks started with different recipes
(two `--no_ssh` "nodes", and 2 gloo ranks) stop naming the key; a rank whose peers never join gives up after
`train.dist_timeout_seconds` naming the master address; leftover `step_N.tmp` folders are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.distributed import free_port, run_distributed
from helpers.launches import (
    GLOBAL_BATCH,
    RUNNER,
    SAVE_AT,
    STEPS,
    TINY,
    environment,
    partition_all_config,
    recipe_overrides,
    single_launcher_run,
    step_records,
    two_node_commands,
)

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.tokenizer import load_tokenizer, resolve_path
from ntl_pretrain.train import resume_guard

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "ntl_pretrain" / "corpus"
REFUSAL_TIMEOUT_S = 240  # below the recipes' 300 s collective timeout: a refusal must not wait for one
_trained: dict[str, Path] = {}


def trained_run(tmp_path_factory) -> Path:
    """A 2-rank tiny run of STEPS steps with checkpoints at SAVE_AT and STEPS (cached for the module)."""
    if "run" not in _trained:
        folder = tmp_path_factory.mktemp("guarded")
        _trained["run"] = single_launcher_run(folder / "run", partition_all_config(folder), ranks=2)
    return _trained["run"]


def launch(output_dir: Path, ranks: int, extra: list[str], log: Path) -> subprocess.CompletedProcess:
    ds_config = output_dir.parent / "zero3_partition_all.json"
    command = [*RUNNER, "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module",
               "ntl_pretrain.train", str(TINY), *recipe_overrides(output_dir, ds_config), *extra]  # fmt: skip
    with log.open("w") as out:
        return subprocess.run(command, cwd=REPO, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                              timeout=REFUSAL_TIMEOUT_S)  # fmt: skip


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run: size and modification time."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")
            if p.is_file()}  # fmt: skip


def changed_tokenizer(folder: Path) -> Path:
    """The tiny tokenizer with the ids of its two last merged tokens swapped: a valid tokenizer with other ids."""
    copy = folder / "tokenizer"
    shutil.copytree(resolve_path("pkg:ntl_pretrain/corpus/tiny-tokenizer"), copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return copy


def changed_sources(folder: Path) -> list[dict]:
    """The tiny recipe's sources, `arithmetic` read from a copy with its last record dropped."""
    arithmetic = folder / "arithmetic.jsonl"
    lines = (CORPUS / "arithmetic" / "train.jsonl").read_text().splitlines(keepends=True)
    arithmetic.write_text("".join(lines[:-1]))
    sources = load_recipe(TINY).data.sources
    return [{"name": s.label, "path": str(arithmetic) if s.label == "arithmetic" else s.path,
             "template": s.template, "weight": s.weight} for s in sources]  # fmt: skip


CHANGES = {
    "hidden_size": (lambda folder: ["model.config.hidden_size=128"], "model.config.hidden_size: 64 → 128"),
    "num_hidden_layers": (lambda folder: ["model.config.num_hidden_layers=3"], "model.config.num_hidden_layers: 2 → 3"),
    "tokenizer": (lambda folder: [f"tokenizer.path={changed_tokenizer(folder)}"], "tokenizer (content of its files)"),
    "data_source": (
        lambda folder: [f"data.sources={json.dumps(changed_sources(folder))}"],
        "data.sources[arithmetic].files",
    ),
}


# Each change on one world size, each world size twice: the guard compares the saved recipe with the new one alike
# at any world size, before anything loads, and every launch costs ~15 s of start-up on 2 cores.
CHANGED_ON = [("hidden_size", 2), ("num_hidden_layers", 1), ("tokenizer", 1), ("data_source", 2)]
assert sorted(change for change, _ in CHANGED_ON) == sorted(CHANGES), "every change is launched once"


@pytest.mark.slow
@pytest.mark.parametrize(("change", "ranks"), CHANGED_ON)
def test_a_changed_model_tokenizer_or_source_is_refused_and_nothing_is_touched(tmp_path_factory, tmp_path, change,
                                                                               ranks):  # fmt: skip
    run_dir = trained_run(tmp_path_factory)
    before = snapshot(run_dir)
    overrides, key = CHANGES[change]
    log = tmp_path / "log.txt"
    started = time.monotonic()
    done = launch(run_dir, ranks, overrides(tmp_path), log)
    text = log.read_text()
    assert done.returncode == 2, text[-4000:]
    refusal = next(line for line in text.splitlines() if "holds a run of another recipe" in line)
    assert key in refusal and refusal.endswith("keep that recipe or use another train.output_dir"), refusal
    assert len(refusal) <= 300 and text.count(refusal) == 1, refusal  # one line, said once
    assert snapshot(run_dir) == before  # no universal/ copy, no recipe.yaml or metrics line written
    print(f"{change} on {ranks} rank(s): refused after {time.monotonic() - started:.1f} s: {refusal}")


@pytest.mark.slow
def test_a_changed_seed_seq_len_or_global_batch_is_refused_before_anything_loads(tmp_path_factory, tmp_path):
    """What the data stream and random states continue from: one refusal names all three, and the run's files
    (recipe.yaml included) are as they were."""
    run_dir = trained_run(tmp_path_factory)
    before = snapshot(run_dir)
    changes = ["seed=1", "data.seq_len=16", f"train.global_batch_size={2 * GLOBAL_BATCH}"]
    done = launch(run_dir, 2, changes, tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert done.returncode == 2, text[-4000:]
    refusal = next(line for line in text.splitlines() if "holds a run of another recipe" in line)
    assert "data.seq_len: 32 → 16" in refusal and "seed" in refusal, refusal  # the rest named as the line allows
    assert "train.global_batch_size (sequences per step)" in refusal and len(refusal) <= 300, refusal
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_a_changed_learning_rate_is_applied_from_the_resumed_step_and_leftovers_are_removed(tmp_path_factory, tmp_path):
    reference_dir = trained_run(tmp_path_factory)
    output_dir = tmp_path / "run"
    saved = f"step_{SAVE_AT}"
    shutil.copytree(reference_dir / "checkpoints" / saved, output_dir / "checkpoints" / saved)
    shutil.copy(reference_dir.parent / "zero3_partition_all.json", tmp_path)
    leftover = output_dir / "checkpoints" / f"step_{SAVE_AT + 1}.tmp"  # what a save killed mid-way leaves
    (leftover / "rank_state").mkdir(parents=True)
    old_lr = load_recipe(TINY).optimizer.lr
    done = launch(output_dir, 2, [f"optimizer.lr={old_lr / 3}"], tmp_path / "log.txt")
    text = (tmp_path / "log.txt").read_text()
    assert done.returncode == 0, text[-4000:]
    assert f"optimizer.lr: {old_lr} → {old_lr / 3}" in text
    assert f"removed {leftover}, left by a save that did not finish" in text and not leftover.exists()
    resumed, reference = step_records(output_dir), step_records(reference_dir)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step in resumed:  # warmup: the multiplier changes every step, the peak is the recipe's
        assert resumed[step]["lr"] == pytest.approx(reference[step]["lr"] / 3, rel=1e-12)
    assert load_recipe(output_dir / "recipe.yaml").optimizer.lr == pytest.approx(old_lr / 3)


@pytest.mark.slow
def test_two_nodes_with_different_max_steps_stop_naming_the_key(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    ds_config, output_dir = partition_all_config(tmp_path), tmp_path / "run"
    logs, nodes = [tmp_path / f"node{rank}.log" for rank in (0, 1)], []
    started = time.monotonic()
    for rank, args in enumerate(two_node_commands(hostfile, free_port())):
        command = [*RUNNER, *args, "--module", "ntl_pretrain.train", str(TINY),
                   *recipe_overrides(output_dir, ds_config), f"train.max_steps={STEPS + rank}"]  # fmt: skip
        nodes.append(subprocess.Popen(command, cwd=REPO, env=environment(), stdout=logs[rank].open("w"),
                                      stderr=subprocess.STDOUT))  # fmt: skip
    codes = [node.wait(timeout=REFUSAL_TIMEOUT_S) for node in nodes]
    elapsed = time.monotonic() - started
    text = logs[0].read_text()
    assert codes == [2, 2], text[-4000:]
    assert f"train.max_steps: {STEPS} on node rank 0 | {STEPS + 1} on node rank 1" in text, text[-4000:]
    assert not output_dir.exists()
    print(f"two nodes with different train.max_steps stopped after {elapsed:.1f} s (both launchers, imports included)")
    # stopped by the recipe check's agreement, not by a collective giving up: the wait above is shorter than the
    # recipe's collective timeout (no wall-clock bound of our own: a loaded machine takes a minute just to import)
    assert REFUSAL_TIMEOUT_S < load_recipe(TINY).train.dist_timeout_seconds
    assert "timed out" not in text.lower() and "timeout" not in text.lower(), text[-4000:]


def _refuse_different_recipes() -> None:
    os.environ["LOCAL_RANK"] = "0"  # one rank per "node"
    rank = dist.get_rank()
    recipe = load_recipe(TINY, [f"train.max_steps={10 + rank}"])
    with pytest.raises(resume_guard.RunRefused, match=r"train\.max_steps: 10 on node rank 0 \| 11 on node rank 1$"):
        resume_guard.check_same_recipe(recipe)
    resume_guard.check_same_recipe(load_recipe(TINY))  # the same recipe passes


def test_ranks_with_different_recipes_refuse_alike():
    run_distributed(_refuse_different_recipes, 2)


def _accept_the_same_content_elsewhere(run_dir: str, tokenizer_copy: str, source_copy: str) -> None:
    folder = Path(run_dir) / "checkpoints" / f"step_{STEPS}"
    sources = [{"name": s.label, "path": source_copy if s.label == "arithmetic" else s.path, "template": s.template,
                "weight": s.weight} for s in load_recipe(folder / "recipe.yaml").data.sources]  # fmt: skip
    moved = [f"tokenizer.path={tokenizer_copy}", f"data.sources={json.dumps(sources)}"]
    recipe = load_recipe(folder / "recipe.yaml", moved)
    resume_guard.check_resume(folder, recipe, load_tokenizer(tokenizer_copy), GLOBAL_BATCH)
    widened = load_recipe(folder / "recipe.yaml", ["loss.vocab_parallel_size=2", "model.config.intermediate_size=128"])
    with pytest.raises(resume_guard.RunRefused) as refused:
        resume_guard.check_resume(folder, widened, load_tokenizer(tokenizer_copy), GLOBAL_BATCH)
    assert "loss.vocab_parallel_size: 1 → 2" in str(refused.value)
    assert "model.config.intermediate_size: 256 → 128" in str(refused.value)


@pytest.mark.slow
def test_identical_tokenizer_and_corpus_at_other_paths_are_accepted(tmp_path_factory, tmp_path):
    run_dir = trained_run(tmp_path_factory)
    tokenizer_copy = tmp_path / "tokenizer"
    shutil.copytree(resolve_path("pkg:ntl_pretrain/corpus/tiny-tokenizer"), tokenizer_copy)
    source_copy = tmp_path / "arithmetic.jsonl"
    shutil.copy(CORPUS / "arithmetic" / "train.jsonl", source_copy)
    run_distributed(_accept_the_same_content_elsewhere, 2, str(run_dir), str(tokenizer_copy), str(source_copy))


@pytest.mark.parametrize(("rank", "says"), [(0, "1/2 clients joined"), (1, "timed out after 3000ms")])
def test_a_group_that_never_forms_is_named_after_the_timeout(rank, says):
    """Rank 0 alone (its peer never joins) and rank 1 alone (its master never answers) of 2."""
    port = free_port()
    env = {**environment(), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    code = "from ntl_pretrain.train.main import init_distributed; init_distributed(3)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-4000:]
    line = next(line for line in done.stderr.splitlines() if line.startswith("ntl-pretrain:"))
    assert f"rank {rank} of 2" in line and f"train.dist_timeout_seconds=3 at master 127.0.0.1:{port}" in line, line
    assert says in line, line


def test_leftover_partial_saves_are_removed_and_published_ones_kept(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_4", "step_6.tmp", "step_8.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / "file").write_text(name)
    assert [p.name for p in checkpoint.remove_leftover_saves(tmp_path)] == ["step_6.tmp", "step_8.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]
    assert checkpoint.remove_leftover_saves(tmp_path / "fresh") == []
