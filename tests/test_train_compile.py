"""`train.compile`: the decoder layers compiled in place train the uncompiled run's losses (ZeRO-2, 2 layers, 4 steps,
to 1e-5), a compiled run resumes its own checkpoint with the same losses, and its export holds the engine's weights
under the model's own names. One process (one inductor compilation, shared by every compiled trainer in it). A
compile failure is one line naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_compile_is_refused_under_zero3_before_launch():
    with pytest.raises(RecipeError) as error:
        load_run(TINY, ["train.compile=true"], 2)
    assert "train.compile: compiled decoder layers need ZeRO stage 1 or 2" in str(error.value)
    assert load_run(TINY, ["train.compile=true", "deepspeed.zero_stage=2"], 2)[0].train.compile
