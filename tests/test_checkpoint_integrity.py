"""Checkpoints that prove they are whole (issue #15): manifests, verification before loading, fallback to the
newest intact checkpoint, and saves that fail together when a disk fills up.

Verification is a pure function of the folder, so most damage cases run over one real checkpoint of the 2-rank
tiny run (`launches.two_node_run`, shared with the multi-node and resume tests): every kind of file truncated,
deleted or with one bit flipped. Two gloo ranks check that the ranks agree (each verifies its share) and that a
full disk fails a real ZeRO-3 save on every rank. Two real launches close the loop: `resume: auto` past a
damaged newest checkpoint logs the uninterrupted run's losses, an explicit resume of it stops naming the file.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.distributed import run_distributed, tiny_zero3_engine
from helpers.launches import (
    LAUNCH_TIMEOUT_S,
    REPO,
    RUNNER,
    SAVE_AT,
    STEPS,
    TINY,
    environment,
    partition_all_config,
    recipe_overrides,
    records,
    single_launcher_run,
    step_records,
    two_node_run,
)

from ntl_pretrain import cli
from ntl_pretrain.checkpoint import manifest, reshard
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.checkpoint.manifest import DamagedCheckpointError
from ntl_pretrain.plot import current_records

# One file of each kind in a 2-rank checkpoint; the model states also hold the client state (step, tokens seen,
# learning-rate schedule) that DeepSpeed saves with them.
KINDS = {
    "model states": "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "optimizer states": "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "data-loader state": "rank_state/rank_00001.pt",
    "tokenizer": "tokenizer/tokenizer.json",
    "model config": "hf_config/config.json",
    "recipe": "recipe.yaml",
}
EXPECTED = {"truncate": "size", "delete": "missing", "flip": "checksum"}


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        path.unlink()
    else:
        flipped = bytearray(data)
        flipped[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(flipped))


def copy_run(run: Path, into: Path) -> Path:
    """The run's checkpoints (steps 3 and 6) in a folder of their own, to damage."""
    shutil.copytree(run / "checkpoints", into / "checkpoints", ignore=shutil.ignore_patterns("universal*"))
    return into


# ---- manifests, without a launch ---------------------------------------------------------------------------


def test_every_file_is_verified_by_exactly_one_rank_whatever_the_world_size():
    saved = ["hf_config/config.json", "recipe.yaml", "tokenizer/tokenizer.json", "vocab_parallel/layout.json"]
    for rank in range(3):
        saved += [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                  f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                  f"rank_state/rank_{rank:05d}.pt", f"vocab_parallel/rank_{rank:05d}.pt"]  # fmt: skip
    entries = {relative: {"size": 1, "xxh3_64": "0"} for relative in saved}
    assert manifest.writer("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt") == 2
    assert manifest.writer("rank_state/rank_00001.pt") == 1
    assert manifest.writer("tokenizer/tokenizer.json") is None
    for world_size in (1, 2, 3, 4):
        shares = [set(manifest.share(entries, rank, world_size)) for rank in range(world_size)]
        assert sorted(relative for share in shares for relative in share) == sorted(saved), world_size
    assert set(manifest.share(entries, 1, 3)) == {relative for relative in saved if "rank_1_" in relative or
                                                  "rank_00001" in relative}  # fmt: skip


def test_prune_keeps_the_new_checkpoint_and_newer_ones_a_fallback_left(tmp_path):
    """After `auto` fell back from a damaged step 30 to step 10, saving step 20 with keep_last=1 removes step 10
    only: step 30 is newer than anything this run replaced."""
    root = checkpoint.checkpoints_root(tmp_path)
    for name in ("step_10", "step_30", "step_20.tmp"):  # model states: a step folder without them is not a checkpoint
        (root / name).mkdir(parents=True)
        (root / name / "mp_rank_00_model_states.pt").touch()
    checkpoint._publish(root, "step_20.tmp", "step_20", 20)
    checkpoint._prune(root, root / "step_20", keep_last=1)
    assert [folder.name for folder in checkpoint.published_steps(root)] == ["step_20", "step_30"]
    assert checkpoint.newest_first(root) == [root / "step_20", root / "step_30"]  # `latest` first


