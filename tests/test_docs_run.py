"""The commands and YAML blocks in README.md, docs/*.md and docs/archive/*.md are the ones the code takes (issue 42:
docs that run).

- Every `ntl-pretrain ...` command line in a code block parses with the CLI's own parser (the command, its options
  and their values); a `train` command's recipe and overrides also load and validate, with the user's files that a
  walk-through names (`my_numbers.jsonl`) stood in for by one-record files.
- Every YAML block parses; one that is a recipe fragment (its top level recipe sections, or a `sources:` list)
  validates on top of the tiny recipe. The lm-evaluation-harness task block runs in tests/test_lm_eval.py.
Output samples (`ntl-pretrain: ...`, `ntl-pretrain train: recipe error ...`) and lines with a placeholder
(`[key.path=value ...]`, `step_N`) are illustrative and only read. The run-time behaviour of each command is tested
where the command is (test_cli_*, test_train_*, test_study ...).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.docs import doc_pages

from ntl_pretrain import cli
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import Recipe

REPO = Path(__file__).resolve().parents[1]
DOCS = doc_pages()
BLOCK = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)  # indented too: a block inside a list item
# What marks a line as a pattern, not a command: `[key.path=value ...]`, `[--option]`, `step_N`, `<folder>`, and the
# upper-case names the docs give arguments (RUN_DIR, RECIPE, N ...).
PLACEHOLDERS = re.compile(
    r"\[key\.path=value|step_N\b|<[a-z_ ]+>|\.\.\.|\[--"
    r"|\b(?:RUN_DIR|OUT\.png|CKPT|DIR|GGUF|HF|PATH|FILE|RECIPE|N|WORLD_SIZE)\b"
)
INLINE = re.compile(r"`(ntl-pretrain [^`]+)`")
RECIPE_SECTIONS = {field.name for field in Recipe.__dataclass_fields__.values()}


def code_blocks() -> list[tuple[str, str, str]]:
    """(where, language, text) of every fenced block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{doc.relative_to(REPO)}:{line}", match[1], match[2]))
    return found


def expand_seq(text: str) -> str:
    """`$(seq A B)` as the shell expands it (study commands list their seeds that way)."""
    return re.sub(r"\$\(seq (\d+) (\d+)\)", lambda m: " ".join(map(str, range(int(m[1]), int(m[2]) + 1))), text)


def inline_commands() -> list[tuple[str, str]]:
    """(where, text) of every `ntl-pretrain ...` code span in the prose."""
    found = []
    for doc in DOCS:
        text = BLOCK.sub("", doc.read_text())
        for match in INLINE.finditer(text):
            words = match[1].split()
            # `ntl-pretrain eval` or `ntl-pretrain eval --qa` name a command or an option; a command has its target
            if len(words) > 2 and not words[2].startswith("-"):
                found.append((f"{doc.relative_to(REPO)} (inline)", match[1]))
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `ntl-pretrain`) of every command line in a block or a code span; continuation lines
    joined, comments dropped."""
    found = []
    lines = [(where, line) for where, _, text in code_blocks() for line in text.replace("\\\n", " ").splitlines()]
    for where, line in [*lines, *inline_commands()]:
        command = line.strip().removeprefix("$ ")
        if "ntl-pretrain " not in command or command.startswith("ntl-pretrain:") or PLACEHOLDERS.search(command):
            continue
        words = shlex.split(expand_seq(command), comments=True)
        for start in [i for i, word in enumerate(words) if word == "ntl-pretrain"]:  # `a && ntl-pretrain ...`
            argv = words[start + 1 :]
            end = next((i for i, word in enumerate(argv) if word in ("&&", "||", ";", "|")), len(argv))
            if argv[:end] and not argv[0].endswith(":"):  # `ntl-pretrain train: recipe error ...`: an output line
                found.append((where, argv[:end]))
    return found


COMMANDS = documented_commands()


def test_the_docs_hold_the_commands_a_newcomer_pastes():
    named = {argv[0] for _, argv in COMMANDS}
    assert {"train", "eval", "export", "convert-gguf", "study", "doctor"} <= named, named
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[f"{w}:{a[0]}" for w, a in COMMANDS])
def test_every_documented_command_parses_and_its_recipe_loads(where, argv, tmp_path, monkeypatch):
    parser = cli.build_parser(cli._delegated_to_register(argv))
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as refused:
        pytest.fail(f"{where}: `ntl-pretrain {shlex.join(argv)}` does not parse (exit {refused.code})")
    if args.command != "train":
        assert not extra, f"{where}: unknown arguments {extra}"
        return
    recipe = REPO / args.recipe
    assert recipe.is_file(), f"{where}: no recipe {args.recipe}"
    monkeypatch.chdir(tmp_path)  # the user's own files of a walk-through, as one-record stand-ins
    for override in [*args.overrides, *extra]:
        for path in re.findall(r"path: ([\w./-]+\.jsonl)", override):
            Path(path).write_text(json.dumps({"text": "1 + 1 = 2"}) + "\n")
    load_recipe(recipe, [*args.overrides, *extra])


def stand_in(folder: Path, path: str, text_field: str) -> Path:
    """A one-record file of the documented file's kind (`/data/web/*.parquet` -> `folder/part-0.parquet`)."""
    name = Path(path.replace("*", "part-0")).name
    record = {text_field: "1 + 1 = 2", "question": "1+1=", "answer": "2"}
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: [value] for key, value in record.items()}), folder / name)
    else:
        (folder / name).write_text(json.dumps(record) + "\n")
    return folder / name


YAML_BLOCKS = [(where, text) for where, language, text in code_blocks() if language == "yaml"]


