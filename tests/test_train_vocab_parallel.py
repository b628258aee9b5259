"""`loss.vocab_parallel_size: 2` in the tiny recipe on 2 CPU ranks (real deepspeed launcher, ZeRO-3 partitioning
every tensor, fp32, gloo): the same loss curve and gradient norms as the dense run (clipping active), per-rank
slices in the checkpoints, a resume that continues the curve, and an export that is a plain HF model.

One module fixture launches the dense and the vocabulary-parallel run once; the tests read their outputs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launches import assert_model_reproduces_logged_validation, partition_all_config, records
from transformers import AutoModelForCausalLM, AutoTokenizer

from ntl_pretrain.config.deepspeed import build_deepspeed_config
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.heads import check_resume
from ntl_pretrain.heads.vocab_parallel import saved_layout

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
STEPS, SAVE_EVERY, MICRO_BATCH = 10, 5, 4
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}


def overrides(output_dir: Path, ds_config: Path, k: int) -> list[str]:
    return [
        f"train.output_dir={output_dir}", f"deepspeed.config={ds_config}", f"train.max_steps={STEPS}",
        "data.seq_len=64", f"train.micro_batch_size={MICRO_BATCH}", "train.global_batch_size=16",  # 2 micro-batches
        f"checkpoint.every_steps={SAVE_EVERY}", "checkpoint.keep_last=2", f"train.eval_every_steps={STEPS}",
        "train.eval_max_batches=3", f"eval.every_steps={STEPS}", "eval.max_examples=8", "eval.max_new_tokens=6",
        "logging.progress_bar=false", "train.resume=auto", f"loss.vocab_parallel_size={k}",
    ]  # fmt: skip


def train(args: list[str], log: Path) -> None:
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(TINY), "--nproc", "2", *args]
    with log.open("w") as out:
        done = subprocess.run(command, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=400)
    assert done.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    return partition_all_config(tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ds_config) -> dict[int, Path]:
    """Output folders of the dense (k = 1) and the vocabulary-parallel (k = 2) run of the same recipe."""
    folder = tmp_path_factory.mktemp("vocab_parallel")
    for k in (1, 2):
        train(overrides(folder / f"k{k}", ds_config, k), folder / f"k{k}.log")
    return {k: folder / f"k{k}" for k in (1, 2)}


def test_loss_curve_and_grad_norms_equal_the_dense_run(runs):
    dense, parallel = records(runs[1]), records(runs[2])
    assert sorted(parallel) == list(range(1, STEPS + 1))
    assert max(dense[s]["grad_norm"] for s in dense) > 1.0  # clipping at 1.0 acts, so its norm must be the whole one
    assert dense[STEPS]["loss"] < dense[1]["loss"] - 0.2  # the curve moves
    for step in range(1, STEPS + 1):
        for key in ("loss", "ce", "ntl", "grad_norm"):
            assert parallel[step][key] == pytest.approx(dense[step][key], rel=1e-4), (step, key)
        assert parallel[step]["lr"] == dense[step]["lr"]
    dense_eval, parallel_eval = records(runs[1], "validation")[STEPS], records(runs[2], "validation")[STEPS]
    assert parallel_eval["val_ce"] == pytest.approx(dense_eval["val_ce"], rel=1e-4)


def test_generation_metrics_equal_the_dense_run(runs):
    """The trainer's greedy-answer metrics go through the HF model, whose output layer is now the stand-in."""
    dense, parallel = ({k: v for k, v in records(run, "eval")[STEPS].items() if k != "split"} for run in runs.values())
    assert "eval/arithmetic_interpolation/digit_accuracy" in dense and dense.keys() == parallel.keys()
    assert parallel == pytest.approx(dense, rel=1e-6)


def test_checkpoint_holds_every_ranks_slice(runs):
    step_folder = runs[2] / "checkpoints" / f"step_{STEPS}"
    assert saved_layout(step_folder) == {"vocab_parallel_size": 2, "world_size": 2, "vocab_size": 2048}
    slices = [torch.load(step_folder / "vocab_parallel" / f"rank_{r:05d}.pt", weights_only=True) for r in (0, 1)]
    assert [s["vocab_start"] for s in slices] == [0, 1024]
    assert [tuple(s["weight"].shape) for s in slices] == [(1024, 64), (1024, 64)]
    assert all(s["optimizer"]["state"][0]["step"] == STEPS for s in slices)


def test_resume_continues_the_loss_curve(runs, ds_config, tmp_path):
    """Resuming step 5 (trunk shards, slices, both optimizers and schedules) repeats steps 6..10 exactly."""
    output_dir = tmp_path / "resumed"
    shutil.copytree(runs[2] / "checkpoints" / f"step_{SAVE_EVERY}", output_dir / "checkpoints" / f"step_{SAVE_EVERY}")
    train(overrides(output_dir, ds_config, 2), tmp_path / "log.txt")
    expected, got = records(runs[2]), records(output_dir)
    assert sorted(got) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for step in got:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6, rel=0), step
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-5), step


