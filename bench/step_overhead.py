"""Our training step against a plain PyTorch step of the same model, head, clipping and AdamW: what the training
stack costs on the host, measured side by side in one process.

The toy is issue 47's: a 30-layer Llama of hidden 64 (272 parameters, as many as SmolLM2-135M's), vocabulary 4,096
tied, sequence 64, micro-batch 2, one rank, in fp32 and then in bf16 (`--precision`). Its arithmetic is small, so,
like the 135M model on an H100, a step costs what is dispatched per parameter and per module; the CPU ratio matched
the H100's (4.1 against 4.3). bf16 is what a GPU run trains in, and DeepSpeed's bf16 ZeRO-1/2 step has costs fp32
has not (issue 56): fp32 alone read 1.15x at ZeRO-2 where the H200 read 1.68x. On the 2-core CI machine a bf16
matmul of the toy's size costs ~3x an fp32 one, the same in every configuration, so bf16 ratios are closer to 1.

- plain: the model and our chunked CE + λ·NTL head as plain modules (no DeepSpeed), fp32 weights (in bf16 under
  `torch.autocast`, as bench/plain_step.py on a GPU), the global-batch normalisers, `loss.backward()`,
  `clip_grad_norm_` (foreach), torch's AdamW, the recipe's schedule, one `.item()` a step;
- ours: `Trainer.train_step` through the DeepSpeed engine, with the recipe's defaults; each `--variant` adds one
  more with its overrides (e.g. `--variant "zero2 deepspeed.zero_stage=2"`); words among them give the variant
  DeepSpeed's own code back where the trainer replaces it: `deepspeed-norm` its per-parameter gradient norm
  (train/zero_optimizer.py), `deepspeed-step` its bf16 ZeRO-1/2 step (the per-gradient finite scan, the per-parameter
  copy-back of reduced gradients, the re-pointing of every weight, train/zero_optimizer.py) and its throughput timer,
  `deepspeed-functions` ZeRO-3's autograd Functions as DeepSpeed applies them (the linear layer and each module's
  backward hooks; the trainer applies them classically: train/zero3_functions.py), `deepspeed-bookkeeping` ZeRO-3's
  NVTX ranges, debug lines and release of every parameter at the step (train/zero3_bookkeeping.py);
  `without-module-hooks` takes ZeRO-3's module hooks out altogether, a bound on what cutting their bookkeeping can
  reach (`take_out_module_hooks`: at one rank, or where every parameter is persistent).
Every step runs plain and each of ours on the same batch, in an order rotated every step. Each of ours is checked
against a plain twin loaded with its engine's initial weights (the timed plain step is ours' twin): their losses
must agree step by step (printed: `max |Δ loss|`, the largest difference over the run).
Printed per precision and configuration: the median ms per step, the median of the per-step ratios to plain, aten
ops per step (torch.profiler; in all, and in the forward, the backward and the optimizer step) and Python function
calls per step (cProfile), the last two counted over separate steps; then
the median ms per step of each part (forward; backward and the engine's gradient reduce and partition in it; the
optimizer step and in it the gradient norm, the optimizer's update, and at ZeRO-3 the release of every parameter
and the re-gathering of the persistent ones), timed during the same interleaved steps.

    python bench/step_overhead.py [--steps 30] [--precision fp32 bf16] [KEY=VALUE ...]
        [--variant "NAME [deepspeed-norm] [deepspeed-step] [deepspeed-functions] [deepspeed-bookkeeping]
                    [without-module-hooks] KEY=VALUE ..."]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import os
import pstats
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.heads import build_head
from ntl_pretrain.model.build import CausalLMWithLoss, parameter_groups
from ntl_pretrain.optim.optimizer import build_optimizer
from ntl_pretrain.optim.schedule import lr_multiplier
from ntl_pretrain.runtime.process_group import free_port
from ntl_pretrain.train import trainer as trainer_module
from ntl_pretrain.train import zero3_bookkeeping
from ntl_pretrain.train.main import init_distributed, quiet_console
from ntl_pretrain.train.trainer import IGNORE_INDEX, Trainer
from ntl_pretrain.train.zero_optimizer import FastPath

REPO = Path(__file__).resolve().parents[1]
TOY = [
    "model.config.num_hidden_layers=30",
    "model.config.vocab_size=4096",
    "model.config.tie_word_embeddings=true",
    "data.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every_steps=null",
    "logging.progress_bar=false",
]
WARMUP_STEPS = 3
COUNTED_STEPS = 3
DEEPSPEED_NORM = "deepspeed-norm"
DEEPSPEED_STEP = "deepspeed-step"
DEEPSPEED_FUNCTIONS = "deepspeed-functions"
DEEPSPEED_BOOKKEEPING = "deepspeed-bookkeeping"
GIVEN_BACK = (DEEPSPEED_NORM, DEEPSPEED_STEP, DEEPSPEED_FUNCTIONS, DEEPSPEED_BOOKKEEPING)
WITHOUT_MODULE_HOOKS = "without-module-hooks"  # a bound, not a configuration: `take_out_module_hooks`
WORDS = (*GIVEN_BACK, WITHOUT_MODULE_HOOKS)
STEP_REPLACEMENTS = ("check_overflow", "allreduce_and_copy_with_multiple_ranks", "_update_model_bit16_weights")
PHASES = ("forward", "backward", "optimizer step")
PHASE_MARK = "phase: "
PARTS = (
    "forward",
    "backward",
    "of which gradient reduce and partition",
    "optimizer step",
    "of which gradient norm",
    "of which the optimizer's update",
    "of which releasing every parameter",
    "of which re-gathering persistent ones",
)


def single_process_defaults() -> None:
    """Let `python bench/step_overhead.py` run without a launcher (one rank)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


