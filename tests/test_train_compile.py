"""`train.compile`: the decoder layers compiled in place train the uncompiled run's losses (ZeRO-2, 2 layers, 4 steps,
to 1e-5), a compiled run resumes its own checkpoint with the same losses, and its export holds the engine's weights
under the model's own names. One process (one inductor compilation, shared by every compiled trainer in it). A
compile failure is one line naming the key."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.distributed import run_distributed

from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.train.engine import compile_failures_named

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
STEPS, SAVE_AT = 4, 2


def train(output_dir: Path, *overrides: str) -> dict[int, float]:
    from ntl_pretrain.train.trainer import Trainer

    run_overrides = ["deepspeed.zero_stage=2", "data.seq_len=32", "train.micro_batch_size=2",
                     "train.global_batch_size=2", f"train.max_steps={STEPS}", f"checkpoint.every_steps={SAVE_AT}",
                     "train.eval_every_steps=null", "logging.progress_bar=false", f"train.output_dir={output_dir}",
                     *overrides]  # fmt: skip
    trainer = Trainer(*load_run(TINY, run_overrides, 1))
    trainer.train()
    if "train.compile=true" in overrides:
        assert all(hasattr(layer, "_compiled_call_impl") for layer in trainer.built.module.lm.model.layers)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines) if record.get("split") is None}


def compiled_runs(folder: str) -> None:
    import deepspeed
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.export.hf_folder import export_checkpoint

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(folder)
    eager = train(root / "eager")
    compiled = train(root / "compiled", "train.compile=true")
    assert sorted(compiled) == list(range(1, STEPS + 1))
    assert all(abs(compiled[step] - eager[step]) < 1e-5 for step in eager), (eager, compiled)
    saved = f"step_{SAVE_AT}"
    shutil.copytree(root / "compiled" / "checkpoints" / saved, root / "resumed" / "checkpoints" / saved)
    resumed = train(root / "resumed", "train.compile=true")
    assert all(abs(resumed[step] - compiled[step]) < 1e-6 for step in resumed) and len(resumed) == STEPS - SAVE_AT
    final = root / "compiled" / "checkpoints" / f"step_{STEPS}"
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(final, root / "hf"), dtype=torch.float32)
    engine_module = torch.load(final / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, engine_module[f"lm.{name}"]), name


@pytest.mark.slow
def test_compiled_layers_train_resume_and_export_as_the_eager_ones(tmp_path):
    run_distributed(compiled_runs, 1, str(tmp_path), timeout_s=900)


def test_a_compile_failure_is_one_line_naming_the_key():
    def failing_backend(graph, inputs):
        raise ValueError("no C++ compiler found")

    with pytest.raises(RuntimeError) as error, compile_failures_named():
        torch.compile(lambda x: x.sin() + 1, backend=failing_backend)(torch.ones(2))
    message = str(error.value)
    assert message.startswith("train.compile: torch.compile failed (") and message.endswith("train.compile=false")
    assert "no C++ compiler found" in message and "\n" not in message


def test_deepcompile_at_zero3_is_refused_on_cpu_before_launch():
    """`train.compile` at ZeRO-3 is DeepCompile, which does not run on CPU ranks (docs/compatibility.md): one line."""
    with pytest.raises(RecipeError) as error:
        load_run(TINY, ["train.compile=true"], 2)
    message = str(error.value)
    assert "train.compile: at ZeRO-3 the trainer compiles through DeepSpeed's DeepCompile, which runs on" in message
    assert "these ranks run on CPU" in message and "\n" not in message
    assert load_run(TINY, ["train.compile=true", "deepspeed.zero_stage=2"], 2)[0].train.compile


def zero3_json(folder: Path, **extra) -> str:
    config = json.loads((REPO / "ntl_pretrain" / "config" / "zero3.json").read_text())
    zero = extra.pop("zero_optimization", {})
    config["zero_optimization"].update(zero)
    (folder / "zero3.json").write_text(json.dumps({**config, **extra}))
    return f"deepspeed.config={folder / 'zero3.json'}"


@pytest.mark.parametrize(
    ("overrides", "json_extra", "said"),
    [
        (["train.compile=true"], {}, "DeepCompile, which DeepSpeed 0.19.8 does not have (0.16.6 or newer has it)"),
        (["train.compile=true", "loss.vocab_parallel_size=2"], {}, "loss.vocab_parallel_size: 2 with train.compile"),
        (
            ["train.compile=true"],
            {"zero_optimization": {"leaf_module": {"classes": ["x.Block"]}}},
            "zero_optimization.leaf_module: {'classes': ['x.Block']} with train.compile at ZeRO-3",
        ),
        ([], {"compile": {"deepcompile": True}}, "compile.deepcompile: true, but the trainer compiles only where"),
        (["train.compile=true", "eval.every_steps=5"], {}, "eval.every_steps: 5 with train.compile at ZeRO-3"),
    ],
)
def test_what_deepcompile_cannot_run_is_one_line_before_launch(tmp_path, overrides, json_extra, said):
    """Where CUDA would be: a DeepSpeed without DeepCompile (first case), a combination it does not run, a JSON that
    turns it on behind the recipe's back."""
    from ntl_pretrain.config import deepcompile

    without = mock.patch.object(deepcompile, "deepspeed_has_deepcompile", return_value=False)
    with (
        mock.patch.object(deepcompile, "ranks_on_cpu", return_value=False),
        without if "does not have" in said else contextlib.nullcontext(),
        pytest.raises(RecipeError) as error,
    ):
        load_run(TINY, [*overrides, zero3_json(tmp_path, **json_extra)], 2)
    assert said in str(error.value) and "\n" not in str(error.value)


