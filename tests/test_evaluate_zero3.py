"""The trainer's hook under ZeRO-3: `generation_metrics` on a DeepSpeed engine's partitioned model, 2 ranks whose
shares of questions differ in size and stop at different steps, equals the metrics of the plain model.

The 2-rank part runs this file as a script under torchrun (DeepSpeed on CPU, gloo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = "pkg:ntl_pretrain/corpus/tiny-tokenizer"


def eval_config():
    from ntl_pretrain.evaluation import EvalConfig

    return EvalConfig(max_examples=5, batch_size=2, max_new_tokens=6)  # ranks get 3 and 2 questions


def zero3_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition every tensor
        "zero_allow_untested_optimizer": True,
    }


def worker(model_dir: str, out_path: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from helpers.distributed import exit_without_destructors
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from ntl_pretrain.evaluation import generation_metrics
    from ntl_pretrain.tokenizer import load_tokenizer
    from ntl_pretrain.train.main import init_distributed

    init_distributed()
    config = zero3_config()
    keep_alive = HfDeepSpeedConfig(config)  # from_pretrained loads partitioned while this object lives
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.model.embed_tokens.weight.numel() == 0  # partitioned: the rank holds no full weight
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    metrics = generation_metrics(engine.module, load_tokenizer(model_dir), eval_config())
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(metrics))
    del keep_alive
    dist.barrier()
    dist.destroy_process_group()
    exit_without_destructors()  # tests/helpers/distributed.py: the occasional abort at interpreter exit


@pytest.mark.slow
def test_generation_metrics_under_zero3_equal_the_plain_model(tmp_path: Path) -> None:
    from test_evaluate_generation import tiny_model

    from ntl_pretrain.evaluation import generation_metrics
    from ntl_pretrain.runtime.process_group import free_port
    from ntl_pretrain.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TINY_TOKENIZER)
    model = tiny_model(tokenizer)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    expected = generation_metrics(model, tokenizer, eval_config())

    out = tmp_path / "metrics.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, str(tmp_path / "model"), str(out)]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, nan_ok=True), key


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
