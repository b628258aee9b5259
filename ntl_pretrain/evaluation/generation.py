"""Greedy, batched generation on question/answer sets, scored as numbers.

Per set: exact match (the parsed answer equals the reference as a number), MAE and R² of the parsed answers,
per-digit accuracy (reference digits reproduced at the same place value, unparseable answers scoring none),
and the share of answers with no number in them. MAE, R² and `log_mae` = mean log10(1 + |error|) (the order of
magnitude of the error; one wild answer cannot dominate it as it does MAE) are over the parseable answers only.
R²'s total variance takes two passes (the references' mean first, then the squared deviations from it, in
`Decimal`), because the one-pass Σy² − (Σy)²/n cancels catastrophically when the references share a large offset.

With a process group (a `torchrun`/`deepspeed` launch, or the trainer under ZeRO-3) every rank answers its
share of the questions and the sums are all-reduced. Every rank calls `generate` equally often and with
`synced_gpus`, because a ZeRO-3 forward gathers parameters collectively: a rank that stopped early would hang
the others.

Shapes: B prompts in a batch, P padded prompt length, N = P + generated tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ntl_pretrain.evaluation.answers import digit_matches, parse_answer, parse_reference, read_qa_file
from ntl_pretrain.evaluation.config import EvalConfig, QaSetConfig
from ntl_pretrain.tokenizer import resolve_path

# Float64 sums over examples, all-reduced as one tensor.
SUMS = (
    "examples",
    "exact",
    "unparseable",
    "digits_right",
    "digits_total",
    "parsed",
    "abs_error",
    "log_abs_error",
    "squared_error",
    "target",
)


@dataclass(frozen=True)
class QaExample:
    question: str
    answer: str

    @property
    def answer_value(self) -> Decimal:
        return parse_reference(self.answer)


@dataclass(frozen=True)
class Answered:
    example: QaExample
    generated: str
    parsed: Decimal | None


def load_qa_set(qa: QaSetConfig, max_examples: int | None) -> list[QaExample]:
    """The first `max_examples` records of a jsonl Q/A file, in file order."""
    return [QaExample(question, answer) for question, answer in read_qa_file(resolve_path(qa.path), max_examples)]


def score(answered: list[Answered]) -> torch.Tensor:
    """float64 [len(SUMS)]: the sums behind every metric, so that ranks can add theirs."""
    sums = dict.fromkeys(SUMS, 0.0)
    for item in answered:
        reference = item.example.answer_value
        right, total = digit_matches(item.parsed, reference)
        sums["examples"] += 1
        sums["digits_right"] += right
        sums["digits_total"] += total
        if item.parsed is None:
            sums["unparseable"] += 1
            continue
        error = float(item.parsed - reference)  # exact in Decimal, rounded once
        sums["exact"] += item.parsed == reference
        sums["parsed"] += 1
        sums["abs_error"] += abs(error)
        sums["log_abs_error"] += math.log10(1.0 + abs(error))
        sums["squared_error"] += error * error
    sums["target"] = float(sum((item.example.answer_value for item in answered if item.parsed is not None), Decimal()))
    return torch.tensor([sums[name] for name in SUMS], dtype=torch.float64)


def reference_spread(answered: list[Answered], mean: float) -> torch.Tensor:
    """float64 [3]: Σ(y - mean)² over the parsed answers' references y (each deviation exact in `Decimal`), then
    max y and -min y (-inf without parsed answers), so that ranks can reduce them (sum, then max)."""
    references = [item.example.answer_value for item in answered if item.parsed is not None]
    if not references:
        return torch.tensor([0.0, -math.inf, -math.inf], dtype=torch.float64)
    center = Decimal(mean)
    squared = sum(float(reference - center) ** 2 for reference in references)
    return torch.tensor([squared, float(max(references)), -float(min(references))], dtype=torch.float64)


def set_metrics(answered: list[Answered]) -> dict[str, float]:
    """Metrics of one Q/A set from every rank's share of its answers; call on every rank."""
    sums = _all_reduced(score(answered), dist.ReduceOp.SUM)
    parsed, target = sums[SUMS.index("parsed")].item(), sums[SUMS.index("target")].item()
    spread = reference_spread(answered, target / parsed if parsed else 0.0)
    squared_deviation = _all_reduced(spread[:1].clone(), dist.ReduceOp.SUM).item()
    largest, negated_smallest = _all_reduced(spread[1:].clone(), dist.ReduceOp.MAX).tolist()
    references_vary = largest > -negated_smallest
    return summarise(sums, squared_deviation if references_vary else 0.0)


def summarise(sums: torch.Tensor, total_variance: float) -> dict[str, float]:
    """Metrics from all-reduced sums and Σ(y - ȳ)² (0 when the references do not vary); MAE and R² are NaN when
    no answer could be parsed, R² also when the references do not vary."""
    s = dict(zip(SUMS, sums.tolist(), strict=True))
    parsed, examples = s["parsed"], max(s["examples"], 1.0)
    return {
        "exact_match": s["exact"] / examples,
        "mae": s["abs_error"] / parsed if parsed else math.nan,
        "log_mae": s["log_abs_error"] / parsed if parsed else math.nan,
        "r2": 1.0 - s["squared_error"] / total_variance if total_variance > 0 else math.nan,
        "digit_accuracy": s["digits_right"] / max(s["digits_total"], 1.0),
        "unparseable": s["unparseable"] / examples,
        "examples": s["examples"],
    }


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> bool:
    """Whether prompts go in the tokenizer's chat template (`EvalConfig.chat_template`): never without one; with
    `auto` always; by default (None) for an Instruct or chat model, whose end-of-sequence token ends a turn of its
    template (a base model's ends a text: SmolLM2's `<|endoftext|>` against its Instruct model's `<|im_end|>`)."""
    if chat_template == "none" or not tokenizer.chat_template:
        return False
    return chat_template == "auto" or (bool(tokenizer.eos_token) and tokenizer.eos_token in tokenizer.chat_template)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: str | None = "none") -> list[int]:
    """EOS first: in packed training every document follows the previous one's EOS, so that is the context the
    model learned to start a question in. In the chat template (`uses_chat_template`) the prompt is a user message
    and the model's turn is opened."""
    if uses_chat_template(tokenizer, chat_template):
        message = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(message, add_generation_prompt=True, return_dict=False))
    return [tokenizer.eos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]