def test_an_old_torch_is_refused():
    from ntl_pretrain.config import deepcompile

    with mock.patch.object(torch, "__version__", "2.5.1+cu124"):
        assert deepcompile.why_deepcompile_cannot_run("cuda") == "needs torch 2.6 or newer, not 2.5.1+cu124"


def test_deepcompile_config_where_cuda_is():
    """The DeepSpeed JSON a ZeRO-3 run with `train.compile` gets on a CUDA machine: DeepCompile on, as DeepSpeed's own
    config reads it, and no leaf modules (DeepCompile gathers inside the graph), neither from the JSON nor the layer
    gathering the trainer adds to an eager ZeRO-3 run."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ntl_pretrain.config import deepcompile
    from ntl_pretrain.train.engine import engine_config

    with mock.patch.object(deepcompile, "ranks_on_cpu", return_value=False):
        recipe, config = load_run(TINY, ["train.compile=true"], 2)
        eager = load_run(TINY, [], 2)[1]
    assert config["compile"] == {"deepcompile": True} and "compile" not in eager
    assert config["zero_optimization"]["leaf_module"] == {"classes": [], "names": [], "name_suffixes": []}
    parsed = DeepSpeedConfig({key: value for key, value in config.items() if key != "train_batch_size"})
    assert parsed.compile_config.deepcompile and parsed.zero_config.leaf_module.classes == []
    lm = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, vocab_size=64))  # fmt: skip
    assert engine_config(config, recipe, lm)["zero_optimization"]["leaf_module"]["classes"] == []
    assert "LlamaDecoderLayer" in str(engine_config(eager, recipe, lm)["zero_optimization"]["leaf_module"])


def test_deepcompile_that_cannot_start_is_one_line_naming_the_key():
    """DeepSpeed's JIT build passes ninja's whole log in its error: the compiler's first error line is what is said."""
    from types import SimpleNamespace

    from ntl_pretrain.train.engine import compile_model

    compiler = "ATenCUDAGeneral.h:4:10: fatal error: cuda.h: No such file or directory"
    log = "\n".join(["Error building extension 'dc': [1/7] c++ -c z1.cpp", "FAILED: z1.o", compiler, "terminated."])

    def build_fails():
        raise RuntimeError(log)

    engine = SimpleNamespace(is_deepcompile_enabled=lambda: True, compile=build_fails)
    with pytest.raises(RuntimeError) as error:
        compile_model(engine, torch.nn.Linear(2, 2))
    assert str(error.value) == (
        "train.compile: DeepSpeed's DeepCompile could not start (ATenCUDAGeneral.h:4:10: fatal "
        "error: cuda.h: No such file or directory); train without it: train.compile=false"
    )