@pytest.mark.parametrize(("where", "text"), YAML_BLOCKS, ids=[where for where, _ in YAML_BLOCKS])
def test_every_documented_yaml_block_parses_and_a_recipe_fragment_validates(where, text, tmp_path):
    block = yaml.safe_load(text)
    assert isinstance(block, dict), f"{where}: not a mapping"
    if "task" in block:  # lm-evaluation-harness's task file: run as written by tests/test_lm_eval.py
        return
    fragment = {"data": block} if set(block) == {"sources"} else block
    assert set(fragment) <= RECIPE_SECTIONS, f"{where}: {sorted(set(fragment) - RECIPE_SECTIONS)} are no recipe keys"
    for source in fragment.get("data", {}).get("sources", []):  # a user's own files, as one-record stand-ins
        if not source["path"].startswith("pkg:") and source.get("format") != "hub":
            source["path"] = str(stand_in(tmp_path, source["path"], source.get("text_field", "text")))
    base = "smollm2-135m-cpt.yaml" if "init_from" in fragment else "tiny-cpu.yaml"  # a pretrained model's, or not
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(REPO / "recipes" / base), **fragment}))
    load_recipe(recipe)


# Walk-throughs: command sequences a newcomer runs in order from the checkout's root, each step finding what the
# one before left (issue 59: the SmolLM2 walk-through's step 2 looked for step 1's folder beside the recipe).
# name: (file, heading, how each `train` starts): the first bash block after the heading of a doc, or with no
# heading the `#   ntl-pretrain ...` lines of a recipe's header.
SMOLLM2_START = "starts from the weights of init_from {checkout}/runs/smollm2-135m-hf and trains 200 steps"
SMOLLM2_CPU_START = SMOLLM2_START.replace("200 steps", "60 steps")
WALK_THROUGHS = {
    "docs/continued-pretraining.md, SmolLM2 on a CPU": ("docs/continued-pretraining.md", "## On a CPU in minutes",
                                                         SMOLLM2_CPU_START),
    "docs/continued-pretraining.md, SmolLM2 walk-through": ("docs/continued-pretraining.md",
                                                            "## Walk-through: continued pretraining of SmolLM2",
                                                            SMOLLM2_CPU_START),
    "recipes/smollm2-135m-cpt.yaml, header": ("recipes/smollm2-135m-cpt.yaml", None, SMOLLM2_START),
    "recipes/smollm2-135m-cpt-cpu.yaml, header": ("recipes/smollm2-135m-cpt-cpu.yaml", None, SMOLLM2_CPU_START),
    "recipes/tiny-cpu.yaml, header": ("recipes/tiny-cpu.yaml", None, "starts from scratch and trains 300 steps"),
}  # fmt: skip
USER_RECORDS = [{"text": f"{n} plus {n + 1} is {2 * n + 1}"} for n in range(8)]  # the walk-through's own files


def walk_through_commands(doc: str, heading: str | None) -> list[list[str]]:
    """argv after `ntl-pretrain` of each command, in order: the first bash block after `heading`, or the recipe's
    commented header lines (from `ntl-pretrain` on); continuation lines joined, comments and other programs dropped."""
    text = (REPO / doc).read_text()
    if heading is None:
        header = [line for line in text.split("\n\n")[0].splitlines() if "ntl-pretrain " in line]
        text = "\n".join(line[line.index("ntl-pretrain ") :] for line in header)
    else:
        text = next(match[2] for match in BLOCK.finditer(text, text.index(heading)) if match[1] == "bash")
    commands = [shlex.split(line, comments=True) for line in text.replace("\\\n", " ").splitlines()]
    return [words[1:] for words in commands if words[:1] == ["ntl-pretrain"]]


def stand_in_for_convert_gguf(out_dir: Path) -> None:
    """What `convert-gguf` writes (an HF folder: config, weights, tokenizer), as a tiny Llama: the conversion
    itself takes minutes on a CPU (tests/test_export_gguf.py runs it)."""
    from helpers.tiny_models import tiny_model

    from ntl_pretrain.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@pytest.mark.parametrize("walk_through", WALK_THROUGHS)
def test_each_walk_through_runs_in_order_from_the_checkout_root(walk_through, tmp_path, monkeypatch, capsys):
    """Every step as written, from a copy of the checkout's recipes: `convert-gguf` by a stand-in of its output,
    `train` as its `--dry-run` (a launch trains for minutes to hours); `export`, `eval` and `plot` of what only a real
    run writes are left out.
    Each `train` must pass every check and say where it starts: from step 1's folder."""
    from ntl_pretrain.runtime import supervisor

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "recipes", checkout / "recipes")
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(supervisor, "supervise", lambda *args, **kwargs: pytest.fail("a walk-through step launched"))
    for name in ("my_numbers.jsonl", "my_numbers_val.jsonl"):
        Path(name).write_text("".join(json.dumps(record) + "\n" for record in USER_RECORDS))
    doc, heading, start = WALK_THROUGHS[walk_through]
    ran = []
    for argv in walk_through_commands(doc, heading):
        if argv[0] == "convert-gguf":
            stand_in_for_convert_gguf(Path(argv[2]))
        elif argv[0] == "train":
            code = cli.main([*argv, *([] if "--dry-run" in argv else ["--dry-run"])])
            out, err = capsys.readouterr()
            assert code == 0, f"{walk_through}: `ntl-pretrain {shlex.join(argv)}`: {err}"
            plan = out.rstrip("\n").splitlines()[-2]
            assert plan.endswith(start.format(checkout=checkout)), plan
        else:  # a step only a real run saves (`step_N`), or a run's results read by `eval` and `plot`
            assert (argv[0] == "export" and "step_N" in argv[1]) or argv[0] in ("eval", "plot"), argv
            continue
        ran.append(argv[0])
    assert "train" in ran, ran