def generate_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], cfg: EvalConfig, synced: bool
) -> list[str]:
    """Greedy continuations (text up to EOS) of left-padded prompts."""
    encoded = [prompt_ids(tokenizer, prompt, cfg.chat_template) for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids_BP = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask_BP = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids_BP[row, width - len(ids) :] = torch.tensor(ids)
        mask_BP[row, width - len(ids) :] = 1
    output_BN = model.generate(
        input_ids=input_ids_BP.to(model.device),
        attention_mask=mask_BP.to(model.device),
        max_new_tokens=cfg.max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        use_cache=True,
        synced_gpus=synced,
    )
    return [_until_eos(row.tolist(), tokenizer) for row in output_BN[:, width:].cpu()]


def _until_eos(ids: list[int], tokenizer: PreTrainedTokenizerBase) -> str:
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def answer_rank_share(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[QaExample],
    cfg: EvalConfig,
    progress: Callable[[str], None] | None = None,
) -> list[Answered]:
    """This rank's examples (every world-th), answered in equally many batches on every rank; `progress` is told
    each batch as it starts (`batch 3 of 10`)."""
    rank, world = _rank_and_world()
    mine = examples[rank::world]
    per_rank = -(-len(examples) // world)
    filler = [examples[0]] * (per_rank - len(mine)) if examples else []  # answered for lockstep, then dropped
    padded = mine + filler
    generated = []
    starts = range(0, per_rank, cfg.batch_size)
    for index, start in enumerate(starts):
        if progress is not None:
            progress(f"batch {index + 1} of {len(starts)}")
        batch = padded[start : start + cfg.batch_size]
        prompts = [cfg.prompt_template.format(question=example.question) for example in batch]
        generated += generate_batch(model, tokenizer, prompts, cfg, synced=world > 1)
    return [Answered(example, text, parse_answer(text, cfg.prompt_template.format(question=example.question)))
            for example, text in zip(mine, generated, strict=False)]  # fmt: skip


def generation_metrics(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: EvalConfig, prefix: str = "eval/"
) -> dict[str, float]:
    """`{prefix}{set}/{metric}` for every Q/A set of `cfg`, over all ranks; call it on every rank.

    `model` is the HF causal LM (under the trainer: `engine.module.lm`); its train/eval mode is restored.
    """
    return summarise_sets(answer_sets(model, tokenizer, cfg), prefix)


def answer_sets(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: EvalConfig,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[Answered]]:
    """This rank's answers (every world-th question) to every Q/A set of `cfg`, by set label; call on every rank.
    `progress` is told the set and batch under way (`ntl-pretrain eval`; the trainer prints its own lines)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return {
                qa.label: answer_rank_share(
                    model, tokenizer, load_qa_set(qa, cfg.max_examples), cfg, _labelled(progress, qa.label)
                )
                for qa in cfg.qa_sets
            }
    finally:
        model.train(was_training)


def _labelled(progress: Callable[[str], None] | None, label: str) -> Callable[[str], None] | None:
    return None if progress is None else lambda what: progress(f"answering {label}: {what}")


def summarise_sets(answered: dict[str, list[Answered]], prefix: str = "eval/") -> dict[str, float]:
    """Metrics of every set from each rank's `answer_sets`, all-reduced; call on every rank."""
    metrics = {}
    for label, answers in answered.items():
        metrics.update({f"{prefix}{label}/{key}": value for key, value in set_metrics(answers).items()})
    return metrics


def gather_answers(answered: dict[str, list[Answered]]) -> dict[str, list[Answered]]:
    """Every rank's `answer_sets` merged back into question order (rank r answered questions r, r + world, ...);
    call on every rank."""
    world = _rank_and_world()[1]
    if world == 1:
        return answered
    shares: list[dict[str, list[Answered]]] = [{} for _ in range(world)]
    dist.all_gather_object(shares, answered)
    merged = {}
    for label in answered:
        in_order: list[Answered] = [None] * sum(len(share[label]) for share in shares)  # type: ignore[list-item]
        for rank, share in enumerate(shares):
            in_order[rank::world] = share[label]
        merged[label] = in_order
    return merged


def answer_records(answered: dict[str, list[Answered]]) -> list[dict]:
    """One JSON-ready record per question: what was asked, the reference, the generated text and its number."""
    return [
        {
            "set": label,
            "question": item.example.question,
            "answer": item.example.answer,
            "generated": item.generated,
            "parsed": None if item.parsed is None else str(item.parsed),
            "exact": item.parsed is not None and item.parsed == item.example.answer_value,
        }
        for label, answers in answered.items()
        for item in answers
    ]


def _all_reduced(tensor: torch.Tensor, op) -> torch.Tensor:
    if _rank_and_world()[1] > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
