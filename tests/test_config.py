"""Recipe schema: YAML + `base:` + dot-list overrides, type checks, contradictions, DeepSpeed config derivation."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml
from helpers.docs import doc_pages

from ntl_pretrain import cli
from ntl_pretrain.config.deepspeed import build_deepspeed_config, grad_accum_steps, load_run
from ntl_pretrain.config.loading import dump_recipe, load_recipe
from ntl_pretrain.config.recipe import Recipe, RecipeError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
ALL_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("recipe_path", ALL_RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_load_and_round_trip(recipe_path, tmp_path):
    """Every shipped recipe validates, and its dump (what a run directory holds) reloads to an equal recipe."""
    recipe = load_recipe(recipe_path)
    world_size = 8 if recipe.train.precision == "bf16" else 2  # GPU recipes are sized for a node of 8
    assert build_deepspeed_config(recipe, world_size)["zero_optimization"]["stage"] == 3
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_recipe(recipe))
    assert load_recipe(dumped) == recipe


def test_base_inheritance_merges_sections_and_anchors_paths(tmp_path):
    child = write(tmp_path / "child.yaml", {"base": str(TINY), "loss": {"ntl": {"weight": 0.7}}, "seed": 3})
    recipe, base = load_recipe(child), load_recipe(TINY)
    assert recipe.loss.ntl.weight == 0.7 and recipe.seed == 3
    assert recipe.loss.ntl.kind == base.loss.ntl.kind  # sibling keys of a merged section survive
    assert recipe.model == base.model and recipe.data == base.data
    assert recipe.deepspeed.config == "pkg:ntl_pretrain/config/zero3.json"


def test_every_path_in_a_recipe_file_is_relative_to_its_folder_and_an_overrides_to_the_working_directory(
    tmp_path, monkeypatch
):
    """One rule (issue 59): a recipe copied elsewhere, with its files beside it, means the same run from any folder
    (issue 50: the default `../configs/zero3.json` resolved only from inside recipes/; issue 59: `output_dir` and
    `init_from` were read from two different folders, so a walk-through's step 2 missed step 1's folder); `base:`
    anchors each file's paths to its own folder; paths in overrides are the working directory's, as any argument's.
    Every path comes out absolute, as the dry run prints it."""
    shared, mine, elsewhere = tmp_path / "shared", tmp_path / "mine", tmp_path / "elsewhere"
    for folder in (shared, mine, elsewhere, tmp_path / "runs" / "old"):
        folder.mkdir(parents=True)
    (shared / "sums.jsonl").write_text('{"text": "1 plus 1 is 2"}\n')
    for folder in (mine, elsewhere):
        (folder / "held_out.jsonl").write_text('{"text": "2 plus 2 is 4"}\n')
    (mine / "ds.json").write_text((REPO / "configs" / "zero3.json").read_text())
    write(shared / "base.yaml", {**yaml.safe_load(TINY.read_text()), "data": {"sources": [{"path": "sums.jsonl"}]}})
    child = write(mine / "run.yaml", {"base": "../shared/base.yaml", "deepspeed": {"config": "ds.json"},
                                      "data": {"validation": [{"path": "held_out.jsonl"}]},
                                      "init_from": "../models/hf", "model": {"model_type": None},
                                      "train": {"resume": "../runs/old"}})  # fmt: skip
    monkeypatch.chdir(elsewhere)
    recipe, ds_config = load_run(child, [], world_size=1)
    assert recipe.data.sources[0].path == str(shared / "sums.jsonl")
    assert recipe.data.validation[0].path == str(mine / "held_out.jsonl")
    assert recipe.deepspeed.config == str(mine / "ds.json") and ds_config["zero_optimization"]["stage"] == 3
    assert recipe.train.output_dir == str(tmp_path / "runs" / "tiny-cpu")  # `../runs/tiny-cpu` of shared/base.yaml
    assert (recipe.init_from, recipe.train.resume) == (str(tmp_path / "models" / "hf"), str(tmp_path / "runs" / "old"))
    overridden = load_recipe(child, ["data.validation=[{path: held_out.jsonl}]", "train.output_dir=runs/x",
                                     "train.resume=auto"])  # fmt: skip
    assert overridden.data.validation[0].path == str(elsewhere / "held_out.jsonl")
    assert (overridden.train.output_dir, overridden.train.resume) == (str(elsewhere / "runs" / "x"), "auto")
    copied = elsewhere / "tiny-copy.yaml"
    copied.write_text(TINY.read_text())
    recipe = load_run(copied, [], world_size=2)[0]
    assert recipe.deepspeed.config == "pkg:ntl_pretrain/config/zero3.json"
    assert recipe.train.output_dir == str(tmp_path / "runs" / "tiny-cpu")
    unnamed = write(mine / "unnamed.yaml", {"base": str(TINY), "train": {"max_steps": 3}})
    assert load_recipe(unnamed).train.output_dir == str(REPO / "runs" / "tiny-cpu")  # as the base file wrote it
    assert load_recipe(write(mine / "bare.yaml", {"data": yaml.safe_load(TINY.read_text())["data"]})).train.output_dir \
        == str(mine / "runs" / "default")  # fmt: skip


def test_an_output_dir_whose_old_reading_holds_a_run_is_refused_naming_both_folders(tmp_path, monkeypatch):
    """Before issue 59 a recipe's relative `train.output_dir` was the working directory's: where that folder holds a
    run and the recipe's folder does not, the same command would start afresh beside the recipe. It is refused until
    the recipe says which folder it means (an override, being the working directory's, means the old one)."""
    project, recipes = tmp_path / "project", tmp_path / "project" / "recipes"
    recipes.mkdir(parents=True)
    recipe = write(recipes / "mine.yaml", {"base": str(TINY), "train": {"output_dir": "runs/mine"}})
    (project / "runs" / "mine" / "checkpoints" / "step_2").mkdir(parents=True)
    monkeypatch.chdir(project)
    with pytest.raises(RecipeError) as refused:
        load_recipe(recipe)
    assert str(refused.value) == (
        f"{recipe}: train.output_dir: runs/mine is {recipes / 'runs' / 'mine'} (paths in a recipe are relative to its "
        f"folder), not the run in {project / 'runs' / 'mine'}; write {project / 'runs' / 'mine'} to continue that run, "
        f"or {recipes / 'runs' / 'mine'} to start this one there"
    )
    assert load_recipe(recipe, ["train.output_dir=runs/mine"]).train.output_dir == str(project / "runs" / "mine")
    monkeypatch.chdir(recipes)  # both readings are one folder
    assert load_recipe(recipe).train.output_dir == str(recipes / "runs" / "mine")
    monkeypatch.chdir(project)
    (recipes / "runs" / "mine").mkdir(parents=True)
    (recipes / "runs" / "mine" / "metrics.jsonl").write_text("")  # the recipe's own folder holds a run: that one
    assert load_recipe(recipe).train.output_dir == str(recipes / "runs" / "mine")


def test_overrides_parse_as_yaml_and_apply_last(tmp_path):
    recipe = load_recipe(TINY, ["loss.ntl.weight=0.5", "loss.ntl.kind=null", "optimizer.lr=1e-4",
                                "model.config.hidden_size=32", "train.resume=null"])  # fmt: skip
    assert recipe.loss.ntl.weight == 0.5 and recipe.loss.ntl.kind is None
    assert recipe.optimizer.lr == pytest.approx(1e-4)  # YAML reads 1e-4 as a string; the float field takes it
    assert recipe.model.config["hidden_size"] == 32 and recipe.model.config["num_hidden_layers"] == 2


GPU_RECIPES = [path for path in ALL_RECIPES if "device: cuda" in path.read_text()]
RANKS = re.compile(r"^# Ranks: 1 to ([\d,]+) GPUs as written", re.M)
AT_GPUS = re.compile(r"at (\d+) GPUs(?: add)?\s+(train\.micro_batch_size=\d+)")


@pytest.mark.parametrize("recipe_path", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipes_scale_to_the_ranks_their_header_names(recipe_path):
    """Each GPU recipe's header says up to how many GPUs its own batch arithmetic goes, and what to override beyond
    (issue 41: 64 ranks); both hold: every power of two up to it is accepted, twice it is refused, the overrides
    make the named world sizes fit."""
    header = "".join(line for line in recipe_path.read_text().splitlines(keepends=True) if line.startswith("#"))
    found = RANKS.search(header)
    assert found, f"{recipe_path.name}: no '# Ranks: 1 to N GPUs as written' line"
    largest = int(found[1].replace(",", ""))
    recipe = load_recipe(recipe_path)
    for world in (2**k for k in range(largest.bit_length())):
        assert grad_accum_steps(recipe, world) == recipe.train.global_batch_tokens // recipe.data.seq_len // (
            recipe.train.micro_batch_size * world)  # fmt: skip
    with pytest.raises(RecipeError, match="not a multiple of train.micro_batch_size"):
        grad_accum_steps(recipe, 2 * largest)
    for world, override in AT_GPUS.findall(header.replace("\n# ", " ")):
        assert grad_accum_steps(load_recipe(recipe_path, [override]), int(world)) >= 1, (world, override)


@pytest.mark.parametrize(
    ("in_base", "in_child", "overrides", "origin", "key"),
    [
        ({"optimizer": {"lrr": 1.0}}, {}, [], "base.yaml", "optimizer.lrr: unknown key"),
        ({}, {"train": {"max_steps": "ten"}}, [], "child.yaml", "train.max_steps: expected int"),
        ({}, {"train": {"precision": "fp16"}}, [], "child.yaml", "train.precision: expected one of"),
        ({}, {}, ["loss.ntl.kind=cosine"], "command-line override", "loss.ntl.kind: expected"),
        ({}, {"train": {"overwrite": True}}, [], "child.yaml", "train.overwrite: only with resume: null"),
        ({}, {"optimizer": {"betas": [0.9]}}, [], "child.yaml", "optimizer.betas: need two values"),
        (
            {},
            {"train": {"global_batch_size": None, "global_batch_tokens": 100}},
            [],
            "child.yaml",
            "100 is not a multiple",
        ),
        ({}, {"train": {"global_batch_tokens": 4096}}, [], "child.yaml", "train.global_batch_tokens: set either"),
        ({}, {"data": {"sources": []}}, [], "child.yaml", "data.sources: at least one"),
        ({}, {"checkpoint": {"keep_last": 0}}, [], "child.yaml", "checkpoint.keep_last: must be >= 1"),
    ],
)
def test_bad_recipes_name_the_key_and_the_file(tmp_path, in_base, in_child, overrides, origin, key):
    base_data = yaml.safe_load(TINY.read_text())
    for section, values in in_base.items():
        base_data.setdefault(section, {}).update(values)
    write(tmp_path / "base.yaml", base_data)
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", "train": {"resume": None}, **in_child})
    with pytest.raises(RecipeError) as error:
        load_recipe(child, overrides)
    message = str(error.value)
    assert key in message
    assert message.startswith(str(tmp_path / origin) if origin.endswith(".yaml") else origin)


def literal_keys(cls: type, instance: object, prefix: str = ""):
    """(dotted key, allowed values, whether null is allowed, whether a bool is too) of every Literal field below
    `cls`, following sections and the first item of the recipe's lists of sections (`data.sources.0.format`)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint, value, key = hints[field.name], getattr(instance, field.name), prefix + field.name
        item_hint = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(hint):
            yield from literal_keys(hint, value, key + ".")
        elif dataclasses.is_dataclass(item_hint) and value:
            yield from literal_keys(item_hint, value[0], key + ".0.")
        else:
            members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            literals = [member for member in (hint, *members) if typing.get_origin(member) is Literal]
            if literals:
                yield key, typing.get_args(literals[0]), type(None) in typing.get_args(hint), bool in members


def test_every_choice_key_names_its_allowed_values():
    found = {}
    for key, allowed, nullable, or_bool in literal_keys(Recipe, load_recipe(TINY)):
        with pytest.raises(RecipeError) as error:
            load_recipe(TINY, [f"{key}=zzz"])
        listed = ", ".join(repr(value) for value in allowed) + (" (or null)" if nullable else "")
        found[key] = str(error.value)
        expected = ("bool or " if or_bool else "") + f"one of {listed}"
        assert str(error.value) == f"command-line override: {key}: expected {expected}, got 'zzz'"
    assert {"loss.ntl.kind", "loss.head", "model.attention", "schedule.kind", "train.device", "train.precision",
            "checkpoint.verify", "data.sources.0.format", "data.sources.0.sample_by"} <= set(found)  # fmt: skip


def whole_number_keys(cls: type, instance: object, prefix: str = ""):
    """(dotted key, whether it is a list of them) of every field below `cls` whose values are whole numbers: `int`,
    `int | None`, a Literal of ints (`deepspeed.zero_stage`), `list[int]`; following sections and the first item
    of the recipe's lists of sections."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint, value, key = hints[field.name], getattr(instance, field.name), prefix + field.name
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
        item_hint = typing.get_args(members[0])[0] if typing.get_origin(members[0]) is list else None
        if dataclasses.is_dataclass(hint):
            yield from whole_number_keys(hint, value, key + ".")
        elif dataclasses.is_dataclass(item_hint) and value:
            yield from whole_number_keys(item_hint, value[0], key + ".0.")
        elif item_hint is int:
            yield key, True
        elif members == [int] or (typing.get_origin(members[0]) is Literal and all(
                type(arg) is int for arg in typing.get_args(members[0]))):  # fmt: skip
            yield key, False


def test_every_whole_number_key_refuses_a_boolean_and_a_float():
    """`deepspeed.zero_stage: true` trained at stage 1 and `2.0` at 2 (pydantic's Literal check compares with ==):
    every key whose value is a whole number refuses both, naming the key."""
    found = []
    for key, listed in whole_number_keys(Recipe, load_recipe(TINY)):
        for value in ("true", "2.0"):
            with pytest.raises(RecipeError) as error:
                load_recipe(TINY, [f"{key}=[{value}, 2]" if listed else f"{key}={value}"])
            got = True if value == "true" else 2.0
            assert str(error.value).startswith(f"command-line override: {key}: expected "), str(error.value)
            assert str(error.value).endswith(f"got {[got, 2] if listed else got}"), str(error.value)
        found.append(key)
    assert {"deepspeed.zero_stage", "train.max_steps", "seed", "logging.profile_steps", "eval.max_validation_batches",
            "data.seq_len", "loss.vocab_parallel_size"} <= set(found) and len(found) > 30, found  # fmt: skip


def test_a_whole_number_key_of_the_model_config_refuses_a_boolean_and_a_float():
    """transformers refuses them too, but after our head-count check read `hidden_size: true` as 1, and in a
    message of Python type names."""
    from ntl_pretrain.preflight.world import model_config

    for override, said in (("hidden_size=true", "got True"), ("num_hidden_layers=2.0", "got 2.0"),
                           ("head_dim=16.0", "got 16.0")):  # fmt: skip
        with pytest.raises(RecipeError) as error:
            model_config(load_recipe(TINY, [f"model.config.{override}"]))
        key = override.split("=")[0]
        assert str(error.value) == f"model.config.{key}: expected int (LlamaConfig's {key} is a whole number), {said}"
    assert model_config(load_recipe(TINY, ["model.config.head_dim=16", "model.config.attention_dropout=0.0"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "loss.ntl.kind=wass",
            "loss.ntl.kind: expected one of 'was', 'mse', 'mae', 'huber', 'digits', 'number' (or null), got 'wass' "
            "(did you mean 'was'?)",
        ),
        ("loss.head=Dense", "loss.head: expected one of 'chunked', 'dense', got 'Dense' (did you mean 'dense'?)"),
        (
            "data.sources.1.format=jsnol",
            "data.sources.1.format: expected one of 'auto', 'jsonl', 'json', 'parquet', 'txt', 'arrow', 'hub', "
            "got 'jsnol' (did you mean 'jsonl'?)",
        ),
        # Nothing is suggested where no choice is an obvious misspelling: gpu is not cpu.
        ("train.device=gpu", "train.device: expected one of 'auto', 'cuda', 'cpu', got 'gpu'"),
        # null is suggested only where null is allowed.
        ("schedule.kind=None", "schedule.kind: expected one of 'cosine', 'wsd', 'constant', got 'None'"),
        ("loss.ntl.kind=None", "(or null), got 'None' (write null, not None)"),
    ],
)
def test_a_wrong_choice_suggests_the_one_it_misspells(override, message):
    with pytest.raises(RecipeError) as error:
        load_recipe(TINY, [override])
    assert str(error.value).endswith(message)


def test_base_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("overrides", "world_size", "expected"),
    [
        ([], 2, 1),  # tiny-cpu: 16 sequences = 8 per rank x 2 ranks
        (["train.micro_batch_size=2"], 2, 4),
        (["train.micro_batch_size=2"], 1, 8),
        (["train.global_batch_size=null", "train.global_batch_tokens=4096"], 2, 2),  # 4096 / 128 = 32 sequences
        (["train.global_batch_size=null"], 4, 1),
    ],
)
def test_gradient_accumulation_is_derived_from_the_global_batch(overrides, world_size, expected):
    recipe = load_recipe(TINY, overrides)
    assert grad_accum_steps(recipe, world_size) == expected
    config = build_deepspeed_config(recipe, world_size)
    assert config["gradient_accumulation_steps"] == expected
    assert config["train_batch_size"] == recipe.train.micro_batch_size * expected * world_size
    assert config["bf16"] == {"enabled": recipe.train.precision == "bf16"}