def test_a_save_never_replaces_a_folder_that_holds_another_step(tmp_path):
    """`step_5` renamed `step_9`: the ranks resumed it at step 5, and their own step-9 save deleted it (issue 72).
    A save replaces only an earlier copy of its own step (a re-save after a resume from an earlier checkpoint);
    a folder holding another step is kept aside, whole; with `latest` gone, the newest is the highest step held."""
    root = checkpoint.checkpoints_root(tmp_path)

    def saved(name: str, step: int, text: str) -> Path:
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "recipe.yaml").write_text(text)
        manifest.write(folder, manifest.describe(folder, ["recipe.yaml"]), step)
        return folder

    saved("step_9", 5, "five")
    saved("step_9.tmp", 9, "nine")
    checkpoint._publish(root, "step_9.tmp", "step_9", 9)
    kept = root / "step_9.kept"
    assert [(root / "step_9" / "recipe.yaml").read_text(), checkpoint.step_held(root / "step_9")] == ["nine", 9]
    assert [(kept / "recipe.yaml").read_text(), checkpoint.step_held(kept), manifest.verify(kept)] == ["five", 5, []]
    saved("step_9.tmp", 9, "nine again")
    checkpoint._publish(root, "step_9.tmp", "step_9", 9)
    assert (root / "step_9" / "recipe.yaml").read_text() == "nine again"
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_9", "step_9.kept"]

    saved("step_12", 7, "seven")  # a label above the newest step
    (root / "latest").unlink()
    assert checkpoint.newest_first(root) == [root / "step_9", root / "step_12"]


def test_readers_drop_the_records_a_resume_superseded():
    """A run logged steps 1-5, fell back to the checkpoint of step 2 and stopped after step 3: steps 4 and 5 of the
    first attempt are gone, step 3 is the resumed run's."""
    first = [{"step": step, "loss": float(step)} for step in range(1, 6)] + [{"step": 4, "split": "validation"}]
    resumed = [{"step": 2, "split": "resume", "resumed_from": "step_2"}, {"step": 3, "loss": 30.0}]
    kept = current_records(first + resumed)
    training = [(record["step"], record["loss"]) for record in kept if "split" not in record]
    assert training == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert not [record for record in kept if record.get("split") == "validation"]


# ---- every kind of damage in a real checkpoint -------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    return two_node_run(tmp_path_factory)


@pytest.mark.slow
def test_a_fresh_checkpoint_lists_every_file_and_verifies(saved_run):
    folder = saved_run / "checkpoints" / f"step_{STEPS}"
    files = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()}
    files -= {manifest.MANIFEST}
    assert set(manifest.read(folder)) == {f for f in files if not f.startswith(reshard.UNIVERSAL)}
    assert set(KINDS.values()) <= files
    assert manifest.verify(folder) == []


