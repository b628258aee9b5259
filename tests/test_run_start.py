"""`--dry-run` sees what the launch sees before step 1 (issue 59 items 2-4, issue 60 items 4 and 7): where the run
writes and how it starts (absolute paths; start from scratch, from `init_from`, or resume step N), a tokenizer
without number tokens, a checkpoint trained with another recipe (the resume guard, ZeRO stage included), and a
corpus whose first records give NTL nothing to learn. A refusal is one line of at most 300 characters, said once,
exit 2, by `train` and `--dry-run` alike; on a rank (a launch by hand, or under the supervisor) too. And a piped
recipe's relative paths, `base:` included, are the working directory's.

Validation runs in-process through `cli.main`, with the launcher replaced by a recorder (as in
tests/test_recipe_errors.py); the checkpoint the guard compares is written with the trainer's own writers."""

from __future__ import annotations

import json
import os
import string
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers.launches import said_beyond_progress

from ntl_pretrain import cli
from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.loading import dump_recipe, load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.runtime import lifeline, supervisor
from ntl_pretrain.tokenizer import load_tokenizer
from ntl_pretrain.train import main as rank_main
from ntl_pretrain.train import resume_guard

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str, list]:
    launches = []
    monkeypatch.setattr(supervisor, "supervise", lambda command, *args, **kwargs: launches.append(command) or 0)
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err, launches


def refused_alike(argv: list[str], monkeypatch, capsys) -> str:
    """The one line `train` and `train --dry-run` both refuse `argv` with (exit 2, nothing launched)."""
    lines = set()
    for dry in ([], ["--dry-run"]):
        code, out, err, launches = run_cli([*argv, *dry], monkeypatch, capsys)
        said = said_beyond_progress(err)
        assert (code, out, launches, len(said)) == (2, "", [], 1), err
        lines.add(said[0])
    (line,) = lines
    assert line.startswith("ntl-pretrain train: recipe error: ") and len(line) <= 300, line
    return line


