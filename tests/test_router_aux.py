"""The routers' load-balancing loss of a mixture of experts (heads/router_aux.py), against transformers: for every
trained MoE family whose forward adds one, the objective with λ = 0 equals `lm(..., output_router_logits=True).loss`
(dense and chunked heads), `loss.router_aux_weight: 0` gives transformers' plain CE, and two micro-batches train the
mean of their balancing losses; the key is checked before launch and said at start; a run logs `aux_loss`; and a
2-rank ZeRO-3 run whose ranks route to different experts completes, its shares summing to the logged loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.launches import TINY, partition_all_config, records, train_one_rank
from helpers.tiny_models import VOCAB, tiny_model

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.heads import build_head
from ntl_pretrain.heads.architectures import CHECKED
from ntl_pretrain.heads.forward_rules import forward_rule
from ntl_pretrain.heads.router_aux import balancing_line, router_balancing
from ntl_pretrain.model.build import CausalLMWithLoss

SEQ = 12
COEFFICIENT = 0.5  # large: leaving the term out moves the loss by several percent
AUX_FAMILIES = sorted(t for t in CHECKED if forward_rule(t).aux_loss is not None)
# Tiny configs of these families that hold no expert layer (so no router, no balancing loss) unless asked to.
WITH_EXPERTS = {"doge": {"is_moe": True}, "flint": {"mlp_only_layers": [0]},
                "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]}}  # fmt: skip
MOE_RECIPE = ["model.model_type=olmoe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
              "model.config.router_aux_loss_coef=0.05"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def moe_model(model_type: str, **settings) -> torch.nn.Module:
    """A tiny float64 model of `model_type` with its balancing coefficient enlarged to `COEFFICIENT`."""
    coefficient_key = forward_rule(model_type).aux_loss.coefficient.rsplit(".", 1)[-1]
    lm = tiny_model(model_type, **{coefficient_key: COEFFICIENT, **WITH_EXPERTS.get(model_type, {}), **settings})
    lm.set_experts_implementation("eager")  # transformers' default (grouped_mm) has no float64 kernel
    return lm.double()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, the labels the trainer gives the heads (the next token; -100 where there is none) and positions."""
    input_ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return input_ids, labels, torch.arange(SEQ).expand(2, SEQ)


def with_loss(lm, head_kind: str = "dense", weight: float | None = None) -> CausalLMWithLoss:
    recipe = Recipe()
    recipe.loss.ntl.kind, recipe.loss.head, recipe.loss.chunk_size = None, head_kind, 5
    return CausalLMWithLoss(lm, build_head(recipe, lm, None), router_balancing(lm, weight))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs() / want.abs())


@pytest.mark.parametrize("model_type", AUX_FAMILIES)
def test_objective_is_transformers_loss_with_router_logits(model_type):
    lm = moe_model(model_type)
    input_ids, labels, positions = batch()
    num_tokens = (labels != -100).sum()
    with torch.no_grad():
        want = lm(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False).loss
        plain = lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        assert want - plain > 0.04 * want, f"{model_type}: the balancing term does not show"
        for head_kind in ("dense", "chunked"):
            got = with_loss(lm, head_kind)(input_ids, labels, positions, num_tokens, num_tokens, micro_batches=1).loss
            assert relative(got, want) <= 1e-6, f"{model_type} {head_kind}: {got.item()} != {want.item()}"
        unweighted = with_loss(lm, weight=0.0)(input_ids, labels, positions, num_tokens, num_tokens, micro_batches=1)
    assert relative(unweighted.loss, plain) <= 1e-6, f"{model_type} weight 0: {unweighted.loss.item()} != CE"
    assert unweighted.aux_loss > 0  # still computed, for the log


