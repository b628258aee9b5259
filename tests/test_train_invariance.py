"""Global-batch normalisation: the same 4 sequences per step give the same loss, gradient norm and update whether
they are split as 2 ranks x 1 micro-batch of 2, 2 ranks x 2 micro-batches of 1 (gradient accumulation), or fed
to a single float64 process (plain transformers + torch AdamW + clipping) as one batch, and whichever output head
computes the loss: dense or chunked, with the output layer whole (k = 1) or shared by the 2 ranks (k = 2), and
with the output layer tied to the input embedding (dense and chunked against each other), for a token-level NTL
and for the number-level one (normalised by the global batch's count of numbers). The embedding is padded past the
tokenizer, as GPU recipes do.

The 2-rank part runs this file as a script under torchrun; sequences carry different numbers of ignored labels,
so normalising per micro-batch or per rank instead of over the global batch would show. With the number-level
NTL the batches also carry `ntl_labels` that differ from the CE labels (as for a source with `ntl_labels: answer`,
packing.py): NTL acts on some labels CE ignores and ignores others CE keeps, so counts must follow each mask.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launches import partition_all_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
SEQ_LEN, SEQUENCES, STEPS = 32, 4, 5
IGNORED_PREFIX = (0, 5, 17, 30)  # per sequence: leading labels set to -100
NTL_IGNORED_SUFFIX = (3, 0, 11, 20)  # per sequence, with label roles: trailing NTL labels set to -100
LR, WEIGHT = 1e-3, 0.3


def global_batches(tokenizer, kind: str) -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of SEQUENCES real arithmetic sequences (plenty of number tokens); for the number-level
    kind with `ntl_labels` too: NTL keeps the labels CE ignores in each row's prefix and ignores a suffix."""
    lines = (REPO / "ntl_pretrain" / "corpus" / "arithmetic" / "train.jsonl").read_text().splitlines()[:200]
    ids = [i for line in lines for i in tokenizer(" ".join(json.loads(line).values()) + "\n")["input_ids"]]
    blocks = torch.tensor(ids[: STEPS * SEQUENCES * (SEQ_LEN + 1)]).view(STEPS, SEQUENCES, SEQ_LEN + 1)
    batches = []
    for block in blocks:
        labels, ntl_labels = block[:, 1:].clone(), block[:, 1:].clone()
        for row, (ignored, ntl_ignored) in enumerate(zip(IGNORED_PREFIX, NTL_IGNORED_SUFFIX, strict=True)):
            labels[row, :ignored] = -100
            ntl_labels[row, SEQ_LEN - ntl_ignored :] = -100
        positions = torch.arange(SEQ_LEN).expand(SEQUENCES, -1).contiguous()
        batch = {"input_ids": block[:, :-1].contiguous(), "labels": labels, "position_ids": positions}
        batches.append({**batch, "ntl_labels": ntl_labels} if kind == "number" else batch)
    return batches


def recipe_overrides(output_dir: str, ds_config: str, layout: tuple, kind: str) -> list[str]:
    micro_batch_size, head, k, tied = layout
    return [
        f"train.output_dir={output_dir}", f"deepspeed.config={ds_config}", "train.resume=null",
        f"data.seq_len={SEQ_LEN}", f"train.micro_batch_size={micro_batch_size}",
        f"train.global_batch_size={SEQUENCES}", f"optimizer.lr={LR}", "optimizer.weight_decay=0",
        "optimizer.grad_clip=1.0", "schedule.kind=constant", "schedule.warmup_steps=0", f"loss.ntl.weight={WEIGHT}",
        f"loss.ntl.kind={kind}",
        "model.pad_vocab_to_multiple_of=1536",  # 2,048 tokenizer ids -> 3,072 embedding rows past the tokenizer
        f"loss.head={head}", "loss.chunk_size=24", f"loss.vocab_parallel_size={k}",  # 3 chunks per micro-batch of 2
        f"model.config.tie_word_embeddings={str(tied).lower()}",
    ]  # fmt: skip


def full_parameters(module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.lm.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone().double() for name, p in params.items()}


def run_layout(layout: tuple, ds_config: str, output_dir: str, kind: str) -> dict:
    """Train STEPS steps on this rank's half of every global batch; report losses, grad norms, weights."""
    import torch.distributed as dist

    from ntl_pretrain.config.deepspeed import build_deepspeed_config
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.train.trainer import Trainer

    recipe = load_recipe(TINY, recipe_overrides(output_dir, ds_config, layout, kind))
    micro_batch_size = layout[0]
    trainer = Trainer(recipe, build_deepspeed_config(recipe, dist.get_world_size()))
    initial = full_parameters(trainer.built.module)
    rank, per_rank = dist.get_rank(), SEQUENCES // dist.get_world_size()
    records = []
    for batch in global_batches(trainer.tokenizer, kind):
        mine = {key: value[rank * per_rank : (rank + 1) * per_rank] for key, value in batch.items()}
        micro = [
            {k: v[i : i + micro_batch_size] for k, v in mine.items()} for i in range(0, per_rank, micro_batch_size)
        ]
        records.append(trainer.train_step(micro))
    return {"initial": initial, "final": full_parameters(trainer.built.module), "records": records,
            "tokenizer": trainer.tokenizer, "config": trainer.built.module.lm.config}  # fmt: skip