def digitless_tokenizer(folder: Path) -> Path:
    """A real fast tokenizer (letters, punctuation, an EOS) with no number token: digits become [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["[UNK]", "</s>", " ", *string.ascii_letters, *".,?+-=*/()"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    return folder


def test_a_tokenizer_without_number_tokens_is_refused_before_launch_unless_ntl_is_off(tmp_path, monkeypatch,
                                                                                      capsys):  # fmt: skip
    """It passed `--dry-run`, then every rank died after start-up with a 77-line traceback (issue 59)."""
    tokenizer = digitless_tokenizer(tmp_path / "no-digits")
    argv = ["train", str(TINY), "--nproc", "2", f"tokenizer.path={tokenizer}", f"train.output_dir={tmp_path / 'run'}"]
    line = refused_alike(argv, monkeypatch, capsys)
    assert line == ("ntl-pretrain train: recipe error: loss.ntl.kind: was, but the tokenizer (tokenizer.path's) has "
                    "no number token (no token of ASCII digits), so NTL has nothing to learn; use a tokenizer with "
                    "number tokens, or loss.ntl.kind: null for CE alone")  # fmt: skip
    code, _, err, launches = run_cli([*argv, "loss.ntl.kind=null"], monkeypatch, capsys)
    assert code == 0 and len(launches) == 1, err


def trained_checkpoint(output_dir: Path, step: int, overrides: list[str]) -> Path:
    """A step folder holding what the resume guard reads, written as the trainer writes it at a save (the weights
    and optimizer shards, which the guard never reads, stand in as an empty DeepSpeed model-states file)."""
    from ntl_pretrain.checkpoint import store as checkpoint
    from ntl_pretrain.model.build import hf_config

    recipe, _ = load_run(TINY, [f"train.output_dir={output_dir}", *overrides], world_size=2)
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    folder = checkpoint.checkpoints_root(output_dir) / f"step_{step}"
    hf_config(recipe, tokenizer).save_pretrained(folder / checkpoint.HF_CONFIG)
    tokenizer.save_pretrained(folder / checkpoint.TOKENIZER)
    (folder / "recipe.yaml").write_text(dump_recipe(recipe))
    resume_guard.write_data_fingerprint(folder, recipe)
    (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
    manifest.write(folder, manifest.describe(folder, manifest.all_files(folder)), step)  # the last file a save writes
    return folder


def test_another_runs_output_folder_is_refused_by_the_dry_run_as_by_the_launch(tmp_path, monkeypatch, capsys):
    """It passed `--dry-run`, then the launch refused with a 1,429-character line printed twice (issue 59); a ZeRO
    stage change on resume was refused only by the ranks (issue 60)."""
    output_dir = tmp_path / "run"
    shapes = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=1"]
    folder = trained_checkpoint(output_dir, 20, shapes)
    written = sorted((path, path.stat().st_mtime_ns) for path in output_dir.rglob("*"))
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={output_dir}"]
    code, out, err, launches = run_cli([*argv, *shapes, "--dry-run"], monkeypatch, capsys)
    assert code == 0 and not launches, err
    assert f"# {output_dir}: resumes {folder} (step 20) and trains to step 300\n# " in out
    shown = "…/run/checkpoints/step_20"  # a path this long gives its room to the differences
    head = f"ntl-pretrain train: recipe error: train.resume: {shown} holds a run of another recipe (saved → now): "
    line = refused_alike(argv, monkeypatch, capsys)
    assert line == head + "model.config.head_dim: 8 → 16; model.config.hidden_size: 32 → 64; model.config." \
        "intermediate_size: 64 → 256 (+1 more); keep that recipe or use another train.output_dir"  # fmt: skip
    line = refused_alike([*argv, *shapes, "deepspeed.zero_stage=2"], monkeypatch, capsys)
    assert line == head + "deepspeed.zero_stage (the optimizer shards' layout): 3 → 2; keep that recipe or use " \
        "another train.output_dir"  # fmt: skip
    assert len(str(folder)) > resume_guard.MAX_FOLDER_CHARS
    assert sorted((path, path.stat().st_mtime_ns) for path in output_dir.rglob("*")) == written


def test_the_dry_run_passes_over_a_damaged_checkpoint_as_the_ranks_do_and_refuses_when_none_is_intact(
    tmp_path, monkeypatch, capsys
):
    """`auto` on the ranks passes over a checkpoint that fails verification; the dry run said it resumed that one,
    and ran the resume guard on it. Now both judge by what can be told without reading the files (sizes)."""
    output_dir = tmp_path / "run"
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={output_dir}"]
    intact = trained_checkpoint(output_dir, 20, [])
    damaged = trained_checkpoint(output_dir, 30, ["model.config.hidden_size=32"])  # a guard would refuse this one
    cut = damaged / "recipe.yaml"
    cut.write_bytes(cut.read_bytes()[:100])  # a copy cut short
    code, out, err, launches = run_cli([*argv, "--dry-run"], monkeypatch, capsys)
    assert code == 0 and not launches, err
    size = f"{cut}: size 100 bytes, manifest says {manifest.read(damaged)['recipe.yaml']['size']}"
    assert f"# {output_dir}: resumes {intact} (step 20) and trains to step 300; passes over the damaged {damaged} " \
        f"({size}), which the run moves to {damaged}.damaged\n# " in out  # fmt: skip
    code, out, err, launches = run_cli(argv, monkeypatch, capsys)
    assert code == 0 and len(launches) == 1, err

    (intact / "tokenizer" / "notes.txt").write_text("added after the save")
    for dry in ([], ["--dry-run"]):
        code, out, err, launches = run_cli([*argv, *dry], monkeypatch, capsys)
        assert (code, out, launches) == (1, "", []), err
        assert said_beyond_progress(err) == [f"ntl-pretrain train: train.resume: auto: no checkpoint in {output_dir}/"
                                             f"checkpoints verifies ({damaged}: {size}; 1 more damaged); repair or "
                                             "move them away to start afresh"]  # fmt: skip
    code, out, err, launches = run_cli([*argv, f"train.resume={intact}", "--dry-run"], monkeypatch, capsys)
    assert code == 1 and said_beyond_progress(err) == [f"ntl-pretrain train: train.resume: checkpoint {intact} is "
                                                       f"damaged, nothing was loaded from it: {intact}/tokenizer/"
                                                       "notes.txt: not in the manifest"]  # fmt: skip


def test_a_checkpoint_is_judged_by_the_step_its_manifest_records_not_its_folders_name(tmp_path, monkeypatch,
                                                                                      capsys):  # fmt: skip
    """`step_5` renamed `step_12` with `train.max_steps=12` gave "already at step 12; nothing to train", exit 0;
    renamed `step_9`, the dry run said "resumes step 9" where the ranks resume step 5 (issue 72). The name is a
    label: the manifest's step decides, in the dry run and at launch."""
    output_dir = tmp_path / "run"
    saved = trained_checkpoint(output_dir, 5, [])
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={output_dir}"]
    for label, max_steps in (("step_12", 12), ("step_9", 30)):
        folder = saved.rename(saved.with_name(label))
        code, out, err, launches = run_cli([*argv, f"train.max_steps={max_steps}", "--dry-run"], monkeypatch, capsys)
        assert code == 0 and not launches, err
        assert f"# {output_dir}: resumes {folder} (step 5) and trains to step {max_steps}\n# " in out
        code, out, err, launches = run_cli([*argv, f"train.max_steps={max_steps}"], monkeypatch, capsys)
        assert (code, len(launches)) == (0, 1), err
        assert "nothing to train" not in out + err
        saved = folder
    assert cli.main(["verify", str(saved)]) == 0
    assert capsys.readouterr().out == f"{saved}: intact (holds step 5, which a resume continues from)\n"