def test_resume_with_another_layout_is_refused(runs):
    """The guard asks every head kind (`heads.check_resume`); the vocabulary-parallel one knows its slices."""
    step_folder = runs[2] / "checkpoints" / f"step_{STEPS}"
    k1, k2 = (load_recipe(TINY, [f"loss.vocab_parallel_size={k}"]) for k in (1, 2))
    with pytest.raises(ValueError, match="trained with loss.vocab_parallel_size=2; resume it with the same value"):
        check_resume(step_folder, k1, 2)
    with pytest.raises(ValueError, match="saved by 2 ranks .* on 4 ranks is not supported"):
        check_resume(step_folder, k2, 4)
    with pytest.raises(ValueError, match="vocab_parallel_size=1; resume it with the same value"):
        check_resume(runs[1] / "checkpoints" / f"step_{STEPS}", k2, 2)
    check_resume(step_folder, k2, 2)
    check_resume(runs[1] / "checkpoints" / f"step_{STEPS}", k1, 2)


def test_recipe_checks():
    recipe = load_recipe(TINY, ["loss.vocab_parallel_size=3", "train.global_batch_size=null"])
    with pytest.raises(RecipeError, match="loss.vocab_parallel_size: 3 does not divide the world size"):
        build_deepspeed_config(recipe, 4)
    assert build_deepspeed_config(recipe, 6)["train_batch_size"] == 6 * 8
    with pytest.raises(RecipeError, match="loss.vocab_parallel_size: must be >= 1"):
        load_recipe(TINY, ["loss.vocab_parallel_size=0"])
    with pytest.raises(RecipeError, match="loss.vocab_parallel_size: needs an output layer of its own"):
        load_recipe(TINY, ["loss.vocab_parallel_size=2", "model.config.tie_word_embeddings=true"])


def test_export_reassembles_the_output_layer(runs, tmp_path):
    """The exported folder is a plain HF model: its lm_head is the saved slices joined, and plain transformers on
    the batches each rank evaluated gives the validation CE and NTL the vocabulary-parallel run logged."""
    step_folder, out = runs[2] / "checkpoints" / f"step_{STEPS}", tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "export", str(step_folder), str(out)], check=True,
                   cwd=REPO, env=ENV)  # fmt: skip
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values())
    slices = [torch.load(step_folder / "vocab_parallel" / f"rank_{r:05d}.pt", weights_only=True) for r in (0, 1)]
    assert torch.equal(model.lm_head.weight, torch.cat([s["weight"] for s in slices]))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert_model_reproduces_logged_validation(model, tokenizer, runs[2], STEPS, micro_batch_size=MICRO_BATCH)


def check_generation_with_sharded_output_layer() -> None:
    """Each rank prompts differently (other lengths, another number of new tokens until all stop): the stand-in
    output layer gives the dense model's logits and greedy tokens."""
    import copy

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from ntl_pretrain.config.recipe import Recipe
    from ntl_pretrain.heads.vocab_parallel import VocabParallelOutputHead, VocabParallelOutputLayer
    from ntl_pretrain.loss.logit_transform import IDENTITY
    from ntl_pretrain.model.build import model_flops_per_token

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=False, eos_token_id=36)  # fmt: skip
    dense = LlamaForCausalLM(config).eval()
    sharded = copy.deepcopy(dense)
    recipe = Recipe()
    recipe.loss.vocab_parallel_size, recipe.loss.ntl.kind = 2, None
    output_head = VocabParallelOutputHead.from_model(sharded, None, recipe, IDENTITY)
    head = output_head.head
    assert isinstance(sharded.get_output_embeddings(), VocabParallelOutputLayer)
    # The matrix is no parameter of the sharded LM; the head adds it back to the model's FLOPs.
    flops = model_flops_per_token(sharded, 64, output_head.parameters_outside_model())
    assert flops == model_flops_per_token(dense, 64) > model_flops_per_token(sharded, 64)
    assert "lm_head.weight" not in dict(sharded.named_parameters()) and head.weight.shape == (19 - dist.get_rank(), 16)
    prompt = torch.randint(
        0, 36, (2, 3 + 2 * dist.get_rank()), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    with torch.no_grad():
        torch.testing.assert_close(sharded(prompt).logits, dense(prompt).logits)
        new_tokens = 4 + 3 * dist.get_rank()
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
        expected = dense.generate(prompt, **settings)
        got = sharded.generate(prompt, synced_gpus=True, **settings)
    assert torch.equal(got, expected)


def test_generation_through_the_sharded_output_layer():
    from helpers.distributed import run_distributed

    run_distributed(check_generation_with_sharded_output_layer, 2)
