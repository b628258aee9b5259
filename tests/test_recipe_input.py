"""What `ntl-pretrain train` accepts as a recipe path, and how it names what is wrong in one (issue 50): a pipe no
program writes to is refused in seconds (an open waited forever), a process substitution `<(...)` is read once and
handed to the ranks as a file, and so is a recipe on stdin (`train -`, issue 71), a YAML error names the file and
line (not PyYAML's "<unicode string>"), and a bad field name given as an override is blamed on the override and the
key it set."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest
import yaml
from helpers.launches import TINY

from ntl_pretrain import cli
from ntl_pretrain.config import loading
from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.runtime import supervisor


def test_a_pipe_nobody_writes_to_and_a_folder_are_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "recipe.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(RecipeError, match=r"recipe\.fifo: a pipe that no program writes to \(waited 0\.2 s\)"):
        load_recipe(fifo)
    assert time.monotonic() - started < 5
    with pytest.raises(RecipeError, match=rf"{tmp_path}: a folder; name a recipe file"):
        load_recipe(tmp_path)


def process_substitution(text: str) -> str:
    """`/dev/fd/N` of a pipe a thread writes `text` into, as bash's `<(...)` gives a command."""
    read_end, write_end = os.pipe()

    def write() -> None:
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(text)

    threading.Thread(target=write, daemon=True).start()
    return f"/dev/fd/{read_end}"


def test_process_substitution_is_read_once_and_the_ranks_get_it_as_a_file(tmp_path, monkeypatch, capsys):
    handed = []

    def launched(command, *args, **kwargs) -> int:
        recipe = command[command.index("ntl_pretrain.train") + 1]
        handed.append((recipe, load_recipe(recipe), command))
        return 0

    monkeypatch.setattr(supervisor, "supervise", launched)
    output_dir = tmp_path / "run"
    piped = process_substitution(TINY.read_text())  # read by the check before torch, then with the DeepSpeed config
    assert cli.main(["train", piped, "--nproc", "1", f"train.output_dir={output_dir}", "train.max_steps=3"]) == 0
    ((recipe_file, recipe, command),) = handed
    assert recipe == load_run(TINY, [f"train.output_dir={output_dir}", "train.max_steps=3"], world_size=1)[0]
    assert command[-1] == recipe_file and not os.path.exists(recipe_file)  # overrides applied; removed after
    assert f"training {piped} into {output_dir}" in capsys.readouterr().err


def test_a_yaml_error_names_the_file_and_line(tmp_path):
    recipe = tmp_path / "indented.yaml"
    recipe.write_text("seed: 0\ntrain:\n  max_steps: 5\n micro_batch_size: 2\n")
    with pytest.raises(RecipeError) as refused:
        load_recipe(recipe)
    message = str(refused.value)
    assert message.startswith(f"{recipe}: invalid YAML at line 4, column 2: ") and "<unicode string>" not in message
    with pytest.raises(RecipeError, match=r"override: data.sources: value '\[\{' is not valid YAML at line 1"):
        load_recipe(TINY, ["data.sources=[{"])


def test_a_field_name_given_as_an_override_is_blamed_on_the_override(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text('{"content": "1 plus 1 is 2"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(TINY), "data": {"sources": [{"path": str(data)}]}}))
    with pytest.raises(RecipeError, match=rf"^{recipe}: data\.sources\.0\.text_field: .* the records have fields"):
        load_recipe(recipe)  # the file set the path and left text_field at its default
    with pytest.raises(RecipeError, match=r"^command-line override: data\.sources\.0\.text_field: .*fields 'body'"):
        load_recipe(recipe, ["data.sources.0.text_field=body"])
    assert load_recipe(recipe, ["data.sources.0.text_field=content"]).data.sources[0].text_field == "content"


class Stdin:
    """`sys.stdin` as the shell gives it: a pipe or a redirected file (its bytes), or a terminal."""

    def __init__(self, data: bytes, terminal: bool = False):
        self.buffer, self.terminal = io.BytesIO(data), terminal

    def isatty(self) -> bool:
        return self.terminal


def test_a_recipe_on_stdin_is_read_once_as_a_piped_one(tmp_path, monkeypatch, capsys):
    """`train -` (issue 71: it was refused, "cannot read recipe .../-"): the recipe's relative `base:` is the working
    directory's, as for `<(...)`, and the ranks get it resolved, overrides applied, from a file."""
    handed = []
    monkeypatch.setattr(supervisor, "supervise", lambda command, *a, **k: handed.append(load_recipe(command[-1])) or 0)
    monkeypatch.setattr(loading, "_PIPED", {})
    monkeypatch.chdir(TINY.parent)
    monkeypatch.setattr("sys.stdin", Stdin(f"base: {TINY.name}\ntrain: {{max_steps: 3}}\n".encode()))
    output_dir = tmp_path / "run"
    assert cli.main(["train", "-", "--nproc", "1", f"train.output_dir={output_dir}"]) == 0
    assert handed == [load_run(TINY, [f"train.output_dir={output_dir}", "train.max_steps=3"], world_size=1)[0]]
    assert f"training /dev/stdin into {output_dir}" in capsys.readouterr().err


def test_a_terminal_on_stdin_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", Stdin(b"", terminal=True))
    assert cli.main(["train", "-", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "ntl-pretrain train: recipe error: -: stdin is a terminal, not a recipe; pipe one in "
        "(cat my.yaml | ntl-pretrain train -) or name the recipe file\n"
    )