class PartTimes:
    """Per configuration and part, the seconds of each call: timed blocks (the plain step) or wrapped functions."""

    def __init__(self):
        self.seconds: dict[str, dict[str, list[float]]] = {}

    @contextlib.contextmanager
    def timed(self, configuration: str, part: str) -> Iterator[None]:
        """The block's seconds; a phase (`PHASES`) also named for the profiler, which counts its ops apart."""
        marked = record_function(PHASE_MARK + part) if part in PHASES else contextlib.nullcontext()
        started = time.perf_counter()
        try:
            with marked:
                yield
        finally:
            self.seconds.setdefault(configuration, {}).setdefault(part, []).append(time.perf_counter() - started)

    def wrap(self, configuration: str, part: str, owner: object, function: str) -> None:
        if not hasattr(owner, function):
            return
        inner = getattr(owner, function)

        def call(*args, **kwargs):
            with self.timed(configuration, part):
                return inner(*args, **kwargs)

        setattr(owner, function, call)

    def of_ours(self, name: str, trainer: Trainer) -> None:
        engine = trainer.engine
        for part, function in (("forward", "forward"), ("backward", "backward"), ("optimizer step", "step")):
            self.wrap(name, part, engine, function)
        for function in ("_get_norm_groups", "scaled_global_norm"):  # ZeRO-3's; ZeRO-1 and -2's
            self.wrap(name, "of which gradient norm", engine.optimizer, function)
        for part, function in (("of which gradient reduce and partition", "independent_gradient_partition_epilogue"),
                               ("of which the optimizer's update", "_optimizer_step"),  # per parameter group
                               ("of which releasing every parameter", "_partition_all_parameters"),  # ZeRO-3 only
                               ("of which re-gathering persistent ones", "_post_step")):  # fmt: skip
            self.wrap(name, part, engine.optimizer, function)

    def medians_ms(self, configuration: str, steps: int) -> dict[str, float | None]:
        """Each part's median per step over the timed steps (a part called k times a step: its step sums)."""
        found = {}
        for part in PARTS:
            calls = self.seconds.get(configuration, {}).get(part, [])
            per_step = len(calls) // (WARMUP_STEPS + steps)
            if not per_step:  # a part this configuration does not have (the ZeRO-3 ones below stage 3)
                found[part] = None
                continue
            sums = [sum(calls[i : i + per_step]) for i in range(0, per_step * (WARMUP_STEPS + steps), per_step)]
            found[part] = statistics.median(sums[WARMUP_STEPS:]) * 1e3
        return found