def float64_reference(initial: dict, config, tokenizer, kind: str) -> dict:
    """One process, whole global batch, float64: loss = ΣCE/N + λ·ΣNTL/N_num, clip to 1, torch AdamW."""
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.numbers import NumberVocab

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")
    model.load_state_dict(initial)
    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, grad_norms = [], []
    for batch in global_batches(tokenizer, kind):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        out = ce_ntl_loss(logits, batch["labels"], nv, kind=kind, reduction="sum", ntl_labels=batch.get("ntl_labels"))
        loss = out.ce / out.num_tokens + WEIGHT * out.ntl / out.num_number_tokens
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "grad_norms": grad_norms, "final": dict(model.named_parameters())}


def relative_update_error(final: dict, reference_final: dict, initial: dict) -> float:
    """|| engine weights - reference weights || / || reference update ||, over all parameters."""
    error = sum(float((final[k] - reference_final[k].detach()).pow(2).sum()) for k in final)
    update = sum(float((reference_final[k].detach() - initial[k]).pow(2).sum()) for k in final)
    return math.sqrt(error / update)


def worker(out_path: str, ds_config: str, kind: str) -> None:
    import torch.distributed as dist

    from ntl_pretrain.train.main import init_distributed

    init_distributed()
    scratch = Path(out_path).parent
    layouts = {name: run_layout(layout, ds_config, str(scratch / name), kind) for name, layout in LAYOUTS.items()}
    if dist.get_rank() == 0:
        first = layouts["micro2"]
        reference = float64_reference(first["initial"], first["config"], first["tokenizer"], kind)
        summary = {"reference": {"losses": reference["losses"], "grad_norms": reference["grad_norms"]},
                   "vocab_size": first["config"].vocab_size}  # fmt: skip
        for name, layout in layouts.items():
            tied = LAYOUTS[name][3]
            base = layouts["tied_dense"] if tied else first  # a tied model has other weights: dense vs chunked
            summary[name] = {
                "same_init": all(torch.equal(value, base["initial"][k]) for k, value in layout["initial"].items()),
                "losses": [r["loss"] for r in layout["records"]],
                "grad_norms": [r["grad_norm"] for r in layout["records"]],
                "update_error": None
                if tied
                else relative_update_error(layout["final"], reference["final"], layout["initial"]),  # fmt: skip
                "update_error_to_base": relative_update_error(layout["final"], base["final"], layout["initial"]),
            }
        Path(out_path).write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


LAYOUTS = {  # name: (micro-batch size, loss.head, loss.vocab_parallel_size, output layer tied to the embedding)
    "micro2": (2, "dense", 1, False),
    "micro1": (1, "chunked", 1, False),
    "k2_dense": (2, "dense", 2, False),
    "k2_chunked": (1, "chunked", 2, False),
    "tied_dense": (2, "dense", 1, True),
    "tied_chunked": (1, "chunked", 1, True),
}
UNTIED = [name for name, layout in LAYOUTS.items() if not layout[3]]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["was", "number"])
def test_grad_accumulation_and_world_size_leave_loss_and_update_unchanged(tmp_path, kind):
    ds_config = partition_all_config(tmp_path)
    out = tmp_path / "summary.json"
    from ntl_pretrain.runtime.process_group import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, str(out), str(ds_config), kind]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    reference = summary["reference"]
    assert sum(g > 1.0 for g in reference["grad_norms"]) >= 2  # clipping acts, so its norm must be the global one
    for name in UNTIED:
        layout = summary[name]
        assert layout["same_init"]
        assert layout["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        assert layout["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
        assert layout["update_error"] < 3e-4, name  # fp32 engine vs float64 reference, five Adam updates
        assert layout["update_error_to_base"] < 1e-4, name
    assert summary["micro1"]["losses"] == pytest.approx(summary["micro2"]["losses"], rel=1e-7)
    for name in ("micro1", "k2_dense", "k2_chunked"):  # chunked vs dense, whole vs shared output layer
        assert summary[name]["losses"] == pytest.approx(summary["micro2"]["losses"], rel=1e-5), name
        assert summary[name]["grad_norms"] == pytest.approx(summary["micro2"]["grad_norms"], rel=1e-5), name
    tied, tied_dense = summary["tied_chunked"], summary["tied_dense"]  # the head's weight is the input embedding
    assert tied["same_init"] and tied["update_error_to_base"] < 1e-4
    assert tied["losses"] == pytest.approx(tied_dense["losses"], rel=1e-5)
    assert tied["grad_norms"] == pytest.approx(tied_dense["grad_norms"], rel=1e-5)
    assert tied["losses"] != pytest.approx(summary["micro2"]["losses"], rel=1e-3)  # another model indeed
    assert summary["vocab_size"] == 3072


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3])
