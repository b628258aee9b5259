"""How every command answers bad input a new user or a careless script would give: one line `ntl-pretrain <command>:
...` on stderr naming the key, file or argument, exit code 1 or 2, no traceback, and the workspace (the inputs, an
earlier run's folder) byte for byte as it was. 356 inputs in issue 32's four categories, written for
bench/bad_input_probe.py without looking at tests/test_recipe_errors.py and tests/test_cli_errors.py (so they measure
what those tables did not pin down), which counted how many were clear (docs/archive/benchmarks.md, "Bad input"):
as tests, each must be. Every input runs `cli.main` in this process; `train` inputs with `--dry-run`, which runs
every check a launch makes before it starts a process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from helpers.launches import TINY, said_beyond_progress

from ntl_pretrain import cli

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# A recipe key -> values that key can never take. Every value is wrong for its key whatever the rest of the recipe
# says (the tiny recipe: hidden 64, 4 heads, 2 kv heads, seq_len 128, micro batch 8, global 16, 2 ranks).
BAD_RECIPE_VALUES: dict[str, list] = {
    "seed": ["abc", -1, 1.5, [1], 2**70],
    "model.model_type": [5, "no_such_model", ""],
    "model.config.hidden_size": [-64, 0, "big", 1.5],
    "model.config.num_attention_heads": [0, 3, -4],
    "model.config.num_key_value_heads": [3, 0, 8],
    "model.config.num_hidden_layers": [0, -1, "two"],
    "model.config.intermediate_size": [0, -5],
    "model.config.max_position_embeddings": [16, 0],
    "model.config.vocab_size": [100, -1],
    "model.config.attention_dropout": [2.0, -0.5],
    "model.config.hidden_act": ["nope"],
    "model.config.rms_norm_eps": ["tiny"],
    "model.attention": ["flash", 5],
    "model.gradient_checkpointing": ["yes", 2],
    "model.pad_vocab_to_multiple_of": [0, -8, 1.5],
    "tokenizer.path": ["", "/no/such/tokenizer", 5, "pkg:ntl_pretrain/corpus/nope", "{ws}/inputs/empty"],
    "tokenizer.trust_remote_code": ["yes"],
    "loss.ntl.kind": ["wass", 5, ["was"]],
    "loss.ntl.weight": [-1, "x", float("nan"), float("inf")],
    "loss.ntl.reweigh": ["maybe"],
    "loss.head": ["sparse"],
    "loss.chunk_size": [0, -1, "x"],
    "loss.vocab_parallel_size": [0, 3, -1],
    "optimizer.lr": [-1, "fast", float("inf")],
    "optimizer.betas": [[1.5, 0.9], [0.9], "0.9", [0.9, -0.1]],
    "optimizer.eps": [-1, "x"],
    "optimizer.weight_decay": [-0.1, "x"],
    "optimizer.grad_clip": [-1, "x"],
    "schedule.kind": ["linear", 3],
    "schedule.warmup_steps": [-10, 1.5, "x"],
    "schedule.warmup_start_ratio": [-5, 2],
    "schedule.min_lr_ratio": [-0.1, 1.5],
    "schedule.decay_fraction": [-0.2, 1.5],
    "train.output_dir": ["", 5, "{ws}/inputs/text.txt"],
    "train.max_steps": [0, -1, "x", 1.5, float("inf")],
    "train.micro_batch_size": [0, -1, "8"],
    "train.global_batch_size": [15, 0, -16, 8],
    "train.global_batch_tokens": [-1, 100],
    "train.device": ["tpu", 1],
    "train.precision": ["fp16", "bf17"],
    "train.reduce_dtype": ["fp16", 16, "fp8"],
    "train.resume": [5, "/no/such/checkpoint"],
    "train.overwrite": ["yes"],
    "train.stop_grace_seconds": [-1, "x"],
    "train.eval_every_steps": [0, -1],
    "train.eval_max_batches": [0, -1],
    "train.max_nonfinite_steps": [-1],
    "train.dist_timeout_seconds": [0, -1],
    "checkpoint.every_steps": [0, -1, "x"],
    "checkpoint.keep_last": [0, -1],
    "checkpoint.verify": ["md5"],
    "logging.progress_bar": ["no"],
    "logging.console_every_steps": [-1, "x"],  # 0 is valid: the first and last step only
    "logging.wandb": ["yes"],
    "logging.peak_flops_per_device": [-1, "x"],
    "eval.chat_template": ["yes", "chatml", 1],
    "logging.profile_steps": [[0, 5], [3], "x", [1, 2, 3]],
    "deepspeed.config": ["/no/such.json", 5, "", "{ws}/inputs/empty", "{ws}/inputs/text.txt", "{ws}/inputs/list.json"],
    "init_from": ["/no/such/model", 5, "{ws}/inputs/empty", "{ws}/inputs/config-only"],
    "data.seq_len": [0, -1, "x", 10**9],
    "data.shuffle_buffer": [-1, "x"],
    "data.shuffle_buffer_tokens": [-1],
    "data.num_workers": [-1, 10_000],
    "data.tokenize_batch": [0],
    "data.prefetch_batches": [-1],
    "data.per_document_attention": ["yes"],
    # keys that do not exist, and sections of the wrong kind
    "trian": [{"max_steps": 5}],
    "model.confg": [{"hidden_size": 64}],
    "data.seqlen": [128],
    "optimizer.learning_rate": [0.1],
    "model": [5],
    "data": [[1, 2]],
    "loss": ["was"],
    "schedule": [None],
}

RECIPE_TEXTS: dict[str, tuple[str, str]] = {  # whole files: name -> (text, what the refusal must name)
    "empty": ("", "r.yaml"),
    "only-comments": ("# todo\n", "r.yaml"),
    "not-yaml": ("train: [1, 2\n", "r.yaml"),
    "a-list": ("- train\n- data\n", "r.yaml"),
    "a-string": ("hello\n", "r.yaml"),
    "tabs": ("train:\n\tmax_steps: 3\n", "r.yaml"),
    "duplicate-key": ("base: {tiny}\nseed: 1\nseed: 2\n", "seed"),
    "base-missing": ("base: /no/such/base.yaml\n", "base"),
    "base-self": ("base: r.yaml\n", "base"),
    "base-number": ("base: 7\n", "base"),
    "alias": ("base: {tiny}\nx: &a 1\nseed: *a\n", "alias"),
    "alias-bomb": (
        "base: {tiny}\nunknown:\n"
        + "".join(
            f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else ', '.join(['lol'] * 9)}]\n" for i in range(9)
        ),
        "r.yaml",
    ),  # fmt: skip
    "huge": ("base: {tiny}\n# " + "x" * (2 << 20) + "\n", "r.yaml"),
    "binary": ("\x00\x01\x02", "r.yaml"),
    "python-tag": ("base: {tiny}\nseed: !!python/object/apply:os.getcwd []\n", "r.yaml"),
}

GOOD_SOURCE = {"name": "ok", "path": "{ws}/inputs/ok.jsonl", "template": "{question} {answer}"}

BAD_SOURCES: dict[str, tuple[object, str]] = {  # name -> (data.sources, what the refusal must name)
    "no-sources": ([], "data.sources"),
    "empty-entry": ([{}], "path"),
    "sources-a-string": ("corpus.jsonl", "data.sources"),
    "sources-a-mapping": ({"path": "{ws}/inputs/ok.jsonl"}, "data.sources"),
    "missing-file": ([{**GOOD_SOURCE, "path": "{ws}/inputs/none.jsonl"}], "none.jsonl"),
    "path-a-number": ([{**GOOD_SOURCE, "path": 5}], "path"),
    "empty-folder": ([{**GOOD_SOURCE, "path": "{ws}/inputs/empty"}], "empty"),
    "all-records-garbage": ([{**GOOD_SOURCE, "path": "{ws}/inputs/garbage.jsonl"}], "garbage.jsonl"),
    "empty-file": ([{**GOOD_SOURCE, "path": "{ws}/inputs/empty.jsonl"}], "empty.jsonl"),
    "binary-file": ([{**GOOD_SOURCE, "path": "{ws}/inputs/binary.jsonl"}], "binary.jsonl"),
    "weight-negative": ([{**GOOD_SOURCE, "weight": -1}], "weight"),
    "weight-zero": ([{**GOOD_SOURCE, "weight": 0}], "weight"),
    "weight-huge": ([{**GOOD_SOURCE, "weight": 1e308}, {**GOOD_SOURCE, "name": "b", "weight": 1e308}], "weight"),
    "weight-string": ([{**GOOD_SOURCE, "weight": "heavy"}], "weight"),
    "weight-inf": ([{**GOOD_SOURCE, "weight": float("inf")}], "weight"),
    "template-unknown-field": ([{**GOOD_SOURCE, "template": "{question} {solution}"}], "solution"),
    "template-unbalanced": ([{**GOOD_SOURCE, "template": "{question {answer}"}], "template"),
    "template-positional": ([{**GOOD_SOURCE, "template": "{} {}"}], "template"),
    "format-unknown": ([{**GOOD_SOURCE, "format": "csv2"}], "format"),
    "text-field-missing": ([{"name": "ok", "path": "{ws}/inputs/ok.jsonl", "text_field": "body"}], "body"),
    "sample-by-unknown": ([{**GOOD_SOURCE, "sample_by": "word"}], "sample_by"),
    "duplicate-names": ([GOOD_SOURCE, {**GOOD_SOURCE}], "ok"),  # two objects: safe_dump would write an alias
    "hub-config-on-a-file": ([{**GOOD_SOURCE, "hub_config": "default"}], "hub_config"),
    "labels-unknown": ([{**GOOD_SOURCE, "ntl_labels": "answers"}], "ntl_labels"),
    "answer-labels-without-answer": (
        [{"name": "p", "path": "{ws}/inputs/text.jsonl", "ntl_labels": "answer"}],
        "ntl_labels",
    ),  # fmt: skip
    "unknown-source-key": ([{**GOOD_SOURCE, "weigth": 2}], "weigth"),
    "validation-missing-file": (None, "val.jsonl"),  # validation: [{path: .../val.jsonl}] (see probes())
    "yaml-file-as-corpus": ([{**GOOD_SOURCE, "path": "{ws}/inputs/list.yaml", "format": "json"}], "list.yaml"),
}

BAD_OVERRIDES: list[tuple[str, str]] = [  # (override, what the refusal must name)
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=", "train.max_steps"),
    ("=5", "=5"),
    ("train.max_steps", "train.max_steps"),
    ("train..max_steps=1", "train..max_steps"),
    ("train.max_steps.x=1", "train.max_steps"),
    ("data.sources.7.weight=1", "data.sources.7"),
    ("data.sources.x.weight=1", "data.sources.x"),
    ("data.sources=[{", "data.sources"),
    ("data.sources={}", "data.sources"),
    ("optimizer.betas.0=1.5", "optimizer.betas"),
    ("train.precision=fp32 train.reduce_dtype=bf16", "reduce_dtype"),
    ("optimizer.betas.5=0.1", "optimizer.betas.5"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("loss.ntl=5", "loss.ntl"),
    ("seed=x", "seed"),
    ("trian.max_steps=5", "trian"),
    ("train.max_step=5", "max_step"),
    ("TRAIN.max_steps=5", "TRAIN"),
    ("train.output_dir=", "train.output_dir"),
    ("loss.ntl.kind=WAS", "loss.ntl.kind"),
    ("train.precision=fp16", "train.precision"),
    ("schedule.kind=linear", "schedule.kind"),
    ("deepspeed.config=/no/such.json", "such.json"),
    ("tokenizer.path=/no/such", "tokenizer.path"),
    ("train.global_batch_size=7", "global_batch_size"),
    ("train.micro_batch_size=-2", "micro_batch_size"),
    ("data.seq_len=1e3", "data.seq_len"),
    ("loss.ntl.weight=[1]", "loss.ntl.weight"),
    ("model.config.num_key_value_heads=3", "num_key_value_heads"),
    ("checkpoint.keep_last=-3", "keep_last"),
    ("train.resume=/nope", "train.resume"),
    ("init_from=/nope", "init_from"),
    ("logging.wandb=maybe", "logging.wandb"),
    ("data.sources.0=null", "data.sources.0"),
    ("model.config=[]", "model.config"),
    ("schedule.warmup_steps=1e400", "warmup_steps"),
    ("loss.vocab_parallel_size=4", "vocab_parallel_size"),
    ("train.eval_every_steps=5 data.validation=[]", "eval_every_steps"),
]

BAD_TRAIN_OPTIONS: list[tuple[list[str], str]] = [  # (train's options, what the refusal must name)
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "-1"], "--nproc"),
    (["--nproc", "x"], "--nproc"),
    (["--nproc", "1.5"], "--nproc"),
    (["--nproc", "100000"], "--nproc"),
    (["--master-port", "x"], "--master-port"),
    (["--master-port", "70000"], "--master-port"),
    (["--master-port", "-1"], "--master-port"),
    (["--nprocs", "2"], "--nprocs"),
    (["--dry_run"], "--dry_run"),
]

OTHER_COMMANDS: list[tuple[str, list[str], str]] = [  # (name, argv, what the refusal must name)
    # eval
    ("eval-missing", ["eval", "{ws}/nope"], "nope"),
    ("eval-chat-template-word", ["eval", "{ws}/hf", "--chat-template", "chatml"], "--chat-template"),
    ("eval-a-file", ["eval", "{ws}/inputs/text.txt"], "text.txt"),
    ("eval-empty-folder", ["eval", "{ws}/inputs/empty"], "empty"),
    ("eval-config-only", ["eval", "{ws}/inputs/config-only"], "config-only"),
    ("eval-bad-config", ["eval", "{ws}/inputs/bad-config"], "config.json"),
    ("eval-random-weights", ["eval", "{ws}/inputs/random-weights"], "model.safetensors"),
    ("eval-no-tokenizer", ["eval", "{ws}/inputs/no-tokenizer"], "tokenizer"),
    ("eval-batch-0", ["eval", "{ws}/hf", "--batch-size", "0"], "--batch-size"),
    ("eval-batch-neg", ["eval", "{ws}/hf", "--batch-size", "-3"], "--batch-size"),
    ("eval-batch-word", ["eval", "{ws}/hf", "--batch-size", "many"], "--batch-size"),
    ("eval-seq-len-0", ["eval", "{ws}/hf", "--seq-len", "0"], "--seq-len"),
    ("eval-seq-len-huge", ["eval", "{ws}/hf", "--seq-len", "100000000"], "--seq-len"),
    ("eval-max-examples-neg", ["eval", "{ws}/hf", "--max-examples", "-5"], "--max-examples"),
    ("eval-new-tokens-0", ["eval", "{ws}/hf", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("eval-qa-missing", ["eval", "{ws}/hf", "--qa", "{ws}/none.jsonl"], "none.jsonl"),
    ("eval-qa-folder", ["eval", "{ws}/hf", "--qa", "{ws}/inputs/empty"], "empty"),
    ("eval-qa-garbage", ["eval", "{ws}/hf", "--qa", "{ws}/inputs/garbage.jsonl"], "garbage.jsonl"),
    ("eval-qa-no-answer", ["eval", "{ws}/hf", "--qa", "{ws}/inputs/text.jsonl"], "text.jsonl"),
    ("eval-qa-empty", ["eval", "{ws}/hf", "--qa", "{ws}/inputs/empty.jsonl"], "empty.jsonl"),
    ("eval-out-folder", ["eval", "{ws}/hf", "--out", "{ws}/inputs/empty"], "--out"),
    ("eval-out-under-file", ["eval", "{ws}/hf", "--out", "{ws}/inputs/text.txt/r.json"], "--out"),
    ("eval-answers-under-file", ["eval", "{ws}/hf", "--answers", "{ws}/inputs/text.txt/a.jsonl"], "--answers"),
    ("eval-ntl-kind", ["eval", "{ws}/hf", "--ntl-kind", "wass"], "--ntl-kind"),
    ("eval-validation-missing", ["eval", "{ws}/hf", "--validation", "{ws}/none.jsonl"], "none.jsonl"),
    ("eval-template-no-validation", ["eval", "{ws}/hf", "--template", "{question}"], "--template"),
    ("eval-prompt-template-no-field", ["eval", "{ws}/hf", "--prompt-template", "Q"], "Q"),
    ("eval-log-metrics-hf", ["eval", "{ws}/hf", "--log-metrics"], "--log-metrics"),
    ("eval-run-no-checkpoint", ["eval", "{ws}/inputs/run-no-checkpoint"], "run-no-checkpoint"),
    # export
    ("export-missing", ["export", "{ws}/nope", "{ws}/out-export"], "nope"),
    ("export-empty", ["export", "{ws}/inputs/empty", "{ws}/out-export"], "empty"),
    ("export-hf-folder", ["export", "{ws}/hf", "{ws}/out-export"], "hf"),
    ("export-a-file", ["export", "{ws}/inputs/text.txt", "{ws}/out-export"], "text.txt"),
    ("export-dtype", ["export", "{ws}/nope", "{ws}/out-export", "--dtype", "fp8"], "--dtype"),
    ("export-out-file", ["export", "{ws}/nope", "{ws}/inputs/text.txt"], "text.txt"),
    ("export-no-out", ["export", "{ws}/nope"], "out"),
    ("export-run-no-checkpoint", ["export", "{ws}/inputs/run-no-checkpoint", "{ws}/out-export"], "checkpoint"),
    # convert-gguf
    ("gguf-missing", ["convert-gguf", "{ws}/none.gguf", "{ws}/out-gguf"], "none.gguf"),
    ("gguf-text", ["convert-gguf", "{ws}/inputs/text.txt", "{ws}/out-gguf"], "text.txt"),
    ("gguf-folder", ["convert-gguf", "{ws}/inputs/empty", "{ws}/out-gguf"], "empty"),
    ("gguf-truncated", ["convert-gguf", "{ws}/inputs/truncated.gguf", "{ws}/out-gguf"], "truncated.gguf"),
    ("gguf-dtype", ["convert-gguf", "{ws}/inputs/text.txt", "{ws}/out-gguf", "--dtype", "int4"], "--dtype"),
    ("gguf-bad-package", ["convert-gguf", "pkg:no_such_pkg_q/x.gguf", "{ws}/out-gguf"], "no_such_pkg_q"),
    # plot
    ("plot-missing", ["plot", "{ws}/nope", "-o", "{ws}/p.png"], "nope"),
    ("plot-empty-folder", ["plot", "{ws}/inputs/empty", "-o", "{ws}/p.png"], "empty"),
    ("plot-garbage", ["plot", "{ws}/inputs/run-garbage", "-o", "{ws}/p.png"], "line 2"),
    ("plot-empty-metrics", ["plot", "{ws}/inputs/run-empty-metrics", "-o", "{ws}/p.png"], "run-empty-metrics"),
    ("plot-strings", ["plot", "{ws}/inputs/run-strings", "-o", "{ws}/p.png"], "run-strings"),
    ("plot-out-folder", ["plot", "{ws}/inputs/run-garbage", "-o", "{ws}/inputs/empty"], "-o"),
    ("plot-out-suffix", ["plot", "{ws}/inputs/run-ok", "-o", "{ws}/p.docx"], "p.docx"),
    ("plot-out-under-file", ["plot", "{ws}/inputs/run-ok", "-o", "{ws}/inputs/text.txt/p.png"], "-o"),
    ("plot-labels", ["plot", "{ws}/inputs/run-ok", "--labels", "a", "b", "-o", "{ws}/p.png"], "--labels"),
    ("plot-no-runs", ["plot", "-o", "{ws}/p.png"], "run_dirs"),
    # study (nothing may start, no run folder touched)
    ("study-seeds-word", ["study", "--seeds", "x", "--runs-dir", "{ws}/study"], "--seeds"),
    ("study-seeds-neg", ["study", "--seeds", "-1", "--runs-dir", "{ws}/study"], "--seeds"),
    ("study-variant-missing", ["study", "--variants", "nope", "--runs-dir", "{ws}/study"], "nope"),
    ("study-recipes-missing", ["study", "--recipes", "{ws}/none", "--runs-dir", "{ws}/study"], "none"),
    ("study-jobs-0", ["study", "--jobs", "0", "--runs-dir", "{ws}/study"], "--jobs"),
    (
        "study-override-typo",
        ["study", "--variants", "ce", "--seeds", "0", "trian.max_steps=1", "--runs-dir", "{ws}/study"],
        "trian",
    ),  # fmt: skip
    (
        "study-override-bad-value",
        ["study", "--variants", "ce", "--seeds", "0", "train.max_steps=-1", "--runs-dir", "{ws}/study"],
        "max_steps",
    ),  # fmt: skip
    ("study-stop-after-neg", ["study", "--stop-after", "-5", "--runs-dir", "{ws}/study"], "--stop-after"),
    ("study-decide-unknown", ["study", "--decide", "v9", "--runs-dir", "{ws}/study"], "v9"),
    ("study-device", ["study", "--device", "tpu", "--runs-dir", "{ws}/study"], "--device"),
    (
        "study-doc-folder",
        [
            "study",
            "--doc",
            "{ws}/inputs/empty",
            "--runs-dir",
            "{ws}/study",
            "--variants",
            "ce",
            "--seeds",
            "0",
            "train.max_steps=1",
        ],
        "--doc",
    ),  # fmt: skip
    ("study-runs-dir-file", ["study", "--runs-dir", "{ws}/inputs/text.txt", "--status"], "text.txt"),
    # data
    ("preview-missing", ["data", "preview", "{ws}/none.yaml"], "none.yaml"),
    ("preview-samples-neg", ["data", "preview", str(TINY), "--samples", "-1"], "--samples"),
    ("preview-batches-0", ["data", "preview", str(TINY), "--batches", "0"], "--batches"),
    ("preview-split", ["data", "preview", str(TINY), "--split", "test"], "--split"),
    ("preview-bad-recipe", ["data", "preview", "{ws}/inputs/not-yaml.yaml"], "not-yaml.yaml"),
    ("arithmetic-scale-neg", ["data", "make-arithmetic", "--scale", "-1", "--out", "{ws}/ar"], "--scale"),
    ("arithmetic-scale-word", ["data", "make-arithmetic", "--scale", "lots", "--out", "{ws}/ar"], "--scale"),
    ("arithmetic-out-file", ["data", "make-arithmetic", "--out", "{ws}/inputs/text.txt"], "--out"),
    ("arithmetic-seed-word", ["data", "make-arithmetic", "--seed", "x", "--out", "{ws}/ar"], "--seed"),
    ("prose-missing", ["data", "import-prose", "{ws}/none.txt", "--out", "{ws}/prose"], "none.txt"),
    ("prose-not-gutenberg", ["data", "import-prose", "{ws}/inputs/text.txt", "--out", "{ws}/prose"], "text.txt"),
    ("prose-folder", ["data", "import-prose", "{ws}/inputs/empty", "--out", "{ws}/prose"], "empty"),
    (
        "prose-lines-0",
        ["data", "import-prose", "{ws}/inputs/text.txt", "--lines-per-document", "0"],
        "--lines-per-document",
    ),  # fmt: skip
    ("tokenizer-no-corpus", ["data", "train-tokenizer", "--corpus", "{ws}/none", "--out", "{ws}/tok"], "none"),
    (
        "tokenizer-empty-corpus",
        ["data", "train-tokenizer", "--corpus", "{ws}/inputs/empty", "--out", "{ws}/tok"],
        "empty",
    ),  # fmt: skip
    ("tokenizer-vocab-0", ["data", "train-tokenizer", "--vocab-size", "0", "--out", "{ws}/tok"], "--vocab-size"),
    ("tokenizer-digits-9", ["data", "train-tokenizer", "--max-digits", "9", "--out", "{ws}/tok"], "--max-digits"),
    ("data-no-subcommand", ["data"], "data"),
    ("data-unknown-subcommand", ["data", "shuffle"], "shuffle"),
    # verify, doctor, the command line itself
    ("verify-missing", ["verify", "{ws}/nope"], "nope"),
    ("verify-a-file", ["verify", "{ws}/inputs/text.txt"], "text.txt"),
    ("verify-hf-folder", ["verify", "{ws}/hf"], "hf"),
    ("verify-damaged", ["verify", "{ws}/inputs/damaged-step"], "damaged-step"),
    ("doctor-recipe-missing", ["doctor", "--recipe", "{ws}/none.yaml"], "none.yaml"),
    ("doctor-out-folder", ["doctor", "--out", "{ws}/inputs/empty"], "--out"),
    ("doctor-busbw-word", ["doctor", "--expected-busbw", "fast"], "--expected-busbw"),
    ("doctor-busbw-neg", ["doctor", "--expected-busbw", "-5"], "--expected-busbw"),
    ("no-command", [], "command"),
    ("unknown-command", ["trian"], "trian"),
    ("train-no-recipe", ["train"], "recipe"),
    ("train-recipe-folder", ["train", "{ws}/inputs/empty", "--dry-run"], "empty"),
]


def _yaml_scalar(value) -> str:
    """`value` as a recipe file or override writes it (YAML spells the non-finite floats .nan and .inf)."""
    if isinstance(value, float) and value != value:
        return ".nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return ".inf" if value > 0 else "-.inf"
    return json.dumps(value)


def _nested(key: str, value) -> dict:
    node: dict = {}
    top = node
    parts = key.split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return top


def _merged(base: dict, child: dict) -> dict:
    """`child` over `base`, mapping by mapping."""
    merged = dict(base)
    for key, value in child.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both else value
    return merged


def _as_yaml(mapping: dict) -> str:
    """YAML that keeps NaN and infinity spelled as YAML reads them (safe_dump writes .nan/.inf too)."""
    return yaml.safe_dump(mapping, default_flow_style=False, sort_keys=False)


def build_workspace(workspace: Path) -> None:
    inputs = workspace / "inputs"
    for folder in ("empty", "config-only", "bad-config", "random-weights", "run-garbage", "run-empty-metrics",
                   "run-strings", "run-ok", "run-no-checkpoint", "out"):  # fmt: skip
        (inputs / folder).mkdir(parents=True, exist_ok=True)
    (workspace / "out").mkdir(exist_ok=True)
    (workspace / "out" / "recipe.yaml").write_text("# an earlier run's recipe: no refusal may touch it\n")
    (inputs / "ok.jsonl").write_text((REPO / "ntl_pretrain/corpus/arithmetic/validation.jsonl").read_text())
    (inputs / "garbage.jsonl").write_text("not json\n{broken\n[1, 2]\n")
    (inputs / "empty.jsonl").write_text("")
    (inputs / "binary.jsonl").write_bytes(bytes(range(256)) * 8)
    (inputs / "text.jsonl").write_text('{"text": "There were 12 apples."}\n')
    (inputs / "text.txt").write_text("just some words\n")
    (inputs / "list.json").write_text("[1, 2]")
    (inputs / "list.yaml").write_text("- 1\n- 2\n")
    (inputs / "not-yaml.yaml").write_text("train: [1, 2\n")
    (inputs / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    (inputs / "config-only" / "config.json").write_text('{"model_type": "llama"}')
    (inputs / "bad-config" / "config.json").write_text("{not json")
    (inputs / "bad-config" / "model.safetensors").write_bytes(b"")
    tiny = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048}  # fmt: skip
    (inputs / "random-weights" / "config.json").write_text(json.dumps(tiny))
    (inputs / "random-weights" / "model.safetensors").write_bytes(os.urandom(4096))
    (inputs / "run-garbage" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    (inputs / "run-empty-metrics" / "metrics.jsonl").write_text("")
    (inputs / "run-strings" / "metrics.jsonl").write_text('{"step": "one", "loss": "low"}\n')
    (inputs / "run-ok" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    (inputs / "run-no-checkpoint" / "recipe.yaml").write_text(TINY.read_text())
    step = inputs / "damaged-step"
    step.mkdir()
    (step / "manifest.json").write_text('{"version": 1, "files": {"model.pt": {"size": 10, "sha256": "00"}}}')
    (step / "model.pt").write_bytes(b"short")
    _tiny_hf_folder(workspace / "hf", inputs / "no-tokenizer")


def _tiny_hf_folder(folder: Path, without_tokenizer: Path) -> None:
    """A real HF folder (random weights, the tiny tokenizer) for arguments that only fail once a model is there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer")
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(without_tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def snapshot(workspace: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(workspace)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
            for p in workspace.rglob("*")}  # fmt: skip


def inputs() -> list[tuple[str, str, list[str], str, str | None]]:
    """(category, name, argv, what the refusal must name, the text of the recipe file `{recipe}` in argv or None);
    "{ws}" stands for the workspace, "{tiny}" for the tiny recipe."""
    found = []
    common = {"base": "{tiny}", "train": {"output_dir": "{ws}/out"}}
    dry_run = ["train", "{recipe}", "--nproc", "2", "--dry-run"]
    for key, values in BAD_RECIPE_VALUES.items():
        for value in values:
            text = _as_yaml(_merged(common, _nested(key, value)))  # one `train:` section, not two
            found.append(("recipe files", f"{key}={_yaml_scalar(value)}", dry_run, key.split(".")[-1], text))
    for name, (text, names) in RECIPE_TEXTS.items():
        found.append(("recipe files", name, dry_run, names, text))
    for name, (sources, names) in BAD_SOURCES.items():
        data = {"sources": sources}  # the tiny recipe's validation sources stay
        if sources is None:
            data = {"validation": [{**GOOD_SOURCE, "path": "{ws}/inputs/val.jsonl"}]}
        found.append(("data sources", name, dry_run, names, yaml.safe_dump(common) + _as_yaml({"data": data})))
    base = ["train", str(TINY), "--nproc", "2", "--dry-run", "train.output_dir={ws}/out"]
    for override, names in BAD_OVERRIDES:
        found.append(("overrides / train options", override, [*base, *override.split(" ")], names, None))
    for options, names in BAD_TRAIN_OPTIONS:
        found.append(("overrides / train options", " ".join(options), [*base, *options], names, None))
    for name, argv, names in OTHER_COMMANDS:
        if argv[:1] == ["study"] and "--recipes" not in argv:  # the checkout's study recipes, from the workspace
            argv = [*argv, "--recipes", str(REPO / "recipes" / "study")]
        found.append(("other commands", name, argv, names, None))
    return found


INPUTS = inputs()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad-input") / "ws"
    folder.mkdir()
    build_workspace(folder)
    return folder


def answer(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code if isinstance(exit_.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("category", "name", "argv", "names", "recipe"), INPUTS,
                         ids=[f"{category}: {name}" for category, name, *_ in INPUTS])  # fmt: skip
def test_bad_input_is_one_clear_line_and_changes_nothing(workspace, tmp_path, monkeypatch, capsys, category, name,
                                                         argv, names, recipe):  # fmt: skip
    monkeypatch.chdir(workspace)
    recipe_file = (
        tmp_path / "r.yaml"
    )  # beside the workspace: a recipe the input names is no part of what it may not touch
    if recipe is not None:
        recipe_file.write_text(recipe.replace("{ws}", str(workspace)).replace("{tiny}", str(TINY)))
    argv = [arg.replace("{ws}", str(workspace)).replace("{recipe}", str(recipe_file)) for arg in argv]
    before = snapshot(workspace)
    code, out, err = answer(argv, capsys)
    lines = said_beyond_progress(err)  # what a command under way says every few seconds is no answer
    if argv[:1] == ["verify"] and code == 1 and not lines:  # a report: one line per checkpoint on stdout
        assert names in out, out
    else:
        command = argv[0] if argv else ""
        prefixes = (f"ntl-pretrain {' '.join(argv[:2])}:", f"ntl-pretrain {command}:", "ntl-pretrain:")
        assert code in (1, 2) and len(lines) == 1, f"exit {code}: {err}"
        assert lines[0].startswith(prefixes) and names in lines[0] and " failed: " not in lines[0], lines[0]
    assert snapshot(workspace) == before, "a refusal must leave the workspace as it was"
