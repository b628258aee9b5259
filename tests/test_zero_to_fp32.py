"""The `zero_to_fp32.py` that DeepSpeed users run on a checkpoints folder (issue 31): with DeepSpeed's own command line
it writes an HF folder that `from_pretrained` loads, holding the weights DeepSpeed's reader finds in the shards."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.launches import as_a_user_runs_it, unattended_run

pytestmark = pytest.mark.slow


def test_zero_to_fp32_safe_serialization_writes_an_hf_folder(tmp_path_factory, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    root = unattended_run(tmp_path_factory)[0] / "checkpoints"
    out = tmp_path / "hf"
    subprocess.run([sys.executable, str(root / "zero_to_fp32.py"), str(root), str(out), "--safe_serialization"],
                   cwd=tmp_path, env=as_a_user_runs_it(), check=True, capture_output=True, timeout=300)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(out)

    shards = get_fp32_state_dict_from_zero_checkpoint(str(root), tag="step_4")  # the trainer module's keys
    loaded = model.state_dict()
    assert {f"lm.{key}" for key in loaded} == {key for key in shards if key.startswith("lm.")}
    for key, value in loaded.items():
        assert torch.equal(value, shards[f"lm.{key}"]), key
