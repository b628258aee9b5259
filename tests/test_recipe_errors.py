"""Bad recipe inputs, one row each: `ntl-pretrain train` and `--dry-run` both exit 2 with one line that names the
key or file, no traceback, nothing launched and nothing written (an existing recipe.yaml in output_dir is kept).

Validation runs in-process through `cli.main`; the launcher call is replaced by a recorder, so a row that would
launch fails the test instead of starting ranks."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.launches import said_beyond_progress

from ntl_pretrain import cli
from ntl_pretrain.checkpoint import manifest
from ntl_pretrain.config.loading import dump_recipe, load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.runtime import supervisor

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
KEPT = "# a recipe.yaml from an earlier run\n"
CHILD = "base: {common}\n"


def alias_bomb(levels: int = 9) -> str:
    """ "Billion laughs" under an unknown key: 9 levels of 9 aliases, under 900 bytes, 9^9 strings once expanded."""
    lines = ["  l0: &l0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "unknown:\n" + "\n".join(lines) + "\n"


# (id, text of r.yaml ({common} = a recipe extending tiny-cpu with output_dir in tmp), overrides, options,
#  fragments the error line must contain)
ROWS = [
    # files
    ("non-utf8", b"seed: \xff\xfe\n", [], [], ["r.yaml", "not UTF-8"]),
    ("binary", b"\x00\x01\x02\x03", [], [], ["r.yaml", "binary"]),
    ("bad-yaml", "train: [1, 2\n", [], [], ["r.yaml", "invalid YAML"]),
    ("top-level-list", "- train\n", [], [], ["r.yaml", "must be a mapping"]),
    ("empty-file", "", [], [], ["r.yaml", "empty recipe", "base:"]),
    ("comments-only", "# nothing yet\n", [], [], ["r.yaml", "empty recipe"]),
    ("missing-file", None, [], [], ["nope.yaml", "cannot read"]),
    (
        "duplicate-section",
        CHILD + "train: {max_steps: 2}\ntrain: {max_steps: 3}\n",
        [],
        [],
        ["r.yaml", "duplicate key 'train'", "line 3"],
    ),
    (
        "duplicate-nested",
        CHILD + "loss:\n  ntl:\n    weight: 1\n    weight: 2\n",
        [],
        [],
        ["r.yaml", "duplicate key 'weight'"],
    ),
    ("list-as-key", "? [a]\n: 1\n", [], [], ["r.yaml", "line 1", "a key must be a plain name"]),
    # base: chains
    ("base-int", "base: 5\n", [], [], ["r.yaml", "base:", "5"]),
    ("base-list", "base: [a.yaml]\n", [], [], ["r.yaml", "base:", "['a.yaml']"]),
    ("base-empty", 'base: ""\n', [], [], ["r.yaml", "base:", "''"]),
    ("base-missing", "base: missing.yaml\n", [], [], ["r.yaml", "base:", "missing.yaml does not exist"]),
    ("base-folder", "base: .\n", [], [], ["r.yaml", "base:", "is a folder"]),
    ("base-cycle", "base: r.yaml\n", [], [], ["base:", "cycle"]),
    # keys
    ("typo-in-file", CHILD + "trian: {max_steps: 5}\n", [], [], ["r.yaml", "trian: unknown key", "'train'"]),
    ("typo-nested-file", CHILD + "loss: {ntl: {wieght: 1}}\n", [], [], ["r.yaml", "loss.ntl.wieght", "'weight'"]),
    ("typo-override", CHILD, ["trian.max_steps=5"], [], ["command-line override", "trian: unknown key", "'train'"]),
    ("typo-override-leaf", CHILD, ["train.max_step=5"], [], ["command-line override", "'max_steps'"]),
    ("section-not-mapping", CHILD + "model: 5\n", [], [], ["r.yaml", "model: expected a mapping"]),
    # an empty section was a TypeError, exit 1 (issue 71)
    ("empty-section", CHILD + "train:\n", [], [], ["r.yaml", "train: an empty section", "leave it out"]),
    ("empty-nested-section", CHILD + "loss:\n  ntl:\n", [], [], ["r.yaml", "loss.ntl: an empty section"]),
    ("empty-section-override", CHILD, ["train=null"], [], ["command-line override", "train: an empty section"]),
    # YAML 1.1 surprises (issue 42): refused, never read as something else
    (
        "yaml11-base-60",
        CHILD + "train: {max_steps: 1:30}\n",
        [],
        [],
        ["r.yaml", "line 2", "'1:30'", "base-60 number 90"],
    ),
    ("yaml11-base-60-override", CHILD, ["train.max_steps=1:30"], [], ["command-line override", "base-60"]),
    (
        "yaml11-yes",
        CHILD + "logging: {wandb: yes}\n",
        [],
        [],
        ["r.yaml", "line 2", "'yes' reads as True", "write true"],
    ),
    ("prompt-with-answer", CHILD + "eval: {prompt_template: '{question}{answer}'}\n", [], [], ["not {answer}"]),
    # override syntax
    ("override-unclosed", CHILD, ["data.sources=[{"], [], ["command-line override", "data.sources", "not valid YAML"]),
    ("override-empty", CHILD, ["loss.ntl.kind="], [], ["command-line override", "loss.ntl.kind", "null"]),
    ("override-empty-key", CHILD, ["=3"], [], ["command-line override", "key.path=value"]),
    ("override-into-scalar", CHILD, ["train.max_steps.x=1"], [], ["command-line override", "not a section"]),
    ("override-list-index-range", CHILD, ["data.sources.9.weight=2"], [], ["data.sources.9.weight", "items 0..2"]),
    ("override-list-index-name", CHILD, ["data.sources.arithmetic.weight=2"], [], ["not an item", "key.N.field"]),
    ("override-dup-in-mapping", CHILD, ["model.config={hidden_size: 1, hidden_size: 2}"], [], ["duplicate key"]),
    # types and choices
    ("kind-wass", CHILD, ["loss.ntl.kind=wass"], [], ["loss.ntl.kind", "'digits', 'number' (or null)", "mean 'was'"]),
    ("schedule-kind", CHILD + "schedule: {kind: linear}\n", [], [], ["r.yaml", "schedule.kind", "'wsd'"]),
    ("precision-fp16", CHILD, ["train.precision=fp16"], [], ["train.precision", "'bf16', 'fp32'"]),
    ("none-string", CHILD, ["train.eval_every_steps=None"], [], ["train.eval_every_steps", "write null"]),
    ("int-abc", CHILD, ["train.max_steps=abc"], [], ["train.max_steps", "expected int"]),
    ("int-float", CHILD, ["train.max_steps=1.5"], [], ["train.max_steps", "expected int"]),
    ("bool-string", CHILD, ["model.gradient_checkpointing=maybe"], [], ["model.gradient_checkpointing", "bool"]),
    ("int-quoted", CHILD, ["train.max_steps='5'"], [], ["train.max_steps", "expected int, got '5'"]),
    ("float-bool", CHILD, ["optimizer.lr=true"], [], ["optimizer.lr", "expected float, got True"]),
    ("str-number", CHILD, ["train.output_dir=5"], [], ["train.output_dir", "expected str"]),
    ("hf-config-nan", CHILD, ["model.config.rope_theta=.nan"], [], ["model.config.rope_theta", "finite"]),
    ("betas-one", CHILD, ["optimizer.betas=[0.9]"], [], ["optimizer.betas"]),
    # finite floats and ranges
    ("weight-nan", CHILD, ["loss.ntl.weight=nan"], [], ["loss.ntl.weight", "finite"]),
    ("weight-yaml-nan", CHILD + "loss: {ntl: {weight: .nan}}\n", [], [], ["r.yaml", "loss.ntl.weight", "finite"]),
    ("lr-inf", CHILD, ["optimizer.lr=inf"], [], ["optimizer.lr", "finite"]),
    ("lr-overflow", CHILD, ["optimizer.lr=1e999"], [], ["optimizer.lr", "finite"]),
    ("lr-zero", CHILD, ["optimizer.lr=0"], [], ["optimizer.lr", "> 0"]),
    ("eps-negative", CHILD, ["optimizer.eps=-1"], [], ["optimizer.eps", "> 0"]),
    ("weight-decay-negative", CHILD, ["optimizer.weight_decay=-0.1"], [], ["optimizer.weight_decay"]),
    ("global-batch-zero", CHILD, ["train.global_batch_size=0"], [], ["train.global_batch_size", ">= 1"]),
    ("eval-every-zero", CHILD, ["train.eval_every_steps=0"], [], ["train.eval_every_steps"]),
    ("seed-huge", CHILD, ["seed=1099511627776"], [], ["seed", "2^32"]),
    ("max-steps-huge", CHILD, ["train.max_steps=100000000000000000000000"], [], ["train.max_steps", "at most"]),
    ("model-size-huge", CHILD, ["model.config.hidden_size=-100000000000000000000"], [], ["model.config.hidden_size"]),
    ("seed-negative", CHILD, ["seed=-1"], [], ["seed"]),
    ("micro-batch-zero", CHILD, ["train.micro_batch_size=0"], [], ["train.micro_batch_size"]),
    ("keep-last-zero", CHILD, ["checkpoint.keep_last=0"], [], ["checkpoint.keep_last"]),
    (
        "source-weight-negative",
        CHILD,
        ["data.sources.0.weight=-1"],
        [],
        ["command-line override", "data.sources.0.weight"],
    ),
    ("max-steps-zero", CHILD, ["train.max_steps=0"], [], ["train.max_steps"]),
    ("warmup-start-negative", CHILD, ["schedule.warmup_start_ratio=-5"], [], ["schedule.warmup_start_ratio", "[0, 1]"]),
    ("num-workers-huge", CHILD, ["data.num_workers=1000"], [], ["data.num_workers", "[0, 64]"]),
    (
        "source-weights-overflow",
        CHILD,
        ["data.sources.0.weight=1e308", "data.sources.1.weight=1e308"],
        [],
        ["data.sources", "infinity"],
    ),
    ("betas-item-override", CHILD, ["optimizer.betas.0=1.5"], [], ["command-line override", "optimizer.betas"]),
    # YAML bounds
    ("alias", CHILD + "seed: &s 1\ntrain: {max_steps: *s}\n", [], [], ["r.yaml", "line 3", "alias *s", "not allowed"]),
    ("alias-bomb", CHILD + "{bomb}", [], [], ["r.yaml", "line 4", "alias *l0", "not allowed"]),
    ("too-large", CHILD + "# " + "x" * (1 << 20) + "\n", [], [], ["r.yaml", "over 1 MiB"]),
    ("override-alias", CHILD, ["model.config={a: &x 1, b: *x}"], [], ["command-line override", "alias *x"]),
    # contradictions and paths
    (
        "kind-null-reweigh",
        CHILD,
        ["loss.ntl.kind=null", "loss.ntl.reweigh=true"],
        [],
        ["loss.ntl.reweigh", "kind null"],
    ),
    (
        "kind-digits-reweigh",
        CHILD,
        ["loss.ntl.kind=digits", "loss.ntl.reweigh=true"],
        [],
        ["loss.ntl.reweigh", "kind digits"],
    ),
    (
        "validation-cadence-without-data",
        CHILD,
        ["data.validation=[]"],
        [],
        ["train.eval_every_steps", "data.validation"],
    ),
    (
        "generation-cadence-without-sets",
        CHILD,
        ["eval.every_steps=5", "eval.qa_sets=[]"],
        [],
        ["eval.every_steps", "eval.qa_sets"],
    ),
    ("sample-by-on-jsonl", CHILD, ["data.sources.0.sample_by=line"], [], ["data.sources.0.sample_by", "txt"]),
    ("hub-split-on-file", CHILD, ["data.sources.0.hub_split=test"], [], ["data.sources.0.hub_split", "hub"]),
    (
        "ds-zero-not-object",
        CHILD,
        ["deepspeed.config={tmp}/zero-int.json"],
        [],
        ["zero-int.json", "zero_optimization", "expected an object"],
    ),
    (
        "ds-offload-device",
        CHILD,
        ["deepspeed.config={tmp}/offload-gpu-ram.json"],
        [],
        ["offload-gpu-ram.json", "zero_optimization.offload_param.device", "'gpu-ram'"],
    ),
    ("ds-unknown-zero-key", CHILD, ["deepspeed.config={tmp}/zero-typo.json"], [], ["zero_optimization.overlap_com"]),
    (
        "ds-misspelt-section",
        CHILD,
        ["deepspeed.config={tmp}/ds-misspelt.json"],
        [],
        ["wall_clock_breakdwn", "did you mean"],
    ),
    ("ds-section-not-object", CHILD, ["deepspeed.config={tmp}/ds-logger-int.json"], [], ["comms_logger", "an object"]),
    (
        "ds-flag-not-bool",
        CHILD,
        ["deepspeed.config={tmp}/ds-flag-str.json"],
        [],
        ["wall_clock_breakdown", "true or false"],
    ),
    (
        "ds-rejects-dtype",
        CHILD,
        ["deepspeed.config={tmp}/ds-dtype.json"],
        [],
        ["ds-dtype.json", "communication_data_type"],
    ),
    ("ds-schema-extra-key", CHILD, ["deepspeed.config={tmp}/ds-wandb.json"], [], ["wandb.bogus", "not permitted"]),
    ("resume-missing", CHILD, ["train.resume=/no/such/checkpoint"], [], ["train.resume", "does not exist"]),
    ("init-and-resume", CHILD, ["init_from=/x", "train.resume=auto", "model.model_type=null"], [], ["init_from"]),
    ("tokenizer-empty-path", CHILD, ["tokenizer.path=''"], [], ["command-line override", "tokenizer.path", "empty"]),
    ("no-tokenizer", CHILD, ["tokenizer.path=null", "train.resume=null"], [], ["tokenizer.path", "required"]),
    ("ds-json-list", CHILD, ["deepspeed.config={tmp}/list.json"], [], ["list.json", "must be an object"]),
    (
        "ds-json-missing-pkg",
        CHILD,
        ["deepspeed.config=pkg:no_such_package_x/zero3.json"],
        [],
        ["deepspeed.config", "no_such_package_x"],
    ),
    ("ds-json-missing", CHILD, ["deepspeed.config={tmp}/none.json"], [], ["deepspeed.config", "none.json"]),
    ("ds-json-invalid", CHILD, ["deepspeed.config={tmp}/bad.json"], [], ["deepspeed.config", "bad.json"]),
    # pre-flight: the world (ntl_pretrain/preflight/world.py)
    ("no-data-section", "base: {nodata}\n", [], [], ["data.sources", "at least one"]),
    ("model-type-typo", CHILD, ["model.model_type=lama"], [], ["model.model_type", "'lama'", "llama"]),
    ("seq-len-beyond-positions", CHILD, ["data.seq_len=1024"], [], ["data.seq_len", "max_position_embeddings (512)"]),
    (
        "new-tokens-beyond-positions",
        CHILD,
        ["eval.max_new_tokens=512", "eval.every_steps=100"],
        [],
        ["eval.max_new_tokens: 512 new tokens leave no room for a prompt", "max_position_embeddings (512)"],
    ),
    ("hf-config-bad-type", CHILD, ["model.config.hidden_size=abc"], [], ["model.config", "hidden_size", "'abc'"]),
    ("hf-config-foreign-key", CHILD, ["model.config.n_embd=128"], [], ["model.config.n_embd", "LlamaConfig has no"]),
    (
        "hf-config-typo",
        CHILD,
        ["model.config.hidden_sise=96"],
        [],
        ["model.config.hidden_sise", "did you mean hidden_size"],
    ),
    # pre-flight: the model (ntl_pretrain/preflight/model.py)
    ("kv-heads", CHILD, ["model.config.num_key_value_heads=3"], [], ["model.config.num_key_value_heads", "divide"]),
    ("hidden-negative", CHILD, ["model.config.hidden_size=-64"], [], ["model.config.hidden_size", ">= 1"]),
    ("layers-zero", CHILD, ["model.config.num_hidden_layers=0"], [], ["model.config.num_hidden_layers", ">= 1"]),
    ("vocab-below-tokenizer", CHILD, ["model.config.vocab_size=100"], [], ["model.config.vocab_size", "tokenizer of"]),
    ("dropout-two", CHILD, ["model.config.attention_dropout=2.0"], [], ["model.config.attention_dropout", "[0, 1)"]),
    (
        "gpt2-heads",
        "base: {gpt2}\n",
        ["data.seq_len=32", "model.config.n_head=3"],
        [],
        ["model.config.n_head", "3 heads do not divide n_embd (64)"],
    ),
    ("heads-zero", CHILD, ["model.config.num_attention_heads=0"], [], ["model.config.num_attention_heads", ">= 1"]),
    ("heads-split-hidden", CHILD, ["model.config.num_attention_heads=3"], [], ["num_attention_heads", "hidden_size"]),
    ("vocab-negative", CHILD, ["model.config.vocab_size=-1"], [], ["model.config.vocab_size", ">= 1, got -1"]),
    ("activation-unknown", CHILD, ["model.config.hidden_act=nope"], [], ["model.config.hidden_act", "'nope'", "silu"]),
    (
        "init-from-random-bytes",
        CHILD,
        ["init_from={tmp}/random-weights", "model.model_type=null", "model.config={}", "train.resume=null"],
        [],
        ["init_from", "model.safetensors", "unreadable safetensors"],
    ),
    ("flash-without-gpu", CHILD, ["model.attention=flash_attention_2"], [], ["model.attention", "flash_attention_2"]),
    (
        "sdpa-on-gemma2",
        CHILD,
        ["model.model_type=gemma2", "model.config={num_key_value_heads: 4, head_dim: 16}", "model.attention=sdpa"],
        [],
        ["model.attention: sdpa", "Gemma2ForCausalLM"],
    ),
    (
        "init-from-bad-config",
        CHILD,
        ["init_from={tmp}/bad-config", "model.model_type=null", "train.resume=null"],
        [],
        ["init_from", "cannot build the model config"],
    ),
    ("text-field-missing", CHILD, ["data.sources.2.text_field=body"], [], ["data.sources.2", "'body'"]),
    ("format-parquet-on-jsonl", CHILD, ["data.sources.2.format=parquet"], [], ["data.sources.2", "not a parquet"]),
    ("data-file-missing", CHILD, ["data.sources.0.path={tmp}/none.jsonl"], [], ["data.sources.0.path", "none.jsonl"]),
    ("validation-file-missing", CHILD, ["data.validation.1.path={tmp}/none.jsonl"], [], ["data.validation.1.path"]),
    ("tokenizer-not-a-tokenizer", CHILD, ["tokenizer.path={tmp}/bad.json"], [], ["tokenizer.path", "cannot load"]),
    (
        "data-missing-pkg",
        CHILD,
        ["data.sources.0.path=pkg:no_such_package_x/a.jsonl"],
        [],
        ["data.sources.0.path", "no_such_package_x"],
    ),
    ("gpt2-positions", "base: {gpt2}\n", [], [], ["data.seq_len", "n_positions (64)"]),
    ("tokenizer-missing", CHILD, ["tokenizer.path={tmp}/no-tokenizer.json"], [], ["tokenizer.path", "does not exist"]),
    (
        "tokenizer-missing-pkg",
        CHILD,
        ["tokenizer.path=pkg:no_such_package_x/t.json"],
        [],
        ["tokenizer.path", "no_such_package_x"],
    ),
    ("tokenizer-none-fresh", CHILD, ["tokenizer.path=null"], [], ["tokenizer.path", "from scratch"]),
    (
        "init-from-missing",
        CHILD,
        ["init_from={tmp}/none", "model.model_type=null", "train.resume=null"],
        [],
        ["init_from", "does not exist"],
    ),
    (
        "init-from-no-config",
        CHILD,
        ["init_from={tmp}/empty", "model.model_type=null", "train.resume=null"],
        [],
        ["init_from", "config.json"],
    ),
    (
        "init-from-no-weights",
        CHILD,
        ["init_from={tmp}/config-only", "model.model_type=null", "train.resume=null"],
        [],
        ["init_from", "no weights"],
    ),
    ("output-dir-is-file", CHILD, ["train.output_dir={tmp}/list.json"], [], ["train.output_dir", "is a file"]),
    ("output-dir-empty", CHILD, ["train.output_dir=''"], [], ["train.output_dir", "empty"]),
    (
        "positions-negative",
        CHILD,
        ["model.config.max_position_embeddings=-5"],
        [],
        ["model.config.max_position_embeddings", ">= 1"],
    ),
    ("peak-flops-negative", CHILD, ["logging.peak_flops_per_device=-1"], [], ["logging.peak_flops_per_device"]),
    ("resume-is-file", CHILD, ["train.resume={tmp}/list.json"], [], ["train.resume", "is a file"]),
    ("resume-no-checkpoint", CHILD, ["train.resume={tmp}/empty"], [], ["train.resume", "no checkpoint"]),
    # launcher options
    ("master-port-busy", CHILD, [], ["--master-port", "{port}"], ["--master-port", "not free"]),
    ("master-port-range", CHILD, [], ["--master-port", "70000"], ["--master-port", "1..65535"]),
    ("nproc-zero", CHILD, [], ["--nproc", "0"], ["--nproc", ">= 1"]),
    ("nproc-negative", CHILD, [], ["--nproc", "-1"], ["--nproc", ">= 1"]),
]


@pytest.fixture
def workspace(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "recipe.yaml").write_text(KEPT)
    common = tmp_path / "common.yaml"
    common.write_text(yaml.safe_dump({"base": str(TINY), "train": {"output_dir": str(out)}}))
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "bad-config").mkdir()
    (tmp_path / "bad-config" / "config.json").write_text("{not json")
    (tmp_path / "bad-config" / "model.safetensors").write_bytes(b"")
    (tmp_path / "random-weights").mkdir()
    tiny_llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048}  # fmt: skip
    (tmp_path / "random-weights" / "config.json").write_text(json.dumps(tiny_llama))
    (tmp_path / "random-weights" / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    zero3 = json.loads((REPO / "ntl_pretrain" / "config" / "zero3_offload.json").read_text())
    zero3["zero_optimization"]["offload_param"]["device"] = "gpu-ram"
    (tmp_path / "offload-gpu-ram.json").write_text(json.dumps(zero3))
    (tmp_path / "zero-int.json").write_text('{"zero_optimization": 5}')
    (tmp_path / "zero-typo.json").write_text('{"zero_optimization": {"stage": 3, "overlap_com": true}}')
    for name, section in [("ds-misspelt", {"wall_clock_breakdwn": True}), ("ds-logger-int", {"comms_logger": 7}),
                          ("ds-flag-str", {"wall_clock_breakdown": "no"}),
                          ("ds-dtype", {"communication_data_type": "fp17"}),
                          ("ds-wandb", {"wandb": {"enabled": False, "bogus": 1}})]:  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, **section}))
    without_data = yaml.safe_load(TINY.read_text())
    del without_data["data"]
    without_data["train"]["output_dir"] = str(out)
    (tmp_path / "nodata.yaml").write_text(yaml.safe_dump(without_data))
    gpt2 = {**without_data, "data": yaml.safe_load(TINY.read_text())["data"]}
    gpt2["model"] = {"model_type": "gpt2", "config": {"n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}}
    (tmp_path / "gpt2.yaml").write_text(yaml.safe_dump(gpt2))
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        yield tmp_path, busy.getsockname()[1]


def run_cli(argv, monkeypatch, capsys):
    launches = []
    monkeypatch.setattr(supervisor, "supervise", lambda command, *args, **kwargs: launches.append(command) or 0)
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.err, launches


@pytest.mark.parametrize(("text", "overrides", "options", "fragments"), [row[1:] for row in ROWS],
                         ids=[row[0] for row in ROWS])  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_nothing_written(workspace, monkeypatch, capsys, text, overrides, options,
                                                          fragments):  # fmt: skip
    workspace, busy_port = workspace
    recipe = workspace / ("nope.yaml" if text is None else "r.yaml")
    if isinstance(text, bytes):
        recipe.write_bytes(text)
    elif text is not None:
        text = text.replace("{common}", str(workspace / "common.yaml")).replace("{bomb}", alias_bomb())
        for name in ("nodata", "gpt2"):
            text = text.replace(f"{{{name}}}", str(workspace / f"{name}.yaml"))
        recipe.write_text(text)
    overrides = [item.replace("{tmp}", str(workspace)) for item in overrides]
    options = [item.replace("{port}", str(busy_port)) for item in options]
    results = {}
    for dry in ([], ["--dry-run"]):
        code, err, launches = run_cli(["train", str(recipe), "--nproc", "2", *options, *dry, *overrides],
                                      monkeypatch, capsys)  # fmt: skip
        assert code == 2, err
        assert not launches
        lines = said_beyond_progress(err)
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("ntl-pretrain train: recipe error: ")
        for fragment in fragments:
            assert fragment in lines[0], lines[0]
        if any(item.startswith("deepspeed.config=") for item in overrides):  # not the recipe file's (issue 60)
            assert lines[0].startswith("ntl-pretrain train: recipe error: command-line override: deepspeed.config: ")
        results[bool(dry)] = lines[0]
    assert results[False] == results[True]  # --dry-run refuses exactly what train refuses
    assert sorted(p.name for p in (workspace / "out").iterdir()) == ["recipe.yaml"]
    assert (workspace / "out" / "recipe.yaml").read_text() == KEPT


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert bomb.stat().st_size < 900
    start = time.perf_counter()
    with pytest.raises(RecipeError, match=r"bomb.yaml: line 3: alias \*l0: YAML aliases are not allowed"):
        load_recipe(bomb)
    # expanded, the bomb is 9^9 strings (minutes, GBs); refused before expansion it is a small parse even under load
    assert time.perf_counter() - start < 30.0


def test_init_from_weights_are_checked_against_the_model_by_name_and_shape(tmp_path, monkeypatch, capsys):
    """The safetensors headers (no tensor read) must hold every parameter of the model that config.json and
    model.config describe; a folder that does passes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.tokenizer import load_tokenizer

    tiny = load_recipe(TINY)
    config = AutoConfig.for_model("llama", vocab_size=len(load_tokenizer(tiny.tokenizer.path)), **tiny.model.config)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    argv = ["train", str(TINY), "--dry-run", "--nproc", "1", f"init_from={tmp_path / 'hf'}", "model.model_type=null",
            f"train.output_dir={tmp_path / 'out'}", "train.resume=null"]  # fmt: skip
    code, err, launches = run_cli([*argv, "model.config={intermediate_size: 128}"], monkeypatch, capsys)
    assert code == 2 and not launches
    assert "init_from" in err and "mlp.down_proj.weight is [64, 256], the config makes it [64, 128]" in err, err
    code, err, _ = run_cli([*argv, "model.config={tie_word_embeddings: true}"], monkeypatch, capsys)
    assert code == 0, err  # a tied model needs no lm_head tensor
    code, err, _ = run_cli(argv, monkeypatch, capsys)
    assert code == 0, err
    assert not (tmp_path / "out").exists()