def test_a_finished_runs_folder_is_refused_to_another_recipe_before_nothing_to_train(tmp_path, monkeypatch, capsys):
    """With the same `train.max_steps`, a finished run's folder given to a recipe of another `data.seq_len` got
    "already at step 10; nothing to train", exit 0 (issue 72): it is refused as a run of another recipe, as it is
    with more steps to train."""
    output_dir = tmp_path / "run"
    trained_checkpoint(output_dir, 10, ["train.max_steps=10"])
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={output_dir}", "train.max_steps=10"]
    code, out, err, launches = run_cli(argv, monkeypatch, capsys)
    assert (code, launches) == (0, []) and "already at step 10 of train.max_steps=10; nothing to train" in out, err
    for steps in ("train.max_steps=10", "train.max_steps=20"):
        line = refused_alike([*argv, steps, "data.seq_len=64"], monkeypatch, capsys)
        assert line.endswith("holds a run of another recipe (saved → now): data.seq_len: 128 → 64; keep that recipe "
                             "or use another train.output_dir"), line  # fmt: skip


def test_every_refusal_of_a_command_line_value_names_the_override(tmp_path, monkeypatch, capsys):
    """The checks before launch refused `model.config.hidden_size=64.0` or a `train.output_dir` that is a file
    without saying that the value came from the command line, as the loader's own refusals do (issue 72)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    head = "ntl-pretrain train: recipe error: command-line override: "
    argv = ["train", str(TINY), "--nproc", "1"]
    assert refused_alike([*argv, "model.config.hidden_size=64.0"], monkeypatch, capsys) == head + (
        "model.config.hidden_size: expected int (LlamaConfig's hidden_size is a whole number), got 64.0"
    )
    assert refused_alike([*argv, f"train.output_dir={a_file}"], monkeypatch, capsys) == head + (
        f"train.output_dir: {a_file} is a file, not a folder"
    )
    recipe = tmp_path / "mine.yaml"  # the same value set in a file: named by the file, as before
    recipe.write_text(yaml.safe_dump({"base": str(TINY), "train": {"output_dir": str(a_file)}}))
    line = refused_alike(["train", str(recipe), "--nproc", "1"], monkeypatch, capsys)
    assert line == f"ntl-pretrain train: recipe error: train.output_dir: {a_file} is a file, not a folder"


def test_the_dry_run_prints_absolute_paths_and_how_the_run_starts(tmp_path, monkeypatch, capsys):
    """A recipe in one folder, run from another: every path the dry run prints is absolute, and the last lines say
    where the run writes and how it starts."""
    from helpers.tiny_models import tiny_model

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    model = project / "models" / "tiny-llama"
    architecture = yaml.safe_load(TINY.read_text())["model"]["config"]  # what init_from's weights must fit
    tiny_model("llama", vocab_size=2048, **architecture).save_pretrained(model)
    load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer").save_pretrained(model)
    recipe = project / "recipes" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump({"base": str(TINY), "train": {"output_dir": "../runs/mine", "max_steps": 40}}))
    monkeypatch.chdir(elsewhere)
    from_model = ["init_from=../project/models/tiny-llama", "model.model_type=null", "tokenizer.path=null"]
    starts = [
        ([], "starts from scratch and trains 40 steps"),
        (from_model, f"starts from the weights of init_from {model} and trains 40 steps"),
    ]
    for overrides, start in starts:
        argv = ["train", str(recipe), "--nproc", "1", "--dry-run", *overrides]
        code, out, err, _ = run_cli(argv, monkeypatch, capsys)
        assert code == 0, err
        printed, plan, command = out.rsplit("\n# ", 2)
        assert plan == f"{project / 'runs' / 'mine'}: {start}"
        resolved = yaml.safe_load(printed)
        assert resolved["train"]["output_dir"] == str(project / "runs" / "mine")
        paths = [resolved["init_from"], *(source["path"] for source in resolved["data"]["sources"])]
        assert all(path is None or path.startswith("pkg:") or Path(path).is_absolute() for path in paths), paths
        assert "--module ntl_pretrain.train" in command


def test_a_corpus_without_number_labels_is_reported_by_the_dry_run_and_at_step_1(tmp_path, monkeypatch, capsys):
    words = tmp_path / "words.jsonl"
    words.write_text("".join(json.dumps({"text": f"the {w} sat on the mat"}) + "\n" for w in string.ascii_lowercase))
    sums = tmp_path / "sums.jsonl"
    sums.write_text("".join(json.dumps({"text": f"{n} plus {n} is {2 * n}"}) + "\n" for n in range(26)))
    argv = ["train", str(TINY), "--nproc", "1", "--dry-run", f"train.output_dir={tmp_path / 'run'}"]
    notes = {}
    for corpus in (words, sums):
        code, _, err, _ = run_cli(
            [*argv, f"data.sources=[{{name: {corpus.stem}, path: {corpus}}}]"], monkeypatch, capsys
        )
        assert code == 0, err
        notes[corpus.stem] = [line for line in err.splitlines() if line.startswith("ntl-pretrain: note: loss.ntl:")]
    assert notes == {"sums": [], "words": [
        "ntl-pretrain: note: loss.ntl: no label in the first 64 records of words is a number token NTL acts on, so "
        "NTL (weight 0.3) has nothing to learn from them; `ntl-pretrain data preview` shows the number tokens, "
        "loss.ntl.kind: null trains with CE alone"]}  # fmt: skip

    from ntl_pretrain.train.trainer import Trainer

    said = []
    for fraction, kind in [(0.0, "was"), (0.01, "was"), (0.0, None)]:
        ntl = SimpleNamespace(kind=kind, weight=0.3)
        trainer = SimpleNamespace(recipe=SimpleNamespace(loss=SimpleNamespace(ntl=ntl)), step=1,
                                  console=SimpleNamespace(say=said.append))  # fmt: skip
        Trainer._say_if_ntl_has_nothing(trainer, {"number_token_fraction": fraction})
    assert said == [
        "note: step 1 held no label NTL acts on (a number token), so NTL (weight 0.3) learned nothing "
        "in it; if the data holds no numbers it never will (`ntl-pretrain data preview` shows them)"
    ]


def test_a_refusal_on_a_rank_is_one_line_said_once(tmp_path, monkeypatch, capsys):
    """Under `ntl-pretrain train` (a supervisor) the ranks only report the line, which the supervisor says last;
    launched by hand, rank 0 says a refusal every rank makes alike, and each rank its own; cut to 300 characters."""
    monkeypatch.setattr(rank_main.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.delenv(lifeline.VARIABLE, raising=False)
    said = {}
    for rank, alike in [("0", True), ("1", True), ("1", False)]:
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as ended:
            rank_main.refuse("recipe error: " + "x" * 400, alike=alike)
        said[rank, alike] = (ended.value.code, capsys.readouterr().err)
    line = "ntl-pretrain: recipe error: " + "x" * 271 + "…"
    assert len(line) == 300
    assert said == {("0", True): (2, line + "\n"), ("1", True): (2, ""), ("1", False): (2, line + "\n")}
    outcome = tmp_path / "outcome"
    monkeypatch.setenv(lifeline.VARIABLE, f"{os.uname().nodename}:{os.getpid()}:{outcome}")
    with pytest.raises(SystemExit):
        rank_main.refuse("recipe error: train.resume: the line", alike=True)
    assert capsys.readouterr().err == ""
    assert lifeline.reported_refusal(outcome) == "recipe error: train.resume: the line"


def test_the_supervisor_leaves_out_the_launchers_line_for_a_refusing_rank():
    """DeepSpeed's launcher logs the whole rank command for a rank's exit code; for 2 the rank's own line says why."""
    launcher = "[2026-11-29 10:00:00,000] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u'] exits with " \
        "return code = "  # fmt: skip
    noise = supervisor.LAUNCHER_NOISE
    assert [bool(noise.fullmatch(f"{launcher}{code}\n".encode())) for code in (2, 75, 1, 20, 137)] == [
        True, True, False, False, False]  # fmt: skip