@pytest.mark.slow
def test_each_kind_of_damage_is_named_with_what_is_wrong(saved_run, tmp_path, capsys):
    run = copy_run(saved_run, tmp_path)
    folder = run / "checkpoints" / f"step_{STEPS}"
    for kind, relative in KINDS.items():
        path, original = folder / relative, (folder / relative).read_bytes()
        for how, what in EXPECTED.items():
            damage(path, how)
            problems = manifest.verify(folder)
            assert [(problem.path, problem.what.split()[0]) for problem in problems] == [(path, what)], (kind, how)
            by_size = manifest.verify(folder, "size")
            assert by_size == ([] if how == "flip" else problems), (kind, how)  # `size` reads no file
            with pytest.raises(DamagedCheckpointError, match=f"{relative}: {what}"):
                checkpoint.verify_before_reading(folder)
            path.write_bytes(original)
    assert manifest.verify(folder) == []
    capsys.readouterr()

    loader_state = (folder / KINDS["data-loader state"]).read_bytes()
    damage(folder / KINDS["data-loader state"], "truncate")
    assert cli.main(["verify", str(run)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{run}/checkpoints/step_{SAVE_AT}: intact", f"{folder}: damaged: {problems_of(folder)}"]
    for command in (["export", str(folder), str(tmp_path / "hf")], ["eval", str(folder)]):
        assert cli.main(command) == 1, command  # stops before any weight is read
        assert f"{folder / KINDS['data-loader state']}: size" in capsys.readouterr().err
        assert not (tmp_path / "hf").exists()
    with pytest.raises(DamagedCheckpointError, match="rank_00001.pt: size"):
        reshard.main([str(folder)])
    assert not (folder / reshard.UNIVERSAL).exists()

    (folder / KINDS["data-loader state"]).write_bytes(loader_state)
    (folder / manifest.MANIFEST).write_text('{"version": 1, "fi')
    assert [problem.path.name for problem in manifest.verify(folder)] == [manifest.MANIFEST]
    (folder / manifest.MANIFEST).unlink()  # lost after the save: its rank_state/ shows it was saved with one
    assert [problem.what.split(",")[0] for problem in manifest.verify(folder)] == ["missing"]
    shutil.rmtree(folder / "rank_state")  # as saved before manifests (and per-rank state files) existed
    (folder / "data_sources.json").unlink()
    optimizer_states = (folder / KINDS["optimizer states"]).read_bytes()
    damage(folder / KINDS["optimizer states"], "truncate")  # a torn torch file is still found
    (problem,) = manifest.verify(folder)
    assert problem.path == folder / KINDS["optimizer states"] and problem.what.startswith("not a whole torch file")
    (folder / KINDS["optimizer states"]).write_bytes(optimizer_states)
    assert manifest.verify(folder) is None  # whole files: loads, unverified
    assert cli.main(["verify", str(folder)]) == 0
    assert "unverifiable" in capsys.readouterr().out


def problems_of(folder: Path) -> str:
    return "; ".join(str(problem) for problem in manifest.verify(folder))


# ---- two gloo ranks: agreement, fallback, a full disk ------------------------------------------------------


def check_ranks_agree_and_saves_fail_together(run: str, scratch: str) -> None:
    import torch.distributed as dist

    root = checkpoint.checkpoints_root(run)
    # Rank 1 verifies the damaged data-loader state file; rank 0 learns of it through the all-gather.
    point = checkpoint.resolve_verified_resume("auto", run, "checksum")
    assert point.folder == root / f"step_{SAVE_AT}"
    assert [skipped["checkpoint"] for skipped in point.skipped] == [str(root / f"step_{STEPS}")]
    assert "rank_state/rank_00001.pt: checksum" in point.skipped[0]["problems"][0]
    with pytest.raises(DamagedCheckpointError, match="rank_state/rank_00001.pt: checksum"):
        checkpoint.resolve_verified_resume(str(root / f"step_{STEPS}"), run, "checksum")
    size_only = checkpoint.resolve_verified_resume("auto", run, "size")  # a flipped bit keeps the size
    assert size_only.folder == root / f"step_{STEPS}" and not size_only.skipped
    if dist.get_rank() == 0:
        damage(root / f"step_{SAVE_AT}" / KINDS["tokenizer"], "delete")
    dist.barrier()
    with pytest.raises(DamagedCheckpointError, match="auto: no checkpoint in .* verifies"):
        checkpoint.resolve_verified_resume("auto", run, "checksum")  # never a fresh start over damaged ones
    check_full_disk_fails_the_save_on_every_rank(Path(scratch) / "zero3_saves")


def check_full_disk_fails_the_save_on_every_rank(run: Path) -> None:
    import torch
    import torch.distributed as dist

    engine = tiny_zero3_engine()
    root = checkpoint.checkpoints_root(run)

    def save(step: int, write_rank_files=None) -> Path:
        return checkpoint.save(engine, root, step, {"step": step}, 2, lambda folder: None, write_rank_files)

    save(1)
    assert manifest.verify(root / "step_1") == []
    real_save = torch.save

    def disk_full_on_rank_1(obj, path, *args, **kwargs):  # `path` may be a file object (manifest.HashingWriter)
        if dist.get_rank() == 1 and "optim_states" in str(getattr(path, "name", path)):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    def disk_full_on_rank_0(folder: Path) -> None:
        if dist.get_rank() == 0:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "rank_state"))

    torch.save = disk_full_on_rank_1  # DeepSpeed's checkpoint engine writes every shard through torch.save
    try:
        with pytest.raises(checkpoint.CheckpointWriteError, match="step_2 was not saved: rank 1: the disk is full"):
            save(2)
    finally:
        torch.save = real_save
    with pytest.raises(checkpoint.CheckpointWriteError, match="rank 0: the disk is full.*step_1 is untouched"):
        save(3, disk_full_on_rank_0)
    dist.barrier()
    assert (root / checkpoint.LATEST).read_text() == "step_1"
    assert [folder.name for folder in root.iterdir() if folder.is_dir()] == ["step_1"]
    assert manifest.verify(root / "step_1") == []
    save(4)  # the next save works again
    assert (root / checkpoint.LATEST).read_text() == "step_4"