def test_mapping_override_merges_like_a_child_file(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"base": str(TINY), "model": {"config": {"hidden_size": 32}}}))
    from_file = load_recipe(child)
    from_override = load_recipe(TINY, ["model.config={hidden_size: 32}"])
    assert from_override == from_file
    assert from_override.model.config["hidden_size"] == 32
    assert from_override.model.config["num_hidden_layers"] == load_recipe(TINY).model.config["num_hidden_layers"]


def test_list_items_are_addressable_by_index():
    base = load_recipe(TINY)
    recipe = load_recipe(TINY, ["data.sources.1.weight=2.5", "data.validation.0.name=held_out"])
    assert recipe.data.sources[1].weight == 2.5
    assert recipe.data.validation[0].name == "held_out"
    assert [s.weight for i, s in enumerate(recipe.data.sources) if i != 1] == [
        s.weight for i, s in enumerate(base.data.sources) if i != 1
    ]


def test_whole_list_override_still_replaces(tmp_path):
    recipe = load_recipe(TINY, ["optimizer.betas=[0.8, 0.9]"])
    assert recipe.optimizer.betas == [0.8, 0.9]


def test_base_path_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({"base": str(TINY), "seed": 7}))
    child = tmp_path / "sub" / "child.yaml"
    child.parent.mkdir()
    child.write_text("base: ~/parent.yaml\n")
    assert load_recipe(child).seed == 7


