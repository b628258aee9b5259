"""Single-process pieces of training: schedules, weight-decay groups, FLOPs formula, checkpoint publishing."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.recipe import NtlConfig, ScheduleConfig
from ntl_pretrain.heads import DenseHead
from ntl_pretrain.model.build import CausalLMWithLoss, model_flops_per_token, parameter_groups
from ntl_pretrain.optim.schedule import lr_multiplier, warmup_note
from ntl_pretrain.reporting.metrics import MetricsLogger


def tiny_llama(tie: bool = False, head_dim: int | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                         attn_implementation="eager", head_dim=head_dim)  # fmt: skip
    return LlamaForCausalLM(config)


class TestSchedules:
    def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step(self):
        f = lr_multiplier(ScheduleConfig(kind="constant", warmup_steps=4, warmup_start_ratio=0.2), 100)
        assert [f(s) for s in range(6)] == pytest.approx([0.4, 0.6, 0.8, 1.0, 1.0, 1.0])

    def test_cosine_decays_from_peak_to_min(self):
        schedule = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
        f = lr_multiplier(schedule, 110)
        assert f(10) == pytest.approx(1.0)
        assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
        assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
        assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)

    def test_a_warmup_longer_than_the_run_is_said_with_where_the_rate_ends(self):
        schedule = ScheduleConfig(kind="cosine", warmup_steps=500, warmup_start_ratio=0.0)
        assert warmup_note(schedule, 500) is None
        note = warmup_note(schedule, 300)
        assert note.startswith("schedule.warmup_steps=500 is longer than train.max_steps=300")
        assert "60% of optimizer.lr" in note  # update 300 of a 500-step warmup from 0: 300/500

    def test_the_train_command_says_so_before_launching(self, capsys):
        from ntl_pretrain import cli

        overrides = ["schedule.warmup_steps=50", "train.max_steps=10", "train.output_dir=unused-dry-run"]
        recipe = str(Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml")
        assert cli.main(["train", recipe, "--nproc", "1", "--dry-run", *overrides]) == 0
        said = capsys.readouterr().err
        assert "ntl-pretrain: note: schedule.warmup_steps=50 is longer than train.max_steps=10" in said

    def test_warmup_stable_decay(self):
        schedule = ScheduleConfig(kind="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
        f = lr_multiplier(schedule, 100)
        assert [f(s) for s in (10, 50, 80)] == pytest.approx([1.0, 1.0, 1.0])  # stable until the last 20%
        assert [f(s) for s in (85, 90, 100)] == pytest.approx([0.75, 0.5, 0.0])


def test_weight_decay_skips_norms_biases_and_embeddings():
    lm = tiny_llama()
    module = CausalLMWithLoss(lm, DenseHead(lm.get_output_embeddings(), None, NtlConfig(kind=None)))
    decay, no_decay = parameter_groups(module, weight_decay=0.1)
    names = {id(p): n for n, p in lm.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    expected = {n for n, p in lm.named_parameters() if p.ndim == 2 and "embed_tokens" not in n}
    assert decayed == expected and "lm_head.weight" in decayed
    assert all("norm" in names[id(p)] or "embed_tokens" in names[id(p)] for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(lm.parameters()))


@pytest.mark.parametrize(("tie", "head_dim"), [(False, None), (True, None), (False, 24)])
def test_flops_formula_matches_counted_matmuls(tie, head_dim):
    """6N + 6·L·A·T against torch's FLOP counter on a real forward + backward (norms are not matmuls: <1%). Eager
    attention multiplies the whole T x T score matrix (the bmm ops) and masks half; causal attention is counted as
    half of that. head_dim 24: A = 4 heads x 24 = 96, three times the hidden size."""
    lm, batch, seq_len = tiny_llama(tie, head_dim), 2, 16
    input_ids = torch.randint(0, 96, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=input_ids).logits.sum().backward()
    attention = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    useful = counter.get_total_flops() - attention / 2
    assert attention > 0.05 * useful  # enough that counting it whole, or at the hidden width, misses by > 1%
    assert model_flops_per_token(lm, seq_len) == pytest.approx(useful / (batch * seq_len), rel=0.01)


class TestCheckpointFolders:
    def make_run(self, tmp_path: Path, steps: list[int]) -> Path:
        root = checkpoint.checkpoints_root(tmp_path)
        for step in steps:  # DeepSpeed's model states make a step folder a checkpoint (an empty one is not)
            (root / f"step_{step}").mkdir(parents=True)
            (root / f"step_{step}" / "zero_pp_rank_0_mp_rank_00_model_states.pt").touch()
        return root

    def test_kill_during_save_leaves_latest_on_the_previous_checkpoint(self, tmp_path):
        root = self.make_run(tmp_path, [10, 20])
        (root / checkpoint.LATEST).write_text("step_20")
        (root / "step_30.tmp").mkdir()  # a save that never finished
        assert checkpoint.latest(root) == root / "step_20"
        assert checkpoint.resolve_resume("auto", str(tmp_path)) == root / "step_20"
        (root / checkpoint.LATEST).unlink()  # killed after the rename, before the pointer moved
        assert checkpoint.latest(root) == root / "step_20"

    def test_publish_renames_then_points_then_prunes(self, tmp_path):
        root = self.make_run(tmp_path, [10, 20])
        (root / "step_30.tmp").mkdir()
        (root / "step_30.tmp" / "weights").write_text("w")
        checkpoint._publish(root, "step_30.tmp", "step_30", 30)
        checkpoint._prune(root, root / "step_30", keep_last=2)
        assert (root / checkpoint.LATEST).read_text() == "step_30"
        assert [p.name for p in checkpoint.published_steps(root)] == ["step_20", "step_30"]
        assert (root / "step_30" / "weights").read_text() == "w"

    def test_resume_targets(self, tmp_path):
        root = self.make_run(tmp_path, [5, 100])
        assert checkpoint.resolve_resume(None, str(tmp_path)) is None
        assert checkpoint.resolve_resume("auto", str(tmp_path / "fresh")) is None
        assert checkpoint.resolve_resume(str(root / "step_5"), "unused") == root / "step_5"
        assert checkpoint.resolve_resume(str(tmp_path), "unused") == root / "step_100"  # a run directory
        with pytest.raises(FileNotFoundError, match="train.resume"):
            checkpoint.resolve_resume(str(tmp_path / "nothing"), "unused")


def test_wandb_is_imported_only_when_asked_and_gets_numeric_records(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, record, step):
            calls.append(("log", record, step))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: calls.append(kw) or FakeRun()))
    logger = MetricsLogger(str(tmp_path), enabled=True, wandb_settings={"project": "p", "mode": "offline"})
    logger.log({"step": 1, "loss": 2.5, "mfu": None, "split": "validation", "grad_norm": float("nan")})
    logger.close()
    assert calls[0] == {"project": "p", "mode": "offline"} and calls[-1] == ("finish",)
    assert calls[1][0] == "log" and calls[1][2] == 1 and calls[1][1]["loss"] == 2.5
    assert "mfu" not in calls[1][1] and "split" not in calls[1][1]
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line == {"step": 1, "loss": 2.5, "mfu": None, "split": "validation", "grad_norm": "nan"}


def test_wandb_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(RuntimeError, match=r"ntl_pretrain\[wandb\]"):
        MetricsLogger(str(tmp_path), enabled=True, wandb_settings={"project": "p"})
    disabled = MetricsLogger(str(tmp_path / "none"), enabled=False, wandb_settings={"project": "p"})
    disabled.log({"step": 1})  # other ranks: nothing written, nothing imported
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("model_type", "flash", "dtype", "expected"),
    [
        ("llama", False, torch.float32, "sdpa"),
        ("gemma2", False, torch.float32, "eager"),  # transformers runs Gemma-2 without SDPA
        ("llama", True, torch.bfloat16, "flash_attention_2"),
        ("llama", True, torch.float32, "sdpa"),  # flash-attention runs bf16/fp16 only
        ("gemma2", True, torch.bfloat16, "flash_attention_2"),
    ],
)
def test_auto_attention_picks_what_can_run(monkeypatch, model_type, flash, dtype, expected):
    from transformers import AutoConfig

    from ntl_pretrain.model import build as model
    from ntl_pretrain.model import flash_attention

    # flash-attn is chosen when it imports, not when it is found (flash_attention.py; tests/test_flash_attention_guard)
    monkeypatch.setattr(flash_attention, "import_error", lambda: None if flash else "flash-attn is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: flash)
    config = AutoConfig.for_model(model_type)
    assert model.attention_backend("auto", config, dtype) == expected
    assert model.attention_backend("eager", config, dtype) == "eager"  # an explicit choice is kept


def test_mfu_peak_comes_from_the_device_table_or_is_unknown(monkeypatch):
    from ntl_pretrain.reporting import metrics

    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert [metrics.device_peak_flops("cuda:0", "bf16") for _ in range(4)] == [989e12, 756e12, 312e12, None]
    assert metrics.device_peak_flops("cpu", "bf16") is None and metrics.device_peak_flops("cuda:0", "fp32") is None


@pytest.mark.parametrize("model_type", ["olmoe", "qwen2_moe", "mixtral"])
def test_flops_of_a_mixture_of_experts_count_the_experts_a_token_uses(model_type):
    """The same FLOP counter on tiny MoE models (4 experts, 2 per token; eager experts, which multiply only the
    routed tokens): 6 × the active parameters, not the total. Qwen2-MoE adds a shared expert every token uses."""
    from helpers.tiny_models import tiny_model

    from ntl_pretrain.model.build import active_parameters, count_parameters

    lm, batch, seq_len = tiny_model(model_type).train(), 2, 16
    lm.set_experts_implementation("eager")
    input_ids = torch.randint(3, 128, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        lm(input_ids=input_ids).logits.sum().backward()
    attention = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    useful = counter.get_total_flops() - attention / 2
    assert active_parameters(lm) < 0.8 * count_parameters(lm)  # the experts are most of the model
    assert model_flops_per_token(lm, seq_len) == pytest.approx(useful / (batch * seq_len), rel=0.01)