def test_fitted_line_names_what_fits_then_the_keys_then_how_many_more():
    items, keys = ["a.b: 1 → 2", "c.d: 3 → 4", "e.f: 5555 → 6666"], ["a.b", "c.d", "e.f"]
    fitted = {limit: resume_guard.fitted_line("H: ", items, keys, "; T", limit) for limit in (46, 45, 40, 26)}
    assert fitted == {
        46: "H: a.b: 1 → 2; c.d: 3 → 4; e.f: 5555 → 6666; T",
        45: "H: a.b: 1 → 2; c.d: 3 → 4 (+1 more: e.f); T",
        40: "H: a.b: 1 → 2; c.d: 3 → 4 (+1 more); T",
        26: "H: a.b: 1 → 2 (+2 more); T",
    }
    # A first difference longer than the line (a list of files, say) is cut, never the line's tail.
    long = resume_guard.fitted_line("H: ", ["a.b: " + "x" * 50 + " → 2", "c.d: 3 → 4"], ["a.b", "c.d"], "; T", 40)
    assert long == "H: a.b: " + "x" * 18 + "… (+1 more); T" and len(long) == 40


def pipe_writing(text: str, path: Path | None = None) -> str:
    """A named FIFO at `path` (or bash's `<(...)`, a `/dev/fd/N`) that a thread writes `text` into."""
    if path is None:
        read_end, write_end = os.pipe()
        target, opened = f"/dev/fd/{read_end}", lambda: os.fdopen(write_end, "w")
    else:
        os.mkfifo(path)
        target, opened = str(path), lambda: open(path, "w")  # noqa: SIM115 - closed by the thread's `with`

    def write() -> None:
        with opened() as pipe:
            pipe.write(text)

    threading.Thread(target=write, daemon=True).start()
    return target


