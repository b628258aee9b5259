"""Bad inputs to every command, one row each: exit 2 with one line `ntl-pretrain <command>: ...` that names the
file, argument or line, no traceback, and nothing written (the workspace is byte for byte as it was). Recipes have
their own table (`test_recipe_errors.py`); this one walks the other commands.

Rows run in-process through `cli.main` (each command fails before it loads a model or starts a process), a few
through a fresh interpreter as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launches import said_beyond_progress

from ntl_pretrain import cli, errors
from ntl_pretrain.checkpoint import manifest

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny-cpu.yaml")
ALIAS_RECIPE = "a: &x [1, 2]\nb: *x\n"
COMMANDS = (*cli.OWN_COMMANDS, *cli.DELEGATED_COMMANDS, "data import-prose", "data make-arithmetic",
            "data make-regression", "data train-tokenizer", "data preview")  # fmt: skip

# (id, argv ({tmp} = the workspace), exit code, fragments the error line must contain)
ROWS = [
    # the command line itself
    ("no-command", [], 2, ["ntl-pretrain:", "required: command"]),
    ("unknown-command", ["trian"], 2, ["invalid choice", "'eval'", "'plot'", "'study'", "'data'", "'doctor'"]),
    (
        "override-without-equals",
        ["train", TINY, "--nproc", "1", "train.max_steps"],
        2,
        ["ntl-pretrain train:", "command-line override 'train.max_steps'", "key.path=value"],
    ),
    ("unknown-option", ["train", TINY, "--bogus"], 2, ["ntl-pretrain train:", "unrecognized arguments: --bogus"]),
    # eval: every argument before any model is loaded
    ("eval-missing", ["eval", "{tmp}/nope"], 2, ["ntl-pretrain eval:", "nope", "neither an HF model folder"]),
    ("eval-no-weights", ["eval", "{tmp}/no-weights"], 2, ["no-weights", "without weights"]),
    ("eval-batch-size", ["eval", "{tmp}/hf", "--batch-size", "0"], 2, ["--batch-size", ">= 1, got 0"]),
    ("eval-seq-len", ["eval", "{tmp}/hf", "--seq-len", "0"], 2, ["--seq-len", ">= 1, got 0"]),
    ("eval-max-examples", ["eval", "{tmp}/hf", "--max-examples", "-1"], 2, ["--max-examples", ">= 0"]),
    ("eval-max-new-tokens", ["eval", "{tmp}/hf", "--max-new-tokens", "0"], 2, ["--max-new-tokens", ">= 1"]),
    ("eval-validation-batches", ["eval", "{tmp}/hf", "--max-validation-batches", "0"], 2, ["--max-validation-batches"]),
    ("eval-out-folder", ["eval", "{tmp}/hf", "--out", "{tmp}/empty"], 2, ["--out", "empty is a folder"]),
    ("eval-out-unwritable", ["eval", "{tmp}/hf", "--out", "{tmp}/file.txt/x.json"], 2, ["--out", "cannot be written"]),
    ("eval-answers-folder", ["eval", "{tmp}/hf", "--answers", "{tmp}/empty"], 2, ["--answers", "is a folder"]),
    ("eval-qa-missing", ["eval", "{tmp}/hf", "--qa", "{tmp}/none.jsonl"], 2, ["no such file", "none.jsonl"]),
    ("eval-log-metrics-hf", ["eval", "{tmp}/hf", "--log-metrics"], 2, ["--log-metrics", "not a run"]),
    ("eval-template-alone", ["eval", "{tmp}/hf", "--template", "{question}"], 2, ["--template", "--validation"]),
    ("eval-prompt-template", ["eval", "{tmp}/hf", "--prompt-template", "Q:"], 2, ["prompt_template", "Q:"]),
    (
        "eval-validation-missing",
        ["eval", "{tmp}/hf", "--validation", "{tmp}/none.jsonl"],
        2,
        ["--validation", "none.jsonl"],
    ),
    ("eval-bad-int", ["eval", "{tmp}/hf", "--batch-size", "x"], 2, ["ntl-pretrain eval:", "--batch-size", "'x'"]),
    ("eval-saved-recipe-alias", ["eval", "{tmp}/alias-run"], 2, ["recipe.yaml", "line 2", "alias *x"]),
    # eval: the model folder, before transformers reads it
    ("eval-config-not-json", ["eval", "{tmp}/bad-config"], 2, ["bad-config/config.json", "not a JSON model config"]),
    ("eval-random-weights", ["eval", "{tmp}/random-weights"], 2, ["model.safetensors", "unreadable safetensors"]),
    ("eval-no-tokenizer", ["eval", "{tmp}/no-tokenizer"], 2, ["no-tokenizer", "no tokenizer", "tokenizer.json"]),
    ("eval-seq-len-positions", ["eval", "{tmp}/hf-64", "--seq-len", "65"], 2, ["--seq-len", "max_position_embeddings"]),
    ("eval-qa-empty", ["eval", "{tmp}/hf-64", "--qa", "{tmp}/empty.jsonl"], 2, ["--qa", "empty.jsonl", "no question"]),
    # export and convert-gguf
    ("export-missing", ["export", "{tmp}/nope", "{tmp}/out"], 2, ["ntl-pretrain export:", "nope", "step folder"]),
    ("export-out-is-file", ["export", "{tmp}/nope", "{tmp}/file.txt"], 2, ["file.txt", "is a file"]),
    ("export-dtype", ["export", "{tmp}/nope", "{tmp}/out", "--dtype", "fp8"], 2, ["--dtype", "'fp8'"]),
    ("gguf-missing", ["convert-gguf", "{tmp}/none.gguf", "{tmp}/out"], 2, ["ntl-pretrain convert-gguf:", "none.gguf"]),
    ("gguf-not-gguf", ["convert-gguf", "{tmp}/file.txt", "{tmp}/out"], 2, ["file.txt", "not a GGUF file"]),
    ("gguf-no-package", ["convert-gguf", "pkg:no_such_package_x/m.gguf", "{tmp}/out"], 2, ["no_such_package_x"]),
    ("gguf-out-is-file", ["convert-gguf", "{tmp}/file.txt", "{tmp}/file.txt"], 2, ["file.txt", "is a file"]),
    ("gguf-truncated", ["convert-gguf", "{tmp}/cut.gguf", "{tmp}/out"], 2, ["cut.gguf", "damaged or truncated GGUF"]),
    # plot
    (
        "plot-bad-line",
        ["plot", "{tmp}/bad-run", "-o", "{tmp}/p.png"],
        2,
        ["ntl-pretrain plot:", "bad-run/metrics.jsonl", "line 2", "not a JSON record"],
    ),
    ("plot-list-line", ["plot", "{tmp}/list-run", "-o", "{tmp}/p.png"], 2, ["line 1", "not a JSON record"]),
    ("plot-no-metrics", ["plot", "{tmp}/empty", "-o", "{tmp}/p.png"], 2, ["empty", "no metrics.jsonl"]),
    ("plot-nothing-to-plot", ["plot", "{tmp}/bare-run", "-o", "{tmp}/p.png"], 2, ["no plottable metrics"]),
    ("plot-text-values", ["plot", "{tmp}/text-run", "-o", "{tmp}/p.png"], 2, ["no plottable metrics", "text-run"]),
    ("plot-out-folder", ["plot", "{tmp}/bad-run", "-o", "{tmp}/empty"], 2, ["-o", "is a folder", "metrics.png"]),
    ("plot-out-unwritable", ["plot", "{tmp}/bad-run", "-o", "{tmp}/file.txt/p.png"], 2, ["-o", "cannot be written"]),
    ("plot-out-suffix", ["plot", "{tmp}/bad-run", "-o", "{tmp}/p.txt"], 2, ["-o", "p.txt", ".png"]),
    (
        "plot-labels",
        ["plot", "{tmp}/bad-run", "{tmp}/bad-run", "--labels", "a", "-o", "{tmp}/p.png"],
        2,
        ["--labels", "1 labels for 2 runs"],
    ),
    # data
    (
        "prose-missing",
        ["data", "import-prose", "{tmp}/none.txt", "--out", "{tmp}/prose"],
        2,
        ["ntl-pretrain data import-prose:", "none.txt"],
    ),
    (
        "prose-not-gutenberg",
        ["data", "import-prose", "{tmp}/file.txt", "--out", "{tmp}/prose"],
        2,
        ["file.txt", "not a Project Gutenberg text"],
    ),
    (
        "prose-not-utf8",
        ["data", "import-prose", "{tmp}/latin1.txt", "--out", "{tmp}/prose"],
        2,
        ["latin1.txt", "utf-8"],
    ),
    (
        "prose-lines",
        ["data", "import-prose", "{tmp}/file.txt", "--lines-per-document", "0"],
        2,
        ["--lines-per-document"],
    ),
    (
        "arithmetic-scale-negative",
        ["data", "make-arithmetic", "--scale", "-1", "--out", "{tmp}/ar"],
        2,
        ["ntl-pretrain data make-arithmetic:", "--scale", "-1"],
    ),
    ("arithmetic-scale-zero", ["data", "make-arithmetic", "--scale", "0", "--out", "{tmp}/ar"], 2, ["--scale"]),
    ("arithmetic-out-file", ["data", "make-arithmetic", "--out", "{tmp}/file.txt"], 2, ["--out", "is a file"]),
    (
        "regression-noise-negative",
        ["data", "make-regression", "--noise-sd", "-1", "--out", "{tmp}/re"],
        2,
        ["ntl-pretrain data make-regression:", "--noise-sd", ">= 0, got -1"],
    ),
    ("regression-noise-nan", ["data", "make-regression", "--noise-sd", "nan", "--out", "{tmp}/re"], 2, ["--noise-sd"]),
    ("regression-scale-zero", ["data", "make-regression", "--scale", "0", "--out", "{tmp}/re"], 2, ["--scale"]),
    ("regression-scale-too-many", ["data", "make-regression", "--scale", "40", "--out", "{tmp}/re"], 2, ["250000"]),
    ("regression-out-file", ["data", "make-regression", "--out", "{tmp}/file.txt"], 2, ["--out", "is a file"]),
    (
        "tokenizer-no-corpus",
        ["data", "train-tokenizer", "--corpus", "{tmp}/empty", "--out", "{tmp}/tok"],
        2,
        ["--corpus", "train.jsonl"],
    ),
    ("preview-samples", ["data", "preview", TINY, "--samples", "-1"], 2, ["ntl-pretrain data preview:", "--samples"]),
    ("preview-batches", ["data", "preview", TINY, "--batches", "0"], 2, ["--batches", ">= 1"]),
    ("preview-recipe-missing", ["data", "preview", "{tmp}/none.yaml"], 2, ["recipe error", "none.yaml"]),
    ("preview-alias", ["data", "preview", "{tmp}/alias.yaml"], 2, ["alias.yaml", "alias *x", "not allowed"]),
    # verify, doctor, study
    ("verify-missing", ["verify", "{tmp}/nope"], 2, ["ntl-pretrain verify:", "nope", "does not exist"]),
    ("verify-nothing", ["verify", "{tmp}/empty"], 1, ["ntl-pretrain verify:", "no checkpoint"]),
    ("doctor-recipe", ["doctor", "--recipe", "{tmp}/none.yaml"], 2, ["ntl-pretrain doctor:", "--recipe"]),
    ("doctor-out-folder", ["doctor", "--out", "{tmp}/empty"], 2, ["--out", "is a folder"]),
    ("doctor-work-dir-file", ["doctor", "--work-dir", "{tmp}/file.txt"], 2, ["--work-dir", "is a file"]),
    ("study-seeds", ["study", "--seeds", "x"], 2, ["ntl-pretrain study:", "--seeds", "'x'"]),
    # study: whatever it writes hours later, checked before the first run
    ("study-doc-folder", ["study", "--variants", "ce", "--seeds", "0", "--doc", "{tmp}/empty"], 2, ["--doc", "folder"]),
    ("study-plot-under-file", ["study", "--plot", "{tmp}/file.txt/p.png"], 2, ["--plot", "cannot be written"]),
    ("study-runs-dir-file", ["study", "--runs-dir", "{tmp}/file.txt", "--status"], 2, ["--runs-dir", "is a file"]),
    ("study-stop-after", ["study", "--stop-after", "-5"], 2, ["--stop-after", "-5"]),
    ("study-protocol-missing", ["study", "--protocol", "{tmp}/none.md"], 2, ["--protocol", "none.md"]),
    ("doctor-busbw", ["doctor", "--expected-busbw", "-5"], 2, ["ntl-pretrain doctor:", "--expected-busbw", "-5"]),
    # issue 42: nothing a user did not name is replaced (an input, a symlink, a file a command did not write)
    (
        "eval-out-model-config",
        ["eval", "{tmp}/hf", "--out", "{tmp}/hf/config.json"],
        2,
        ["--out", "exists", "--overwrite"],
    ),
    (
        "eval-answers-is-qa",
        ["eval", "{tmp}/hf-64", "--qa", "{tmp}/qa.jsonl", "--answers", "{tmp}/qa.jsonl", "--overwrite"],
        2,
        ["--answers", "qa.jsonl is (or holds) the input"],
    ),
    (
        "eval-out-is-answers",
        ["eval", "{tmp}/hf", "--out", "{tmp}/r.json", "--answers", "{tmp}/r.json"],
        2,
        ["also --out"],
    ),
    (
        "export-existing-folder",
        ["export", "{tmp}/nope", "{tmp}/hf"],
        2,
        ["out_dir", "hf exists (folder)", "--overwrite"],
    ),
    (
        "export-into-checkpoint",
        ["export", "{tmp}/alias-run", "{tmp}/alias-run", "--overwrite"],
        2,
        ["is (or holds) the input"],
    ),
    ("gguf-existing-folder", ["convert-gguf", "{tmp}/cut.gguf", "{tmp}/hf"], 2, ["out_dir", "exists (folder)"]),
    (
        "plot-through-symlink",
        ["plot", "{tmp}/bare-run", "-o", "{tmp}/link.png"],
        2,
        ["-o", "is a symlink", "alias.yaml"],
    ),
    ("plot-user-image", ["plot", "{tmp}/bare-run", "-o", "{tmp}/photo.png"], 2, ["-o", "photo.png exists (file)"]),
    (
        "arithmetic-existing",
        ["data", "make-arithmetic", "--out", "{tmp}/corpus"],
        2,
        ["--out", "train.jsonl exists", "--overwrite"],
    ),
    ("regression-existing", ["data", "make-regression", "--out", "{tmp}/corpus"], 2, ["regression/train.jsonl exists"]),
    ("prose-existing", ["data", "import-prose", "{tmp}/file.txt", "--out", "{tmp}/corpus/addition"], 2, ["exists"]),
    ("tokenizer-existing", ["data", "train-tokenizer", "--corpus", "{tmp}/corpus", "--out", "{tmp}/hf"], 2, ["exists"]),
    ("study-doc-is-plot", ["study", "--doc", "{tmp}/r.md", "--plot", "{tmp}/r.md"], 2, ["--plot", "also --doc"]),
    (
        "study-doc-user-file",
        ["study", "--doc", "{tmp}/file.txt"],
        2,
        ["--doc", "file.txt exists (file)", "--overwrite"],
    ),
    (
        "study-doc-is-protocol",
        ["study", "--doc", "{tmp}/alias.yaml", "--protocol", "{tmp}/alias.yaml"],
        2,
        ["--doc", "is (or holds) the input"],
    ),
]


@pytest.fixture
def workspace(tmp_path):
    for folder in ("empty", "hf", "no-weights", "bad-run", "list-run", "bare-run"):
        (tmp_path / folder).mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    (tmp_path / "no-weights" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "bad-run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    (tmp_path / "list-run" / "metrics.jsonl").write_text("[1, 2]\n")
    (tmp_path / "bare-run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "file.txt").write_text("no markers here\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "alias.yaml").write_text(f"base: {TINY}\n" + ALIAS_RECIPE)
    model_folders(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")  # the magic, then a header cut short
    (tmp_path / "link.png").symlink_to(tmp_path / "alias.yaml")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's own picture")
    (tmp_path / "qa.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    for name in ("addition", "regression", "arithmetic", "prose", "word_problems"):
        (tmp_path / "corpus" / name).mkdir(parents=True)
        (tmp_path / "corpus" / name / "train.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "text-run").mkdir()
    (tmp_path / "text-run" / "metrics.jsonl").write_text('{"step": "one", "loss": "low"}\n')
    step = tmp_path / "alias-run" / "checkpoints" / "step_1"
    (step / "hf_config").mkdir(parents=True)
    (step / "recipe.yaml").write_text(ALIAS_RECIPE)
    manifest.write(step, manifest.describe(step, ["recipe.yaml"]))  # what makes a step folder a checkpoint
    return tmp_path


def model_folders(tmp_path: Path) -> None:
    """HF folders that fail only once their files are read: config.json not JSON, weights of random bytes, no
    tokenizer; and `hf-64`, a whole one (64 positions) for the arguments checked against the model."""
    import torch
    from safetensors.torch import save_file

    tokenizer = REPO / "ntl_pretrain" / "corpus" / "tiny-tokenizer" / "tokenizer.json"
    for name in ("bad-config", "random-weights", "no-tokenizer", "hf-64"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
        save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / name / "model.safetensors")
        if name != "no-tokenizer":
            (tmp_path / name / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (tmp_path / "bad-config" / "config.json").write_text("{not json")
    (tmp_path / "random-weights" / "model.safetensors").write_bytes(bytes(range(256)) * 16)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def one_line_failure(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    lines = said_beyond_progress(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.mark.parametrize(("argv", "code", "fragments"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_is_one_line_and_nothing_written(workspace, capsys, argv, code, fragments):
    argv = [arg.replace("{tmp}", str(workspace)) for arg in argv]
    before = snapshot(workspace)
    exit_code, line = one_line_failure(argv, capsys)
    command = " ".join(argv[:2] if argv[:1] == ["data"] else argv[:1])
    assert exit_code == code, line
    assert line.startswith(f"ntl-pretrain {command}:" if command in COMMANDS else "ntl-pretrain:"), line
    for fragment in fragments:
        assert fragment.replace("{tmp}", str(workspace)) in line, line
    assert snapshot(workspace) == before


def test_the_top_level_usage_lists_every_command(capsys):
    code, line = one_line_failure(["train.max_steps=3"], capsys)
    assert code == 2
    for command in (*cli.OWN_COMMANDS, *cli.DELEGATED_COMMANDS):
        assert f"'{command}'" in line, line
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    usage = capsys.readouterr().out
    every = ",".join((*cli.OWN_COMMANDS, *cli.DELEGATED_COMMANDS))
    assert every in cli.build_parser([]).format_usage() and "train" in usage


def test_an_unexpected_failure_is_one_line_naming_its_traceback_log(capsys):
    def crash():
        raise RuntimeError("the\nworld  ended")

    assert errors.run_reporting("plot", crash) == 1
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("ntl-pretrain plot: failed: RuntimeError: the world ended")
    log = Path(line.split("traceback in ", 1)[1].split(";", 1)[0])
    assert "Traceback" in log.read_text() and "in crash" in log.read_text()
    log.unlink()
    assert errors.run_reporting("plot", crash, verbose=True) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith("(traceback above)")


def test_verbose_prints_the_traceback_of_bad_input_too(workspace, capsys):
    for argv in (["--verbose", "verify", str(workspace / "nope")], ["verify", str(workspace / "nope"), "--verbose"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("ntl-pretrain verify:")


@pytest.mark.parametrize(
    ("module_argv", "fragments"),
    [
        (["ntl_pretrain.cli", "eval", "{tmp}/nope"], ["ntl-pretrain eval:", "neither an HF model folder"]),
        (["ntl_pretrain.evaluation", "{tmp}/hf", "--seq-len", "0"], ["ntl-pretrain eval:", "--seq-len"]),
        (["ntl_pretrain.plot", "{tmp}/bad-run", "-o", "{tmp}/p.png"], ["ntl-pretrain plot:", "line 2"]),
    ],
    ids=["cli", "evaluation-module", "plot-module"],
)
def test_a_fresh_interpreter_refuses_in_one_line(workspace, module_argv, fragments):
    """The real entry points, as a user or a launcher starts them: one line, after the progress lines that a slow
    import brings (every 3 s; none when it takes less)."""
    argv = [arg.replace("{tmp}", str(workspace)) for arg in module_argv]
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
    lines = said_beyond_progress(done.stderr)
    assert done.returncode == 2 and done.stdout == "" and len(lines) == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == lines[0], done.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def test_eval_new_tokens_must_leave_room_for_a_prompt():
    """`--max-new-tokens` against the folder's positions (the workspace's folders name no position limit)."""
    from ntl_pretrain.evaluation.model_folder import check_seq_len

    check_seq_len({"max_position_embeddings": 64}, None, 63)  # a one-token prompt fits
    with pytest.raises(errors.InputError, match="--max-new-tokens: 64 new tokens leave no room for a prompt"):
        check_seq_len({"max_position_embeddings": 64}, None, 64)