@pytest.mark.slow
def test_ranks_agree_on_damage_and_a_full_disk_fails_every_rank(saved_run, tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run = copy_run(saved_run, tmp_path / "run")
    damage(run / "checkpoints" / f"step_{STEPS}" / KINDS["data-loader state"], "flip")
    run_distributed(check_ranks_agree_and_saves_fail_together, 2, str(run), str(tmp_path))


# ---- real launches -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_auto_resume_falls_back_past_a_damaged_checkpoint_and_logs_the_same_losses(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path / "run")
    damaged = run / "checkpoints" / f"step_{STEPS}"
    damage(damaged / KINDS["optimizer states"], "flip")
    single_launcher_run(run, partition_all_config(tmp_path), 2)
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert resumed[0]["split"] == "resume"
    assert resumed[0]["resumed_from"] == str(run / "checkpoints" / f"step_{SAVE_AT}")
    assert resumed[0]["skipped_checkpoints"][0]["checkpoint"] == str(damaged)
    kept = damaged.with_name(f"step_{STEPS}.damaged")
    assert resumed[0]["skipped_checkpoints"][0]["kept_as"] == str(kept)
    assert f"{KINDS['optimizer states']}: checksum" in resumed[0]["skipped_checkpoints"][0]["problems"][0]
    continued, reference = step_records(run), step_records(saved_run)
    assert sorted(continued) == list(range(SAVE_AT + 1, STEPS + 1))
    assert [continued[step]["loss"] for step in continued] == [reference[step]["loss"] for step in continued]
    assert not records(run, "validation")
    assert manifest.verify(damaged) == []  # re-saved at the same step, beside the damaged copy, which is kept
    (problem,) = manifest.verify(kept)
    assert str(problem).startswith(f"{kept / KINDS['optimizer states']}: checksum")


@pytest.mark.slow
def test_a_renamed_checkpoint_resumes_its_step_beside_a_fresh_run_and_its_own_save_keeps_it(saved_run, tmp_path):
    """Step 3 renamed `step_6` (the run's last step): `ntl-pretrain train` said "already at step 6; nothing to
    train" (issue 72). Through the whole command (checks, supervisor, ranks), the run resumes step 3, logs steps 4-6
    as the uninterrupted run did, and its own step-6 save keeps the renamed folder aside, whole; the supervisor's own
    lines are in the run's logs/supervisor.log too. Beside it, at the same time, a fresh run of the same recipe
    writes its checkpoints into a folder of its own and logs the uninterrupted run's losses: two runs side by side
    share nothing (ports, outcome files, locks)."""
    run, fresh = copy_run(saved_run, tmp_path / "run"), tmp_path / "fresh"
    root = checkpoint.checkpoints_root(run)
    shutil.rmtree(root / f"step_{STEPS}")
    (root / f"step_{SAVE_AT}").rename(root / f"step_{STEPS}")
    ds_config = partition_all_config(tmp_path)
    launches = [subprocess.Popen([sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2",
                                  *recipe_overrides(output_dir, ds_config)], cwd=REPO, env=environment(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for output_dir in (run, fresh)]  # fmt: skip
    consoles = [launch.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], consoles[0][-3000:] + consoles[1][-3000:]
    reference = step_records(saved_run)
    for output_dir, steps in ((run, range(SAVE_AT + 1, STEPS + 1)), (fresh, range(1, STEPS + 1))):
        logged = step_records(output_dir)
        assert sorted(logged) == list(steps)
        assert [logged[step]["loss"] for step in steps] == [reference[step]["loss"] for step in steps]
    assert cli.main(["verify", str(fresh)]) == 0
    kept, saved = root / f"step_{STEPS}.kept", root / f"step_{STEPS}"
    assert [checkpoint.step_held(kept), manifest.verify(kept)] == [SAVE_AT, []]
    assert [checkpoint.step_held(saved), manifest.verify(saved)] == [STEPS, []]
    assert (root / "latest").read_text() == saved.name
    logged = [line.split(" ", 1)[1] for line in (run / "logs" / "supervisor.log").read_text().splitlines()]
    assert logged and all(line in consoles[0].splitlines() for line in logged), logged


@pytest.mark.slow
def test_explicit_resume_of_a_damaged_checkpoint_stops_every_rank_naming_the_file(saved_run, tmp_path):
    run = copy_run(saved_run, tmp_path / "damaged")
    damaged = run / "checkpoints" / f"step_{STEPS}"
    damage(damaged / KINDS["model states"], "truncate")
    output_dir, log = tmp_path / "run", tmp_path / "run.log"
    overrides = [*recipe_overrides(output_dir, partition_all_config(tmp_path)), f"train.resume={damaged}"]
    command = [*RUNNER, "--num_gpus", "2", "--module", "ntl_pretrain.train", str(TINY), *overrides]
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(command, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                              timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    print(f"explicit resume of a damaged checkpoint stopped after {time.monotonic() - started:.1f} s")
    text = log.read_text()
    assert done.returncode != 0
    named = f"DamagedCheckpointError: train.resume: checkpoint {damaged} is damaged"
    assert text.count(named) == 2, text[-4000:]  # both ranks, the same verdict
    assert f"{damaged / KINDS['model states']}: size" in text
    assert not (output_dir / "metrics.jsonl").exists()


# ---- the `latest` pointer ----------------------------------------------------------------------------------


def small_checkpoints(root: Path, steps: list[int]) -> None:
    """Step folders with one file and a manifest each: checkpoints as far as resume and verify can tell."""
    for step in steps:
        folder = root / f"step_{step}"
        folder.mkdir(parents=True)
        (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(bytes([step]) * 64)
        manifest.write(folder, manifest.describe(folder, ["zero_pp_rank_0_mp_rank_00_model_states.pt"]))


BAD_POINTERS = {  # what `latest` holds -> what verify says of it
    "": "is empty",
    "step_30": "names step_30, which does not exist",
    "step_999": "names step_999, which is not a checkpoint",
}


def check_ranks_resume_the_newest_checkpoint_past_a_bad_pointer(run: str) -> None:
    """Also, in the same ranks (a spawn costs seconds): a file the manifest does not list is damage to a resume as
    it is to `verify`, `export` and `eval`; `auto` passes over it, an explicit resume of it stops."""
    import torch.distributed as dist

    root = checkpoint.checkpoints_root(run)
    for pointer in BAD_POINTERS:
        if dist.get_rank() == 0:
            checkpoint.write_pointer(root, pointer)
        dist.barrier()
        assert checkpoint.resolve_verified_resume("auto", run, "checksum").folder == root / "step_20", pointer
        dist.barrier()
    stray = root / "step_20" / "notes.txt"
    if dist.get_rank() == 0:
        stray.write_text("added after the save")
    dist.barrier()
    point = checkpoint.resolve_verified_resume("auto", run, "checksum")
    assert point.folder == root / "step_10" and point.skipped[0]["problems"] == [f"{stray}: not in the manifest"]
    with pytest.raises(DamagedCheckpointError, match="notes.txt: not in the manifest"):
        checkpoint.resolve_verified_resume(str(root / "step_20"), run, "checksum")
    dist.barrier()
    if dist.get_rank() == 0:
        stray.unlink()


def test_a_bad_latest_pointer_is_reported_and_resume_takes_the_newest_checkpoint(tmp_path, capsys):
    """An empty `latest`, one naming a missing step, and one naming an empty `step_999` folder: resume (on 2 gloo
    ranks) and the pre-flight take step_20, and `verify` names the pointer and the stray folder (exit code 1)."""
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.preflight import world as preflight

    root = checkpoint.checkpoints_root(tmp_path / "run")
    small_checkpoints(root, [10, 20])
    (root / "step_999").mkdir()
    run_distributed(check_ranks_resume_the_newest_checkpoint_past_a_bad_pointer, 2, str(tmp_path / "run"))
    recipe = load_recipe(TINY, [f"train.output_dir={tmp_path / 'run'}", "train.max_steps=100"])
    for pointer, said in BAD_POINTERS.items():
        checkpoint.write_pointer(root, pointer)
        assert checkpoint.latest(root) == root / "step_20"
        assert preflight.existing_checkpoint(recipe) == root / "step_20"  # not "already at step 999"
        assert cli.main(["verify", str(tmp_path / "run")]) == 1
        assert capsys.readouterr().out.splitlines() == [
            f"{root / 'step_10'}: intact",
            f"{root / 'step_20'}: intact",
            f"{root / 'step_999'}: not a checkpoint (no manifest.json, no DeepSpeed model states); a resume ignores it",
            f"{root / 'latest'} {said}: a resume takes {root / 'step_20'} instead",
        ]
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_10", "step_20", "step_999"]  # no temp
    with pytest.raises(FileNotFoundError, match="step_999 is not a checkpoint"):
        checkpoint.resolve_resume(str(root / "step_999"), "unused")

    assert cli.main(["verify", str(tmp_path / "nowhere" / "step_5")]) == 2  # an error, not "unverifiable"
    assert f"{tmp_path / 'nowhere' / 'step_5'}: does not exist" in capsys.readouterr().err


def test_a_manifest_that_lists_no_file_or_misses_one_vouches_for_nothing(tmp_path, capsys):
    """`verify` called a step folder whose manifest listed no files intact, and did not see a file it left out."""
    root = checkpoint.checkpoints_root(tmp_path / "run")
    small_checkpoints(root, [10, 20])
    checkpoint.write_pointer(root, "step_20")
    (root / "step_20" / "notes.txt").write_text("added after the save")
    manifest.write(root / "step_10", {})
    assert cli.main(["verify", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{root / 'step_10'}: damaged: {root / 'step_10' / manifest.MANIFEST}: lists no file; a checkpoint's manifest "
        "lists every file it saved",
        f"{root / 'step_20'}: damaged: {root / 'step_20' / 'notes.txt'}: not in the manifest",
    ]
    with pytest.raises(DamagedCheckpointError, match="notes.txt: not in the manifest"):
        checkpoint.verify_before_reading(root / "step_20")  # what export and eval ask before they read a weight
    (root / "step_20" / manifest.UNIVERSAL).mkdir()
    (root / "step_20" / manifest.UNIVERSAL / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"derived")
    (root / "step_20" / "notes.txt").unlink()
    assert manifest.verify(root / "step_20") == []  # reshard's folder, derived after the save, is not the manifest's


def check_ranks_pass_over_a_truncated_shard_without_manifest(run: str) -> None:
    import torch.distributed as dist

    root = checkpoint.checkpoints_root(run)
    point = checkpoint.resolve_verified_resume("auto", run, "checksum")
    assert point.folder == root / "step_10"
    (skipped,) = point.skipped
    truncated = root / "step_20" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert skipped["checkpoint"] == str(root / "step_20") and len(skipped["problems"]) == 1
    assert skipped["problems"][0].startswith(f"{truncated}: not a whole torch file, truncated?")
    dist.barrier()


def test_a_truncated_shard_of_a_checkpoint_without_manifest_is_named_and_passed_over(tmp_path):
    """Checkpoints saved before manifests: resume on 2 gloo ranks takes the older step whose torch files are whole,
    naming the truncated file (torch alone said "failed finding central directory" in the middle of the load)."""
    import torch

    root = checkpoint.checkpoints_root(tmp_path / "run")
    for step in (10, 20):
        for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
            (root / f"step_{step}").mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "state": torch.arange(1000.0)}, root / f"step_{step}" / name)
    damage(root / "step_20" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "truncate")
    run_distributed(check_ranks_pass_over_a_truncated_shard_without_manifest, 2, str(tmp_path / "run"))


# ---- one judgement for every command -----------------------------------------------------------------------

SHARDS = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank_state/rank_00000.pt", "rank_state/rank_00001.pt",
          "data_sources.json", "recipe.yaml"]  # fmt: skip


def current_checkpoint(folder: Path) -> Path:
    """A step folder laid out as today's saves lay it out (ZeRO shards of two ranks, their `rank_state/`, the data
    fingerprint), with its manifest: what verification sees of a checkpoint, without a launch."""
    for index, relative in enumerate(SHARDS):
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(bytes([index]) * (64 + index))
    manifest.write(folder, manifest.describe(folder, SHARDS))
    checkpoint.write_pointer(folder.parent, folder.name)
    return folder


def judged_by_every_command(folder: Path) -> list[str]:
    """The problems `verify`, `export` and `eval` find (one process), after checking that a resume on 1, 2 or 3
    ranks (each rank its share, as `store.agree_on_problems` gathers them) finds the same."""
    alone = [str(problem) for problem in manifest.verify(folder) or []]
    for world_size in (1, 2, 3):
        shares = [manifest.verify(folder, "checksum", rank, world_size) or [] for rank in range(world_size)]
        assert sorted({str(problem) for share in shares for problem in share}) == sorted(alone), world_size
    return alone


def test_what_a_resume_writes_is_part_of_the_checkpoint_and_anything_else_is_damage(tmp_path, capsys):
    """After a resume on another number of ranks a step folder holds DeepSpeed's universal copy and the
    `latest_universal` pointer its converter writes beside it (`verify` called that damage while `train` resumed
    from it: issue 60). Those are the checkpoint's; a file added by anyone else is damage to every command."""
    folder = current_checkpoint(tmp_path / "run" / "checkpoints" / "step_3")
    (folder / "latest_universal").write_text("universal.tmp")
    for derived in ("universal", "universal.tmp"):
        (folder / derived / "zero" / "lm.weight").mkdir(parents=True)
        (folder / derived / "zero" / "lm.weight" / "fp32.pt").write_bytes(b"derived")
    universal = folder / "universal"
    manifest.write(universal, manifest.describe(universal, manifest.all_files(universal)))  # as the converter writes
    assert judged_by_every_command(folder) == []
    assert cli.main(["verify", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{folder}: intact"
    checkpoint.verify_before_reading(folder)  # what export and eval ask first

    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "added_tokens.json").write_text("{}")  # loaders read folders whole: never harmless
    assert judged_by_every_command(folder) == [f"{folder / 'tokenizer' / 'added_tokens.json'}: not in the manifest"]
    assert cli.main(["verify", str(folder)]) == 1
    assert capsys.readouterr().out == f"{folder}: damaged: {folder / 'tokenizer' / 'added_tokens.json'}: not in the " \
        "manifest\n"  # fmt: skip
    for command in (["export", str(folder), str(tmp_path / "hf")], ["eval", str(folder)]):
        assert cli.main(command) == 1, command
        assert "added_tokens.json: not in the manifest" in capsys.readouterr().err


def test_a_checkpoint_is_recognised_by_its_content_and_a_lost_manifest_is_damage(tmp_path, capsys):
    """An intact checkpoint copied to a folder of another name verifies; one whose manifest was deleted is damaged
    (its `rank_state/` and `data_sources.json` are written only by saves that write a manifest), not "saved before
    manifests", and a resume refuses it like any damage (`judged_by_every_command`)."""
    folder = current_checkpoint(tmp_path / "run" / "checkpoints" / "step_3")
    copy = tmp_path / "kept" / "best-so-far"
    shutil.copytree(folder, copy)
    assert cli.main(["verify", str(copy)]) == 0
    assert capsys.readouterr().out == f"{copy}: intact\n"
    with pytest.raises(FileNotFoundError, match="holds a checkpoint, but a resume needs it in a folder named step_"):
        checkpoint.resolve_resume(str(copy), "unused")

    (folder / manifest.MANIFEST).unlink()
    lost = f"{folder / manifest.MANIFEST}: missing, though the folder holds rank_state/, which only saves that write " \
        "a manifest have: it was removed or lost after the save"  # fmt: skip
    assert judged_by_every_command(folder) == [lost]
    assert checkpoint.is_checkpoint(folder)  # a resume looks at it, finds it damaged and passes over it
    assert cli.main(["verify", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"{folder}: damaged: {lost}"
    shutil.rmtree(folder / "rank_state")
    assert [problem.what.split(",")[0] for problem in manifest.verify(folder)] == ["missing"]  # data_sources.json too


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[]", 'not a checkpoint manifest (no "files" object in [])'),
        ('{"version": 1, "files": []}', 'not a checkpoint manifest (no "files" object in {"version": 1, "files": []})'),
        ('{"version": 1, "files": {"a.pt": 5}}', 'not a checkpoint manifest (the entry of a.pt is 5, not {"size"'),
        ('{"version": 1, "files": {"a.pt": {"size": "5", "xxh3_64": "0"}}}', "the entry of a.pt is {"),
        ('{"version": 1, "files": {"a.pt": {"size": true, "xxh3_64": "0"}}}', "the entry of a.pt is {"),
        ('{"version": 1, "files": {"../../x": {"size": 1, "xxh3_64": "0"}}}', "'../../x' is not a path inside"),
        ('{"version": 2, "files": {}}', "manifest version 2; this ntl_pretrain reads version 1"),
        ('{"files": {}}', "manifest version null; this ntl_pretrain reads version 1"),
        ('{"version": 1, "fi', "unreadable (Unterminated string starting at: line 1 column 16 (char 15))"),
        (b"\xff\xfe", "unreadable ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    ],
)
def test_a_manifest_of_the_wrong_schema_is_one_line_without_a_python_error_name(tmp_path, capsys, text, said):
    folder = current_checkpoint(tmp_path / "step_3")
    path = folder / manifest.MANIFEST
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    (problem,) = judged_by_every_command(folder)
    assert problem.startswith(f"{path}: ") and said in problem
    assert cli.main(["verify", str(folder)]) == 1
    line = capsys.readouterr().out
    assert line.startswith(f"{folder}: damaged: {path}: ") and said in line and line.count("\n") == 1
    assert not any(name in line for name in ("Error", "Exception"))
