"""`model.config` keys before launch: a key the model takes is never refused, a typo is, with the keys it meant.

The reference for "the model takes it" is independent of the check: the model built on the meta device with the key
has other parameter shapes than without it. `head_dim` is the case that was refused although Qwen2 and Qwen3-MoE read
it (`getattr(config, "head_dim", hidden // heads)`; their config classes have no such key)."""

import pytest
import torch
from helpers.launches import TINY
from helpers.tiny_models import tiny_config
from transformers import AutoModelForCausalLM

from ntl_pretrain import cli
from ntl_pretrain.heads.architectures import CHECKED
from ntl_pretrain.preflight.config_keys import keys_the_modeling_code_reads, why_ignored

HEAD_DIM = 32  # the tiny configs' heads are 16 wide (hidden 64 over 4 heads)


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def sized_by_head_dim(config) -> bool:
    """Whether `config` (a tiny one with `head_dim` set) builds other parameters than the tiny config without it."""
    return parameter_shapes(config) != parameter_shapes(tiny_config(config.model_type))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_head_dim_is_taken_where_the_config_class_has_no_such_key(model_type):
    config = tiny_config(model_type, head_dim=HEAD_DIM)
    assert "head_dim" not in type(config)().to_dict()  # what the old check went by
    assert sized_by_head_dim(config)  # q_proj 128 x 64 with it, 64 x 64 without
    assert why_ignored(config, "head_dim", HEAD_DIM) is None


def test_a_typo_is_refused_naming_the_key_the_model_reads_and_a_foreign_key_too():
    why = why_ignored(tiny_config("qwen2", head_dimm=HEAD_DIM), "head_dimm", HEAD_DIM)
    assert why is not None and "Qwen2Config has no such key" in why and "did you mean head_dim" in why
    gpt2 = tiny_config("gpt2", head_dim=HEAD_DIM)
    assert not sized_by_head_dim(gpt2)
    assert "GPT2Config has no such key" in why_ignored(gpt2, "head_dim", HEAD_DIM)


def test_the_dry_run_takes_head_dim_for_qwen3_moe(tmp_path, capsys):
    argv = ["train", str(TINY), "--dry-run", "--nproc", "1", f"train.output_dir={tmp_path / 'run'}",
            "model.model_type=qwen3_moe", f"model.config.head_dim={HEAD_DIM}"]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_no_trained_family_is_refused_a_head_dim_its_layers_are_sized_by():
    """Every type the compatibility table trains: where `head_dim` changes the parameters, the config class declares
    it or the modeling source's reads show it (the check does not lean on its meta-device fallback), and the check
    takes it."""
    sized_by_it = []
    for model_type in sorted(CHECKED):
        try:
            config = tiny_config(model_type, head_dim=HEAD_DIM)
        except Exception:  # transformers refuses the key itself (Falcon derives head_dim): model_config says so
            continue
        if sized_by_head_dim(config):
            sized_by_it.append(model_type)
            declared = "head_dim" in type(config)().to_dict()
            assert declared or "head_dim" in keys_the_modeling_code_reads(type(config)), model_type
            assert why_ignored(config, "head_dim", HEAD_DIM) is None, model_type
    assert {"qwen2", "qwen3_moe", "llama", "olmoe"} <= set(sized_by_it)