def test_a_piped_recipes_relative_paths_base_included_are_the_working_directorys(tmp_path, monkeypatch):
    """`cd recipes && train <(printf 'base: tiny-cpu.yaml\\n')` looked for /proc/<pid>/fd/tiny-cpu.yaml, and a named
    FIFO anchored `base:` at its own folder but its data at the working directory (issue 60)."""
    (tmp_path / "fifos").mkdir()
    (tmp_path / "held_out.jsonl").write_text('{"text": "2 plus 2 is 4"}\n')
    monkeypatch.chdir(REPO / "recipes")
    held_out = os.path.relpath(tmp_path / "held_out.jsonl")
    text = f"base: tiny-cpu.yaml\ntrain: {{output_dir: runs/piped}}\ndata: {{validation: [{{path: {held_out}}}]}}\n"
    for pipe in (pipe_writing(text), pipe_writing(text, tmp_path / "fifos" / "recipe.fifo")):
        recipe = load_recipe(pipe)
        assert recipe.model == load_recipe(TINY).model  # the base was found
        assert recipe.train.output_dir == str(REPO / "recipes" / "runs" / "piped")
        assert recipe.data.validation[0].path == str(tmp_path / "held_out.jsonl")
    monkeypatch.chdir(tmp_path / "fifos")
    with pytest.raises(RecipeError, match=rf"base: {tmp_path}/fifos/other\.yaml does not exist"):
        load_recipe(pipe_writing("base: other.yaml\n"))