@pytest.mark.parametrize("where", ["base.yaml", "child.yaml", "command-line override"])
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"deepspeed": {"config": "{tmp}/syntax.json"}}, "deepspeed.config: cannot read {tmp}/syntax.json"),
        ({"deepspeed": {"config": "{tmp}/zero-int.json"}}, "deepspeed.config: {tmp}/zero-int.json: zero_optimization:"),
        ({"deepspeed": {"config": "{tmp}/stage-0.json"}}, "deepspeed.config: {tmp}/stage-0.json: zero_optimization.st"),
        ({"train": {"compile": True}}, "train.compile: at ZeRO-3 the trainer compiles through DeepSpeed's DeepCompile"),
        ({"loss": {"vocab_parallel_size": 3}}, "loss.vocab_parallel_size: 3 does not divide the world size"),
        ({"train": {"global_batch_size": 6}}, "train.global_batch_size: 6 sequences per step is not a multiple"),
    ],
)
def test_a_refusal_of_the_deepspeed_config_names_where_the_value_came_from(tmp_path, where, setting, said):
    """The file that set the key, its `base:` file or the command line: a DeepSpeed JSON given on the command line
    was blamed on the recipe file (issue 60), and so was every key the DeepSpeed config is built from."""
    (tmp_path / "syntax.json").write_text("{")
    (tmp_path / "zero-int.json").write_text('{"zero_optimization": 5}')
    (tmp_path / "stage-0.json").write_text('{"zero_optimization": {"stage": 0}}')
    ((section, values),) = setting.items()
    ((key, value),) = values.items()
    value = value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value
    base = yaml.safe_load(TINY.read_text())
    if where == "base.yaml":
        base[section][key] = value
    write(tmp_path / "base.yaml", base)
    child = write(tmp_path / "child.yaml", {"base": "base.yaml", **({section: {key: value}} if where == "child.yaml"
                                                                     else {})})  # fmt: skip
    overrides = [f"{section}.{key}={json.dumps(value)}"] if where == "command-line override" else []
    with pytest.raises(RecipeError) as error:
        load_run(child, overrides, world_size=2)
    origin = str(tmp_path / where) if where.endswith(".yaml") else where
    assert str(error.value).startswith(f"{origin}: {said.replace('{tmp}', str(tmp_path))}"), str(error.value)


