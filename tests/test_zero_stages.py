"""The ZeRO stage is the recipe's choice (`deepspeed.zero_stage`, else the JSON's): 1, 2 and 3 train, 0 and what a
stage cannot do are refused before launch in one line naming the key, and a checkpoint resumes only at the stage
that wrote it. A ZeRO-2 run (2 ranks) resumes on 1 rank with the uninterrupted run's losses, through DeepSpeed's
universal checkpoint, and its export holds the engine's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.launches import SAVE_AT, STEPS, partition_all_config, single_launcher_run, step_records

from ntl_pretrain import cli
from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.doctor.zero_stage import stage_advice
from ntl_pretrain.train.resume_guard import layout_differences

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def test_the_recipe_chooses_the_stage_and_records_the_one_it_runs():
    recipe, config = load_run(TINY, ["deepspeed.zero_stage=2"], 2)
    assert config["zero_optimization"]["stage"] == 2 and recipe.deepspeed.zero_stage == 2
    recipe, config = load_run(TINY, [], 2)  # null: the JSON's stage, written into the recipe the run records
    assert config["zero_optimization"]["stage"] == 3 and recipe.deepspeed.zero_stage == 3


def one_line_refusal(overrides: list[str], json_config: dict | None = None, tmp_path: Path | None = None) -> str:
    if json_config is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(json_config))
        overrides = [*overrides, f"deepspeed.config={path}"]
    with pytest.raises(RecipeError) as error:
        load_run(TINY, overrides, 2)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_what_a_stage_cannot_do_is_refused_naming_the_key(tmp_path):
    assert "deepspeed.zero_stage: 0 is not supported" in one_line_refusal(["deepspeed.zero_stage=0"])
    for stage in (0, True, 2.0):  # `true` equals 1 and `2.0` equals 2: read as such, they trained at stage 1 and 2
        assert "zero_optimization.stage: the trainer runs ZeRO stage 1, 2 or 3" in one_line_refusal(
            [], {"zero_optimization": {"stage": stage}}, tmp_path
        )
    for stage in ("true", "2.0"):
        message = one_line_refusal([f"deepspeed.zero_stage={stage}"])
        assert message == f"command-line override: deepspeed.zero_stage: expected one of 0, 1, 2, 3 (or null), got " \
            f"{True if stage == 'true' else 2.0}"  # fmt: skip
    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert "zero_optimization.offload_param: only ZeRO-3" in one_line_refusal(
        ["deepspeed.zero_stage=2"], offload, tmp_path
    )
    message = one_line_refusal(["deepspeed.zero_stage=1", "loss.vocab_parallel_size=2"])
    assert message.endswith("set deepspeed.zero_stage: 3 or vocab_parallel_size: 1")
    assert "loss.vocab_parallel_size: 2" in message


def test_a_checkpoint_resumes_only_at_the_stage_that_wrote_it():
    recipe = load_recipe(TINY, ["deepspeed.zero_stage=2"])
    saved_at = lambda stage: {"deepspeed": {"zero_stage": stage}}  # noqa: E731
    assert layout_differences(saved_at(2), recipe) == []
    (difference,) = layout_differences(saved_at(3), recipe)
    assert str(difference) == "deepspeed.zero_stage (the optimizer shards' layout): 3 → 2"
    (difference,) = layout_differences({}, recipe)  # written before the key existed: at ZeRO-3, the only stage then
    assert (difference.saved, difference.wanted) == (3, 2)


@pytest.mark.slow
def test_a_zero2_run_resumes_on_another_world_size_and_exports_its_weights(tmp_path):
    config = json.loads(partition_all_config(tmp_path).read_text())
    config["zero_optimization"]["stage"] = 2  # the ZeRO-3 keys stay: DeepSpeed ignores them at stage 2
    ds_config = tmp_path / "zero2.json"
    ds_config.write_text(json.dumps(config))
    uninterrupted = single_launcher_run(tmp_path / "run", ds_config, 2)
    saved = f"step_{SAVE_AT}"
    resumed = tmp_path / "resumed"
    shutil.copytree(uninterrupted / "checkpoints" / saved, resumed / "checkpoints" / saved)
    single_launcher_run(resumed, ds_config, 1)
    continued, reference = step_records(resumed), step_records(uninterrupted)
    assert sorted(continued) == list(range(SAVE_AT + 1, STEPS + 1))
    assert (resumed / "checkpoints" / saved / "universal" / "zero").is_dir()
    assert cli.main(["verify", str(resumed)]) == 0  # the universal copy and its `latest_universal` are the checkpoint's
    for step in continued:
        assert continued[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-6, abs=1e-5), step

    from transformers import AutoModelForCausalLM

    from ntl_pretrain.export.hf_folder import export_checkpoint

    final = uninterrupted / "checkpoints" / f"step_{STEPS}"
    exported = AutoModelForCausalLM.from_pretrained(export_checkpoint(final, tmp_path / "hf"), dtype=torch.float32)
    engine_module = torch.load(final / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, engine_module[f"lm.{name}"]), name


@pytest.mark.parametrize(("ranks", "advice"), [(8, 2), (4, 3), (1, None)])
def test_the_doctor_advises_stage_2_where_the_weights_fit_else_3(ranks, advice):
    """Llama-3-8B (8.03B parameters) in bf16 on 80 GB GPUs: stage 2 holds 2 + 14/N bytes a parameter (30.1 GB at 8
    ranks, within half of 80 GB), stage 3 16/N (32.1 GB at 4 ranks, where stage 2 needs 44.2 GB); one GPU fits none."""
    check = stage_advice(8_030_000_000, "bf16", ranks, 80e9, running=3)
    assert check.ok is (advice is not None)
    assert check.detail.get("advice") == advice
    if ranks == 8:
        assert "stage 2 30.1 GB, stage 3 16.1 GB" in check.figure and "deepspeed.zero_stage: 2" in check.figure


@pytest.mark.parametrize(
    ("ranks", "on_gpu", "refusal", "engine"),
    [
        (8, True, None, "each decoder layer compiled (train.compile: true)"),
        (4, True, None, "compiled by DeepSpeed's DeepCompile (train.compile: true)"),
        (4, True, "needs torch 2.6 or newer, not 2.5.1", "eager (train.compile: false: DeepCompile needs torch 2.6"),
        (4, False, None, "eager (train.compile: false: on CPU ranks compiling takes minutes"),
    ],
)
def test_the_doctor_names_the_engine_for_the_advised_stage(ranks, on_gpu, refusal, engine):
    """Llama-3-8B in bf16 on 80 GB devices: at stage 2 (8 ranks) compiled layers, at stage 3 (4 ranks) DeepCompile where
    it runs, else eager with the reason; eager on CPU ranks."""
    check = stage_advice(8_030_000_000, "bf16", ranks, 80e9, running=3, on_gpu=on_gpu, deepcompile_refusal=refusal)
    assert check.detail["engine"].startswith(engine) and engine in check.figure