def test_two_micro_batches_train_the_mean_of_their_balancing_losses():
    """Gradient accumulation: CE over the global batch's tokens plus the coefficient times the mean of transformers'
    term over the two micro-batches, in value and in every parameter's gradient."""
    lm = moe_model("mixtral")
    input_ids, labels, positions = batch()
    num_tokens = (labels != -100).sum()
    model = with_loss(lm)
    shares = [model(input_ids[[row]], labels[[row]], positions[[row]], num_tokens, num_tokens, micro_batches=2).loss
              for row in (0, 1)]  # fmt: skip
    sum(shares).backward()
    got = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad()
    aux = [lm(input_ids=input_ids[[row]], output_router_logits=True, use_cache=False).aux_loss for row in (0, 1)]
    ce = lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    want = ce + COEFFICIENT * (aux[0] + aux[1]) / 2
    want.backward()
    assert relative(sum(shares).detach(), want.detach()) <= 1e-6
    whole_batch = lm(input_ids=input_ids, output_router_logits=True, use_cache=False).aux_loss
    assert relative(whole_batch.detach(), (aux[0] + aux[1]).detach() / 2) > 1e-3  # the two readings differ
    for name, p in lm.named_parameters():  # transformers' CE is fp32 (it upcasts the logits): 1e-6 of the largest
        if p.grad is not None:
            assert (got[name] - p.grad).abs().max() <= 1e-6 * p.grad.abs().max(), name
    router_grads = [name for name in got if "gate" in name and got[name].abs().sum() > 0]
    assert router_grads  # the routers learn from the balancing term


def test_the_weight_is_checked_and_said_at_start():
    with pytest.raises(RecipeError, match=r"loss\.router_aux_weight: must be a number >= 0"):
        load_recipe(TINY, ["loss.router_aux_weight=-0.1"])
    lm = moe_model("mixtral")
    assert "0.5 × aux_loss" in balancing_line(lm, router_balancing(lm, None))
    assert "router_aux_weight 0.2, the model's router_aux_loss_coef is 0.5" in balancing_line(
        lm, router_balancing(lm, 0.2)
    )
    assert "without its routers' load-balancing loss" in balancing_line(lm, router_balancing(lm, 0.0))
    deepseek = tiny_model("deepseek_v3")
    assert router_balancing(deepseek, None) is None
    assert "adds no load-balancing loss" in balancing_line(deepseek, None)
    assert balancing_line(tiny_model("llama"), None) is None
    with pytest.raises(ValueError, match=r"loss\.router_aux_weight: 0\.5, but DogeForCausalLM .* without expert"):
        router_balancing(tiny_model("doge"), 0.5)  # is_moe false: no routers


def test_a_weight_for_a_model_without_a_balancing_loss_is_refused_before_launch(tmp_path, capsys):
    from ntl_pretrain import cli

    dry_run = ["train", str(TINY), "--nproc", "1", "--dry-run", f"train.output_dir={tmp_path / 'run'}"]
    assert cli.main([*dry_run, *MOE_RECIPE, "loss.router_aux_weight=0.1"]) == 0
    assert cli.main([*dry_run, "loss.router_aux_weight=0.5"]) == 2
    assert "loss.router_aux_weight: 0.5, but LlamaForCausalLM" in capsys.readouterr().err
    assert cli.main([*dry_run, "model.model_type=deepseek_v3", "loss.router_aux_weight=0"]) == 0


@pytest.mark.slow
def test_a_moe_run_logs_its_balancing_loss(tmp_path):
    output_dir = tmp_path / "run"
    console = train_one_rank(output_dir, *MOE_RECIPE, "train.global_batch_size=4")
    assert "mixture of experts: loss = ce + λ·ntl + 0.05 × aux_loss" in console
    for step in records(output_dir).values():
        assert step["aux_loss"] > 0
        assert step["loss"] == pytest.approx(step["ce"] + 0.3 * step["ntl"] + 0.05 * step["aux_loss"], rel=1e-9)
    assert " aux_loss " in console and "ntl " in console  # named as in metrics.jsonl and the docs