def test_indivisible_global_batch_fails_naming_the_recipe():
    indivisible = r"tiny-cpu.yaml: train.global_batch_size: 16 sequences .* world size \(3 ranks: --nproc per node"
    with pytest.raises(RecipeError, match=indivisible):
        load_run(TINY, [], world_size=3)


def test_deepspeed_json_may_not_own_recipe_keys(tmp_path):
    config = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(RecipeError, match="ds.json: train_micro_batch_size_per_gpu: set by the recipe"):
        load_run(TINY, [f"deepspeed.config={path}"], world_size=2)


@pytest.mark.parametrize("name", ["zero3.json", "zero3_offload.json"])
def test_shipped_deepspeed_configs_are_zero3(name):
    config = build_deepspeed_config(load_recipe(TINY, [f"deepspeed.config=pkg:ntl_pretrain/config/{name}"]), 2)
    assert config["zero_optimization"]["stage"] == 3


def test_cli_fails_fast_naming_key_and_source(capsys):
    code = cli.main(["train", str(TINY), "--nproc", "2", "loss.ntl.wieght=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "command-line override: loss.ntl.wieght: unknown key" in err


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("precision=bf16", "precision: unknown key (did you mean 'train.precision'?"),  # the section left out
        ("train.lr=1e-4", "train.lr: unknown key (did you mean 'optimizer.lr'?"),  # the wrong section
        ("train.precison=bf16", "train.precison: unknown key (did you mean 'precision'?"),  # a sibling first
    ],
)
def test_a_key_in_the_wrong_section_names_the_section_that_holds_it(override, suggestion):
    with pytest.raises(RecipeError) as error:
        load_recipe(TINY, [override])
    assert suggestion in str(error.value)