def test_a_finished_run_says_so_and_launches_nothing(workspace, monkeypatch, capsys):
    workspace, _ = workspace
    finished = workspace / "out" / "checkpoints" / "step_300"  # tiny-cpu: max_steps 300, resume auto
    finished.mkdir(parents=True)
    (finished / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
    recipe = str(workspace / "common.yaml")
    (finished / "recipe.yaml").write_text(dump_recipe(load_recipe(recipe)))  # what the resume guard compares
    manifest.write(finished, manifest.describe(finished, manifest.all_files(finished)))  # the last file a save writes
    monkeypatch.setattr(supervisor, "supervise", lambda *args, **kwargs: pytest.fail("launched a finished run"))
    for dry in ([], ["--dry-run"]):
        assert cli.main(["train", recipe, "--nproc", "2", *dry]) == 0
        assert "already at step 300 of train.max_steps=300" in capsys.readouterr().out
    code, _, launches = run_cli(["train", recipe, "--nproc", "2", "train.max_steps=301"], monkeypatch, capsys)
    assert code == 0 and len(launches) == 1  # more steps asked for: it launches


def test_a_valid_recipe_passes_and_launches_once(workspace, monkeypatch, capsys):
    workspace, _ = workspace
    code, err, launches = run_cli(["train", str(workspace / "common.yaml"), "--nproc", "2"], monkeypatch, capsys)
    assert (code, len(launches)) == (0, 1)
    # one line, once every check passed: what the ranks' silent start-up is spent on, and the recipe file it follows
    assert err == (
        f"ntl-pretrain: training {(workspace / 'common.yaml').resolve()} into {workspace / 'out'}: "
        "starting 2 processes; each loads the libraries and builds the model before step 1\n"
    )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [(["trian.max_steps=5"], "trian: unknown key"), (["data.sources=[{"], "not valid YAML"), (["seed=1e999"], "seed")],
)
def test_the_installed_command_refuses_in_one_line(workspace, overrides, fragment):
    """The real entry point (a fresh interpreter, as a user runs it), not only `cli.main` in-process."""
    workspace, _ = workspace
    done = subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "train", str(workspace / "common.yaml"),
                           "--nproc", "2", *overrides], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and fragment in done.stderr, done.stderr
    assert sorted(p.name for p in (workspace / "out").iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize(("rope_scaling", "refused"), [(None, True), ({"rope_type": "linear", "factor": 4.0}, False)])
def test_rope_scaling_lets_seq_len_exceed_the_trained_positions(tmp_path, rope_scaling, refused):
    from transformers import LlamaConfig

    from ntl_pretrain.config.recipe import RecipeError
    from ntl_pretrain.preflight import world as preflight

    LlamaConfig(max_position_embeddings=512, rope_scaling=rope_scaling).save_pretrained(tmp_path)
    recipe = load_recipe(TINY, [f"init_from={tmp_path}", "model.model_type=null", "train.resume=null",
                                "data.seq_len=1024"])  # fmt: skip
    if refused:
        with pytest.raises(RecipeError, match=r"data.seq_len: 1024 tokens exceed the model's max_position_embeddings"):
            preflight.check_positions(recipe)
    else:
        preflight.check_positions(recipe)


def test_a_fresh_start_over_an_earlier_run_is_refused_and_changes_nothing(tmp_path, monkeypatch, capsys):
    """train.resume: null over checkpoints or metrics names the folder and the ways out; overwrite deletes them, and
    only once the ranks have passed every check (here: after the launch)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={out}", "train.resume=null"]
    code, err, launches = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and not launches
    assert f"train.resume: null would start afresh over the run in {out} ({out / 'checkpoints' / 'step_4'}" in err
    assert "train.resume=auto" in err and "another train.output_dir" in err and "train.overwrite=true" in err
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    code, err, launches = run_cli([*argv, "train.overwrite=true"], monkeypatch, capsys)
    assert code == 0 and len(launches) == 1, err
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before

    from ntl_pretrain.train.trainer import prepare_output_dir

    prepare_output_dir(load_recipe(TINY, argv[4:] + ["train.overwrite=true"]))
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]


def test_a_gpu_recipe_without_a_visible_gpu_stops_unless_cpu_is_chosen(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    argv = ["train", str(TINY), "--nproc", "2", f"train.output_dir={tmp_path / 'run'}", "train.device=cuda"]
    code, err, launches = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and not launches and "train.device: cuda, but no CUDA GPU is visible" in err, err
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # an explicit choice of CPU ranks
    code, err, launches = run_cli(argv, monkeypatch, capsys)
    assert code == 0 and len(launches) == 1, err

    from ntl_pretrain.cli import launch_environment

    assert (
        launch_environment("cpu")["CUDA_VISIBLE_DEVICES"] == "" and launch_environment("cpu")["DS_ACCELERATOR"] == "cpu"
    )