def train_on_different_experts(output_dir: str, ds_config: str) -> None:
    """Two steps of 2 micro-batches per rank; each rank feeds one token repeated, chosen so that the ranks' tokens go
    to disjoint experts in the first layer (a repeated token reaches every layer with the same hidden state at every
    position, so all its positions route alike). The ranks' shares of the loss sum to the logged loss, whose
    aux_loss is the mean over the 4 micro-batches."""
    import torch.distributed as dist

    from ntl_pretrain.config.deepspeed import build_deepspeed_config
    from ntl_pretrain.heads.router_aux import router_modules
    from ntl_pretrain.train.main import init_distributed
    from ntl_pretrain.train.trainer import Trainer

    init_distributed()
    overrides = [f"train.output_dir={output_dir}", f"deepspeed.config={ds_config}", "train.resume=null",
                 f"data.seq_len={SEQ}", "train.micro_batch_size=1", "train.global_batch_size=4",
                 *MOE_RECIPE]  # fmt: skip
    recipe = load_recipe(TINY, overrides)
    trainer = Trainer(recipe, build_deepspeed_config(recipe, dist.get_world_size()))
    lm, top_k = trainer.built.module.lm, trainer.built.module.lm.config.num_experts_per_tok
    token = [3, token_on_other_experts(lm, top_k)][dist.get_rank()]
    first_layer_experts: set[int] = set()
    router = router_modules(lm)[0]
    record_experts = lambda m, i, out: first_layer_experts.update(out[0].topk(top_k).indices.flatten().tolist())  # noqa: E731
    hook = router.register_forward_hook(record_experts)
    shares = []
    trainer.built.module.register_forward_hook(lambda m, i, out: shares.append([float(out.loss), float(out.aux_loss)]))
    input_ids = torch.full((1, SEQ), token)
    labels = torch.cat([input_ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    micro_batch = {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(SEQ)[None]}
    for _ in range(2):
        record = trainer.train_step([micro_batch, micro_batch])
        hook.remove()
        summed = torch.tensor(shares[-2:], dtype=torch.float64).sum(0)
        dist.all_reduce(summed)
        assert math.isclose(summed[0], record["loss"], rel_tol=1e-5), (summed, record)
        assert math.isclose(summed[1] / 4, record["aux_loss"], rel_tol=1e-6), (summed, record)
    experts = [None, None]
    dist.all_gather_object(experts, sorted(first_layer_experts))
    assert len(experts[0]) == top_k and not set(experts[0]) & set(experts[1]), experts


def token_on_other_experts(lm, top_k: int) -> int:
    """The first token whose first-layer experts are none of token 3's. Every rank runs this forward (ZeRO-3 gathers
    the weights collectively)."""
    candidates = torch.arange(3, VOCAB)
    with torch.no_grad():
        router_logits = lm.model(input_ids=candidates[:, None], output_router_logits=True).router_logits[0]
    experts = [set(row.topk(top_k).indices.tolist()) for row in router_logits]
    return int(candidates[next(i for i, chosen in enumerate(experts) if not chosen & experts[0])])


@pytest.mark.slow
def test_ranks_routing_to_different_experts_train_under_zero3(tmp_path):
    """OLMoE's sparse block is not among the classes DeepSpeed makes ZeRO-3 leaves by default (the trainer makes
    each decoder layer one, `deepspeed.gather: layer`): a rank whose tokens skip an expert still gathers and reduces
    its weights, because transformers 5 keeps each layer's experts in one module (fused tensors), and the layer is
    gathered whole. The timeout turns a collective mismatch into a failure, not a hang."""
    ds_config = partition_all_config(tmp_path)
    run_distributed(train_on_different_experts, 2, str(tmp_path / "run"), str(ds_config), timeout_s=240)
    assert not Path(tmp_path / "run" / "checkpoints").exists()  # train_step alone: nothing saved