def test_a_key_no_section_holds_gets_no_suggestion():
    with pytest.raises(RecipeError) as error:
        load_recipe(TINY, ["learning_rate_please=1"])
    assert "did you mean" not in str(error.value)


def test_cli_dry_run_prints_the_resolved_recipe_and_launcher(tmp_path, capsys):
    argv = ["train", str(TINY), "--nproc", "2", "--dry-run", "train.max_steps=7", f"train.output_dir={tmp_path}"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    recipe_text, command = out.rsplit("# ", 1)
    assert yaml.safe_load(recipe_text)["train"]["max_steps"] == 7
    assert f"\n# {tmp_path}: starts from scratch and trains 7 steps\n# " in out
    assert "--num_gpus 2" in command and "--module ntl_pretrain.train" in command and "train.max_steps=7" in command


def test_the_dry_run_shows_the_launch_train_makes(tmp_path, monkeypatch, capsys):
    """Issue 71: the dry run showed a relative recipe path and `--num_gpus 2` without saying the ranks run on CPU.
    Its last line is now the launch itself, environment included, as the supervisor is handed it."""
    from ntl_pretrain.runtime import supervisor

    monkeypatch.chdir(REPO)
    launched = []
    monkeypatch.setattr(supervisor, "supervise", lambda command, env, *a, **k: launched.append((command, env)) or 0)
    argv = ["train", "recipes/tiny-cpu.yaml", "--nproc", "2", "--master-port", "29999", f"train.output_dir={tmp_path}"]
    assert cli.main([*argv, "--dry-run"]) == 0
    shown = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert cli.main(argv) == 0
    ((command, env),) = launched
    assert env["DS_ACCELERATOR"] == "cpu" and str(TINY) in command  # this machine has no GPU; the path is absolute
    assert shown == "# " + shlex.join(["DS_ACCELERATOR=cpu", *command])


def test_every_field_has_a_docstring():
    """The schema documents itself: a string literal under every field."""
    import ast
    import dataclasses
    import inspect

    from ntl_pretrain.config import recipe as config_module

    for cls in [c for c in vars(config_module).values() if dataclasses.is_dataclass(c)]:
        if cls.__module__ != config_module.__name__ or cls.__name__.startswith("_"):
            continue
        body = ast.parse(inspect.getsource(cls)).body[0].body
        documented = {
            node.target.id
            for node, following in zip(body, body[1:], strict=False)
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
        }
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def command_options(parser: argparse.ArgumentParser, command: tuple[str, ...] = ()):
    """(command words, long option or None for the command itself) for every command and subcommand of `parser`,
    leaving out options hidden from --help (the launcher's --local_rank)."""
    yield command, None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from command_options(subparser, (*command, name))
        elif action.help != argparse.SUPPRESS:
            yield from ((command, option) for option in action.option_strings if option.startswith("--"))


def test_every_command_and_option_is_documented(capsys):
    """The parser's commands are the documented ones, and the docs name each command's every option."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    parser = cli.build_parser()
    commands = {words[0] for words, _ in command_options(parser) if words}
    assert commands >= {"train", "export", "convert-gguf", "verify", "eval", "plot", "study", "data", "doctor"}
    assert all(command in usage for command in commands)
    docs = "\n".join(path.read_text() for path in doc_pages())
    undocumented = [
        " ".join(["ntl-pretrain", *words, *([option] if option else [])])
        for words, option in command_options(parser)
        if words and option != "--help" and ((option or f"ntl-pretrain {' '.join(words)}") not in docs)
    ]
    assert undocumented == [], "document these in README.md or docs/*.md"
