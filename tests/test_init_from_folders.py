"""init_from folders as transformers saves them: MoE experts one file entry each (fused in memory), GPT-NeoX's
output layer as `embed_out`. The pre-flight weight check accepts every folder `from_pretrained` loads and refuses,
naming the tensor, one it would not load; `model.config` takes a nested mapping (`rope_parameters`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.tiny_models import tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.preflight.model import check_weights

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"
# model type: a tensor name as the saved folder holds it (not as the model holds it in memory)
ON_DISK = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.1.w2.weight",
    "qwen2_moe": "model.layers.1.mlp.experts.1.down_proj.weight",
    "olmoe": "model.layers.1.mlp.experts.1.down_proj.weight",
    "gpt_neox": "embed_out.weight",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    folders = {}
    for model_type in ON_DISK:
        lm = tiny_model(model_type, tie_word_embeddings=False)
        folder = tmp_path_factory.mktemp(model_type)
        lm.save_pretrained(folder)
        folders[model_type] = folder, lm.config
    return folders


@pytest.mark.parametrize("model_type", sorted(ON_DISK))
def test_a_folder_transformers_saved_is_accepted_and_one_missing_a_tensor_refused(model_type, saved, tmp_path):
    folder, config = saved[model_type]
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert ON_DISK[model_type] in weights.keys()  # noqa: SIM118 (names differ from the model's in memory)
    check_weights(folder, config)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    del tensors[ON_DISK[model_type]]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RecipeError, match=r"init_from: .*(has no tensor|tensor .* is \[|cannot load)") as refused:
        check_weights(damaged, config)
    # the refusal names the tensor as the model holds it (the fused experts, the output layer)
    assert ("experts" if "experts" in ON_DISK[model_type] else "lm_head") in str(refused.value)


def test_init_from_a_gpt_neox_folder_passes_the_dry_run(tmp_path, monkeypatch, capsys):
    from test_recipe_errors import run_cli

    from ntl_pretrain.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(load_recipe(TINY).tokenizer.path))
    tiny_model("gpt_neox", vocab_size=vocab, tie_word_embeddings=False).save_pretrained(tmp_path / "pythia")
    recipe = yaml.safe_load(TINY.read_text())
    recipe["model"] = {"model_type": None, "config": {}}  # the architecture is the folder's
    (tmp_path / "pythia.yaml").write_text(yaml.safe_dump(recipe))
    argv = ["train", str(tmp_path / "pythia.yaml"), "--dry-run", "--nproc", "1", f"init_from={tmp_path / 'pythia'}",
            f"train.output_dir={tmp_path / 'out'}", "train.resume=null"]  # fmt: skip
    code, err, launches = run_cli(argv, monkeypatch, capsys)
    assert code == 0 and not launches, err


def test_model_config_takes_a_nested_mapping():
    rope = "{rope_type: linear, factor: 2.0, rope_theta: 10000.0}"
    recipe = load_recipe(TINY, [f"model.config.rope_parameters={rope}"])
    assert recipe.model.config["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def dry_run_on_a_tiny_folder(recipe_name: str, model_type: str, folder: Path, monkeypatch, capsys, *overrides):
    """`train --dry-run` of a shipped GPU recipe as a user copies it, on a tiny folder of its architecture as
    transformers saves it (the real folders are not downloadable here), on CPU: only the device, precision, tracker
    and paths are overridden. Returns the exit code and stderr."""
    from test_recipe_errors import run_cli

    from ntl_pretrain.tokenizer import load_tokenizer

    recipe_path = TINY.parent / recipe_name
    tokenizer = load_tokenizer("pkg:ntl_pretrain/corpus/tiny-tokenizer")
    tiny_model(model_type, vocab_size=len(tokenizer), tie_word_embeddings=False,
               max_position_embeddings=load_recipe(recipe_path).data.seq_len).save_pretrained(folder)  # fmt: skip
    tokenizer.save_pretrained(folder)
    argv = ["train", str(recipe_path), "--dry-run", "--nproc", "8", f"init_from={folder}", "train.device=cpu",
            "train.precision=fp32", "logging.wandb=false", f"train.output_dir={folder.parent / 'out'}",
            *overrides]  # fmt: skip
    code, err, launches = run_cli(argv, monkeypatch, capsys)
    assert not launches
    return code, err


@pytest.mark.parametrize(
    ("recipe_name", "model_type"), [("olmoe-1b-7b-cpt.yaml", "olmoe"), ("qwen3-8b-cpt.yaml", "qwen3")]
)
def test_the_continued_pretraining_recipes_pass_the_dry_run(recipe_name, model_type, tmp_path, monkeypatch, capsys):
    code, err = dry_run_on_a_tiny_folder(recipe_name, model_type, tmp_path / model_type, monkeypatch, capsys)
    assert code == 0, err


def test_a_balancing_weight_on_a_dense_folder_is_refused_naming_the_key(tmp_path, monkeypatch, capsys):
    assert load_recipe(TINY.parent / "olmoe-1b-7b-cpt.yaml").loss.router_aux_weight is None  # the model's own
    code, err = dry_run_on_a_tiny_folder("olmoe-1b-7b-cpt.yaml", "llama", tmp_path / "dense", monkeypatch, capsys,
                                         "loss.router_aux_weight=0.01")  # fmt: skip
    assert code == 2 and "loss.router_aux_weight" in err, err
