"""The output heads against transformers' own forward: for every architecture the product claims, the loss the
dense and chunked heads compute from the trunk's hidden states, and its gradient on every parameter, equal
cross-entropy on `lm(input_ids).logits` (which includes the architecture's logit scaling or soft-capping).
Weights are perturbed so that the logits are far from zero, where soft-capping and scaling matter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.heads import ChunkedHead, DenseHead, build_head
from ntl_pretrain.loss.logit_transform import LogitTransform
from ntl_pretrain.model.build import CausalLMWithLoss

VOCAB, HIDDEN, SEQ = 64, 32, 12
SIZES = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)  # fmt: skip
ARCHITECTURES = {
    "llama": {},
    "qwen2": {},
    "mistral": {},
    "gpt2": {},
    "gemma": {},
    "gemma2": {"final_logit_softcapping": 3.0},
    "cohere": {"logit_scale": 0.25},
    "granite": {"logits_scaling": 4.0},
    "olmo": {},
    "phi3": {},
    "phi": {"num_key_value_heads": 4},  # an output layer with a bias: the dense head only
}


def perturbed_model(model_type: str, extra: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SIZES, **extra}, attn_implementation="eager")
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()  # no dropout: both paths alike
    with torch.no_grad():
        for param in lm.parameters():
            param.add_(torch.randn_like(param) * 0.5)  # logits of several units: soft-capping and scale bite
    return lm


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels[0, :3] = -100
    return input_ids, labels, torch.arange(SEQ).expand(2, SEQ)


def transformers_loss_and_grads(lm, input_ids, labels, positions):
    logits = lm(input_ids=input_ids, position_ids=positions).logits
    assert logits.abs().max() > 2  # far from zero, where a missing transform would show
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss.backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters()}
    lm.zero_grad(set_to_none=True)
    return loss.detach(), grads


def head_loss_and_grads(lm, head, input_ids, labels, positions):
    out = CausalLMWithLoss(lm, head)(input_ids, labels, positions)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters()}
    lm.zero_grad(set_to_none=True)
    return out.ce, grads


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_heads_train_what_transformers_forward_computes(model_type):
    lm = perturbed_model(model_type, ARCHITECTURES[model_type])
    inputs = batch()
    want_loss, want_grads = transformers_loss_and_grads(lm, *inputs)
    recipe = Recipe()
    recipe.loss.ntl.kind = None
    heads = (("dense", None),) if model_type == "phi" else (("dense", None), ("chunked", 5))
    for head_kind, chunk_size in heads:
        recipe.loss.head, recipe.loss.chunk_size = head_kind, chunk_size
        head = build_head(recipe, lm, None)
        assert isinstance(head, DenseHead if head_kind == "dense" else ChunkedHead)
        got_loss, got_grads = head_loss_and_grads(lm, head, *inputs)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0, msg=f"{model_type} {head_kind} loss")
        for name, want in want_grads.items():
            scale = want.abs().max().clamp_min(1e-6)
            torch.testing.assert_close(got_grads[name] / scale, want / scale, rtol=0, atol=1e-5,
                                       msg=f"{model_type} {head_kind} gradient of {name}")  # fmt: skip


def test_the_table_reads_each_architectures_settings():
    assert build_head(Recipe(), perturbed_model("gemma2", {"final_logit_softcapping": 3.0}), None).transform == (
        LogitTransform(softcap=3.0)
    )
    assert build_head(Recipe(), perturbed_model("cohere", {"logit_scale": 0.25}), None).transform.scale == 0.25
    assert build_head(Recipe(), perturbed_model("granite", {"logits_scaling": 4.0}), None).transform.scale == 0.25


def test_an_architecture_not_checked_is_refused_with_the_reason():
    lm = perturbed_model("bart", {"d_model": HIDDEN, "decoder_layers": 1, "decoder_attention_heads": 4})
    with pytest.raises(ValueError, match="BartForCausalLM .* not among the architectures .* CrossEntropyLoss"):
        build_head(Recipe(), lm, None)


def test_chunked_head_refuses_an_output_bias_and_points_to_dense():
    lm = perturbed_model("phi", {"num_key_value_heads": 4})
    with pytest.raises(ValueError, match="bias; set loss.head: dense"):
        build_head(Recipe(), lm, None)


def test_train_refuses_an_unchecked_architecture_before_launch(tmp_path, capsys):
    from pathlib import Path

    from ntl_pretrain import cli

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
    dry_run = ["train", str(tiny), "--nproc", "1", "--dry-run", f"train.output_dir={tmp_path / 'run'}"]
    assert cli.main([*dry_run, "model.model_type=bamba"]) == 2
    assert "model.model_type: BambaForCausalLM (model_type 'bamba') is not among" in capsys.readouterr().err
    assert cli.main([*dry_run, "model.model_type=gemma2"]) == 0
    phi = ["model.model_type=phi", "model.config.num_key_value_heads=4"]
    assert cli.main([*dry_run, *phi]) == 2
    assert "loss.head: PhiForCausalLM's output layer has a bias" in capsys.readouterr().err
    assert cli.main([*dry_run, *phi, "loss.head=dense"]) == 0


# model_type: its tiny HF config (the tiny recipe's sizes) with the logit post-processing its forward applies; and
# GPT-2, another module layout (Conv1D layers, learned positions). Families with neither (Qwen2, Mistral...) take
# Llama's path end to end (tests/test_train_e2e.py); their heads and exports are checked in-process for every
# family (tests/test_architectures.py), without a launch each.
END_TO_END = {
    "gemma2": {"final_logit_softcapping": 3.0, "head_dim": 16},
    "cohere": {"logit_scale": 0.25},
    "granite": {"logits_scaling": 4.0},
    "gpt2": {},
}
TINY_SIZES = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False}  # fmt: skip
GPT2_SIZES = {"n_embd": 64, "n_inner": 256, "n_layer": 2, "n_head": 4, "n_positions": 512, "tie_word_embeddings": False}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(END_TO_END))
def test_trainer_validation_equals_the_exported_models_forward(tmp_path, model_type):
    """End to end: 10 steps of a tiny model on 1 rank through `ntl-pretrain train`, exported; transformers' own
    forward of the export (which applies the architecture's soft-capping or scaling) gives the validation CE and NTL
    the trainer logged (Llama: tests/test_train_e2e.py)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from helpers.launches import assert_model_reproduces_logged_validation, environment, partition_all_config
    from transformers import AutoTokenizer

    from ntl_pretrain.export.hf_folder import export_checkpoint

    repo, steps, run = Path(__file__).resolve().parents[1], 10, tmp_path / "run"
    recipe = yaml.safe_load((repo / "recipes" / "tiny-cpu.yaml").read_text())
    sizes = GPT2_SIZES if model_type == "gpt2" else TINY_SIZES
    recipe["model"] = {"model_type": model_type, "attention": "eager", "config": {**sizes, **END_TO_END[model_type]}}
    recipe["deepspeed"] = {"config": str(partition_all_config(tmp_path))}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    settings = [
        f"train.output_dir={run}", f"train.max_steps={steps}", "data.seq_len=64", "train.micro_batch_size=4",
        "train.global_batch_size=4", "optimizer.lr=1e-2", f"train.eval_every_steps={steps}", "train.eval_max_batches=3",
        f"checkpoint.every_steps={steps}", "logging.progress_bar=false", "train.resume=null",
    ]  # fmt: skip
    cli = [sys.executable, "-m", "ntl_pretrain.cli"]
    done = subprocess.run([*cli, "train", str(tmp_path / "recipe.yaml"), "--nproc", "1", *settings], cwd=repo,
                          env=environment(), capture_output=True, text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    export_checkpoint(run / "checkpoints" / f"step_{steps}", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    for key, value in END_TO_END[model_type].items():
        assert getattr(model.config, key) == value
    assert_model_reproduces_logged_validation(model, AutoTokenizer.from_pretrained(tmp_path / "hf"), run, steps,
                                              micro_batch_size=4, ranks=1)  # fmt: skip


def test_recipe_keys_of_the_head():
    from pathlib import Path

    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.config.recipe import RecipeError

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
    assert (load_recipe(tiny).loss.head, load_recipe(tiny).loss.chunk_size) == ("chunked", None)
    with pytest.raises(RecipeError, match="loss.chunk_size: must be a positive number of positions or null"):
        load_recipe(tiny, ["loss.chunk_size=0"])
    with pytest.raises(RecipeError, match="loss.head"):
        load_recipe(tiny, ["loss.head=sparse"])