class PlainStep:
    """The trainer's model and head as plain modules, loaded with `trainer`'s weights, stepped without DeepSpeed."""

    def __init__(self, trainer: Trainer, parts: PartTimes | None = None):
        import deepspeed

        recipe, built = trainer.recipe, trainer.built
        engine_lm = built.module.lm
        lm = type(engine_lm)(engine_lm.config)  # the class itself: no ZeRO-3 partitioning (from_config would)
        with deepspeed.zero.GatheredParameters(list(engine_lm.parameters())):
            lm.load_state_dict({key: value.clone() for key, value in engine_lm.state_dict().items()})
        self.module = CausalLMWithLoss(lm, build_head(recipe, lm, built.number_vocab))
        self.module.train()
        self.classes = None if built.number_vocab is None else built.number_vocab.classes
        self.ntl_weight, self.grad_clip = recipe.loss.ntl.weight, recipe.optimizer.grad_clip
        groups = parameter_groups(self.module, recipe.optimizer.weight_decay)
        self.optimizer = build_optimizer(groups, recipe.optimizer, "default")
        schedule = lr_multiplier(recipe.schedule, recipe.train.max_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.timed = functools.partial((parts or PartTimes()).timed, "plain")  # a twin's times are dropped
        self.bf16 = recipe.train.precision == "bf16"

    def __call__(self, batches: list[dict]) -> float:
        """One update; returns the global-batch loss `ΣCE/N + λ·ΣNTL/N_num`."""
        with torch_linear(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self._step(batches)

    def _step(self, batches: list[dict]) -> float:
        labels = [batch["labels"] for batch in batches]
        num_tokens = sum((label != IGNORE_INDEX).sum() for label in labels).clamp_min(1).float()
        num_number_tokens = sum(self._number_labels(batch) for batch in batches).clamp_min(1).float()
        sums = torch.zeros(2)
        for batch in batches:
            with self.timed("forward"):
                out = self.module(batch["input_ids"], batch["labels"], batch["position_ids"], num_tokens,
                                  num_number_tokens, batch.get("ntl_labels"))  # fmt: skip
            with self.timed("backward"):
                out.loss.backward()
            sums += torch.stack([out.ce.detach(), out.ntl.detach()])
        with self.timed("optimizer step"):
            if self.grad_clip > 0:
                with self.timed("of which gradient norm"):
                    torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip, foreach=True)
            with self.timed("of which the optimizer's update"):
                self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        ce, ntl = (sums / torch.stack([num_tokens, num_number_tokens])).tolist()
        return ce + self.ntl_weight * ntl

    def _number_labels(self, batch: dict) -> torch.Tensor:
        if self.classes is None:
            return torch.zeros((), dtype=torch.long)
        labels = batch.get("ntl_labels", batch["labels"])
        return ((labels != IGNORE_INDEX) & (self.classes[labels.clamp(min=0)] >= 0)).sum()


def torch_linear() -> contextlib.AbstractContextManager:
    """torch's own `F.linear`: building a model under ZeRO-3 replaces it process-wide with DeepSpeed's
    (`memory_efficient_linear`), which the plain step and a ZeRO-1 or -2 run (its own process never builds under
    ZeRO-3) must not pay for."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    return mock.patch.object(F, "linear", getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", F.linear))


def deepspeed_linear() -> contextlib.AbstractContextManager:
    """DeepSpeed's ZeRO-3 `F.linear` (`zero3_linear_wrap`), which the trainer replaces process-wide."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    return mock.patch.object(F, "linear", zero3_linear_wrap)


def as_in_its_own_process(trainer: Trainer, given_back: frozenset[str]) -> Callable[[list[dict]], dict]:
    """`trainer.train_step`, below ZeRO-3 with torch's `F.linear` (`torch_linear`), at ZeRO-3 with DeepSpeed's where
    `deepspeed-functions` gives it back, else with the trainer's; with DeepSpeed's process-wide bookkeeping (NVTX
    ranges, debug lines) where `deepspeed-bookkeeping` gives it back."""
    if trainer.engine.zero_optimization_stage() != 3:
        linear = torch_linear
    elif DEEPSPEED_FUNCTIONS in given_back:
        linear = deepspeed_linear
    else:
        linear = contextlib.nullcontext
    bookkeeping = zero3_bookkeeping.deepspeeds_own_process_wide
    process_wide = bookkeeping if DEEPSPEED_BOOKKEEPING in given_back else contextlib.nullcontext

    def step(batches: list[dict]) -> dict:
        with linear(), process_wide():
            return trainer.train_step(batches)

    return step


def functions_as_deepspeed_applies_them(given_back: bool) -> contextlib.AbstractContextManager:
    """A trainer built inside leaves its modules' ZeRO-3 backward Functions as DeepSpeed made them."""
    if not given_back:
        return contextlib.nullcontext()
    return mock.patch.object(zero3_bookkeeping, "apply_zero3_functions_classically", lambda module: None)


def bookkeeping_as_deepspeed_does(given_back: bool) -> contextlib.AbstractContextManager:
    """A trainer built inside keeps ZeRO-3's bookkeeping as DeepSpeed has it (its autograd Functions as the trainer
    applies them, unless `deepspeed-functions` gives those back too); the process-wide part is given back around each
    of its steps (`as_in_its_own_process`)."""
    if not given_back:
        return contextlib.nullcontext()

    def classic_only(engine) -> FastPath:
        zero3_bookkeeping.apply_zero3_functions_classically(engine.module)
        return FastPath((), {}, {}, {}, {})

    return mock.patch.object(trainer_module, "streamline_zero3", classic_only)


def build_trainer(overrides: list[str], output_dir: str) -> Trainer:
    run_overrides = [*TOY, *overrides, f"train.output_dir={output_dir}", "train.resume=null"]
    recipe, ds_config = load_run(REPO / "recipes" / "tiny-cpu.yaml", run_overrides, int(os.environ["WORLD_SIZE"]))
    return Trainer(recipe, ds_config)


def parse_variant(text: str) -> tuple[str, list[str], frozenset[str]]:
    """The variant's name, its overrides and which of DeepSpeed's own parts it gets back (or takes out)."""
    name, *words = shlex.split(text)
    return name, [word for word in words if word not in WORDS], frozenset(set(WORDS).intersection(words))


def give_back(trainer: Trainer, given_back: frozenset[str]) -> None:
    """DeepSpeed's own code again where the variant asks for it (the class's methods, the timer it configures)."""
    optimizer = trainer.engine.optimizer
    replaced = [*([] if DEEPSPEED_NORM not in given_back else ["get_grad_norm_direct"]),
                *([] if DEEPSPEED_STEP not in given_back else STEP_REPLACEMENTS)]  # fmt: skip
    for name in replaced:
        vars(optimizer).pop(name, None)
    if DEEPSPEED_STEP in given_back:
        trainer.engine.tput_timer.config.enabled = True


def take_out_module_hooks(trainer: Trainer) -> None:
    """ZeRO-3 without its modules' hooks (the fetch before and release after each module's forward and backward,
    and the autograd Functions they wrap around its inputs and outputs): what the hooks cost at most, which no
    replacement of their bookkeeping can beat. Not a way to train: right only where every parameter stays gathered
    (persistent) or, at one rank, is gathered when first read (ZeRO-3's parameter dict does, and there the gathered
    weight is a view of its partition: the toy's embedding); refused otherwise. The losses are checked against the
    plain twin."""
    engine = trainer.engine
    stage = engine.zero_optimization_stage()
    if stage != 3:
        raise SystemExit(f"{WITHOUT_MODULE_HOOKS}: ZeRO-3 only, this variant is at stage {stage}")
    partitioned = [name for name, param in engine.module.named_parameters() if not getattr(param, "ds_persist", False)]
    if partitioned and dist.get_world_size() > 1:
        raise SystemExit(f"{WITHOUT_MODULE_HOOKS}: {len(partitioned)} parameters are partitioned, not persistent "
                         f"(e.g. {partitioned[0]}): without the hooks nothing would gather them")  # fmt: skip
    offload = engine.optimizer.parameter_offload
    for handle in [*offload.forward_hooks, *offload.backward_hooks]:
        handle.remove()


def aten_ops_per_step(step: Callable[[], object]) -> dict[str, float]:
    """aten ops per step: in all, and in each of `PHASES` (and "other": outside them)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(COUNTED_STEPS):
            step()
    counts = collections.Counter()
    for event in profiler.events():
        if event.name.startswith("aten::"):
            counts["all"] += 1
            counts[phase_of(event)] += 1
    return {key: count / COUNTED_STEPS for key, count in counts.items()}


def phase_of(event) -> str:
    """The phase (`PHASES`) whose marked range the profiled event ran in, else "other"."""
    while event is not None:
        if event.name.startswith(PHASE_MARK):
            return event.name.removeprefix(PHASE_MARK)
        event = event.cpu_parent
    return "other"


def python_calls_per_step(step: Callable[[], object]) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(COUNTED_STEPS):
        step()
    profiler.disable()
    return pstats.Stats(profiler).total_calls / COUNTED_STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every configuration")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after 3 of warm-up)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="one table per precision, each with its own plain step")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        help='"NAME KEY=VALUE ...": one more configuration of ours with these overrides')  # fmt: skip
    args = parser.parse_args()
    single_process_defaults()
    quiet_console(rank=0)
    init_distributed()
    for precision in args.precision:
        with tempfile.TemporaryDirectory() as scratch:
            trainers, given_back = {}, {}
            for name, extra, given_back[name] in [("ours", [], frozenset()), *args.variant]:
                with functions_as_deepspeed_applies_them(DEEPSPEED_FUNCTIONS in given_back[name]), \
                        bookkeeping_as_deepspeed_does(DEEPSPEED_BOOKKEEPING in given_back[name]):  # fmt: skip
                    overrides = [f"train.precision={precision}", *args.overrides, *extra]
                    trainers[name] = build_trainer(overrides, f"{scratch}/{name}")
                give_back(trainers[name], given_back[name])
                if WITHOUT_MODULE_HOOKS in given_back[name]:
                    take_out_module_hooks(trainers[name])
            run_and_report(trainers, given_back, args.steps)
    dist.destroy_process_group()


def run_and_report(trainers: dict[str, Trainer], given_back: dict[str, frozenset[str]], steps: int) -> None:
    """Every step: the plain step and each of ours in turn (timed), then each variant's plain twin (untimed: a
    variant at another ZeRO stage starts from other weights, so its losses are checked against its own twin)."""
    batches = iter(trainers["ours"].loader)
    parts = PartTimes()
    twins = {name: PlainStep(trainer, parts if name == "ours" else None) for name, trainer in trainers.items()}
    runners = {
        "plain": twins["ours"],
        **{name: as_in_its_own_process(trainer, given_back[name]) for name, trainer in trainers.items()},
    }
    times = {name: [] for name in runners}
    for name, trainer in trainers.items():
        parts.of_ours(name, trainer)
    drift = dict.fromkeys(trainers, 0.0)
    for step in range(WARMUP_STEPS + steps):
        micro = [next(batches) for _ in range(trainers["ours"].grad_accum)]
        names, losses = list(runners), {}
        for name in names[step % len(names) :] + names[: step % len(names)]:  # rotate who goes first
            started = time.perf_counter()
            out = runners[name](micro)
            times[name].append(time.perf_counter() - started)
            losses[name] = out if name == "plain" else out["loss"]
        for name in trainers:
            twin_loss = losses["plain"] if name == "ours" else twins[name](micro)
            drift[name] = max(drift[name], abs(losses[name] - twin_loss))
    by_part = {name: parts.medians_ms(name, steps) for name in runners}
    fixed = [next(batches) for _ in range(trainers["ours"].grad_accum)]
    counted = {name: (aten_ops_per_step(lambda run=run: run(fixed)), python_calls_per_step(lambda run=run: run(fixed)))
               for name, run in runners.items()}  # fmt: skip
    print_report(trainers["ours"], times, drift, counted, steps)
    print_parts(by_part)


def print_report(trainer: Trainer, times: dict, drift: dict, counted: dict, steps: int) -> None:
    config, train = trainer.built.module.lm.config, trainer.recipe.train
    print(f"toy: {config.model_type} layers={config.num_hidden_layers} hidden={config.hidden_size} "
          f"vocab={config.vocab_size} tied={config.tie_word_embeddings}; seq_len={trainer.recipe.data.seq_len} "
          f"micro_batch={train.micro_batch_size} grad_accum={trainer.grad_accum} precision={train.precision}; "
          f"{steps} interleaved steps after {WARMUP_STEPS} of warm-up")  # fmt: skip
    print(f"{'configuration':<16}{'ms/step':>10}{'× plain':>10}{'aten ops/step':>16}{'forward':>10}{'backward':>10}"
          f"{'step':>10}{'other':>10}{'Python calls/step':>20}{'max |Δ loss|':>15}")  # fmt: skip
    for name, seconds in times.items():
        timed = seconds[WARMUP_STEPS:]
        ratio = statistics.median(ours / base for ours, base in zip(timed, times["plain"][WARMUP_STEPS:], strict=True))
        ops, calls = counted[name]
        by_phase = "".join(f"{ops.get(phase, 0):>10,.0f}" for phase in (*PHASES, "other"))
        loss_check = "" if name == "plain" else f"{drift[name]:>15.1e}"
        print(f"{name:<16}{statistics.median(timed) * 1e3:>10.1f}{ratio:>10.2f}{ops['all']:>16,.0f}{by_phase}"
              f"{calls:>20,.0f}{loss_check}")  # fmt: skip


def print_parts(by_part: dict[str, dict[str, float | None]]) -> None:
    print(f"{'ms per step, by part':<40}" + "".join(f"{name:>16}" for name in by_part))
    for part in PARTS:
        cells = (by_part[name][part] for name in by_part)
        print(f"{part:<40}" + "".join(f"{'':>16}" if cell is None else f"{cell:>16.1f}" for cell in cells))


if __name__ == "__main__":
    main()
