"""The training loop: DeepSpeed ZeRO-3 engine, CE + λ·NTL step normalised over the global batch, eval,
checkpoint/resume, metrics.

Launch: `deepspeed --num_gpus N --module ntl_pretrain.train RECIPE [key.path=value ...]` (on CPU, N counts
processes and DS_ACCELERATOR=cpu), or `ntl-pretrain train RECIPE --nproc N` which wraps it.

Shapes: B micro-batch, T sequence.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ntl_pretrain.checkpoint import reshard
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.loading import dump_recipe
from ntl_pretrain.config.recipe import Recipe
from ntl_pretrain.data import build_dataloader
from ntl_pretrain.data.hub import list_for_all_ranks
from ntl_pretrain.evaluation import generation_metrics
from ntl_pretrain.heads.router_aux import balancing_line
from ntl_pretrain.loss.number_level import count_numbers
from ntl_pretrain.model.build import BuiltModel, build_model, count_parameters, model_flops_per_token, parameter_groups
from ntl_pretrain.model.document_attention import needs_varlen_arguments, varlen_arguments
from ntl_pretrain.optim.optimizer import build_optimizer, optimizer_kind
from ntl_pretrain.optim.schedule import lr_multiplier, warmup_note
from ntl_pretrain.reporting.console import RunConsole, startup_line
from ntl_pretrain.reporting.metrics import MetricsLogger, device_peak_flops, logged_steps, mfu, peak_memory_mib
from ntl_pretrain.reporting.profiling import StepProfiler
from ntl_pretrain.runtime import lifeline
from ntl_pretrain.runtime.process_group import (
    slow_work_group,
)
from ntl_pretrain.runtime.stopping import EXIT_STOPPED, StopRequest
from ntl_pretrain.tokenizer import load_tokenizer
from ntl_pretrain.train import resume_guard
from ntl_pretrain.train.engine import compile_model, engine_config, name_data_parallel_layout
from ntl_pretrain.train.zero3_bookkeeping import streamline_zero3, with_zero3
from ntl_pretrain.train.zero_optimizer import streamline

IGNORE_INDEX = -100
FAST_PATH_LOG = "logs/deepspeed-fast-path.txt"  # in the output folder: which DeepSpeed replacements run, and why not


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a NaN/inf loss or gradient."""


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Owns the engine, the data iterator and the run state (step, tokens seen, skipped steps)."""

    def __init__(self, recipe: Recipe, ds_config: dict, stop: StopRequest | None = None):
        import deepspeed

        self.recipe = recipe
        self.stop = stop or StopRequest(recipe.train.stop_grace_seconds)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.output_dir = Path(recipe.train.output_dir)
        set_seed(recipe.seed)
        self.resume_point = checkpoint.resolve_verified_resume(
            recipe.train.resume, str(self.output_dir), recipe.checkpoint.verify
        )
        self.resume_from = self.resume_point.folder
        self.tokenizer = load_tokenizer(self._tokenizer_spec(), trust_remote_code=recipe.tokenizer.trust_remote_code)
        # before anything is loaded or written
        resume_guard.check_resume(self.resume_from, recipe, self.tokenizer, ds_config["train_batch_size"])
        saved_config = None if self.resume_from is None else self.resume_from / checkpoint.HF_CONFIG
        self.built: BuiltModel = build_model(recipe, self.tokenizer, ds_config, saved_config)
        self.head = self.built.module.head
        self.varlen_attention = needs_varlen_arguments(self.built.attention, recipe.data.per_document_attention)
        groups = parameter_groups(self.built.module, recipe.optimizer.weight_decay)
        # The launcher hid the GPUs from ranks that run on CPU (cli.launch_environment).
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.optimizer_kind = optimizer_kind(ds_config, device_type)
        optimizer = build_optimizer(groups, recipe.optimizer, self.optimizer_kind)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(recipe.schedule, recipe.train.max_steps))
        ds_config = reshard.prepare_resume(self.resume_from, ds_config, self.world_size)
        ds_config = engine_config(ds_config, recipe, self.built.module.lm)
        name_data_parallel_layout(self.built.module, ds_config["zero_optimization"]["stage"])
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.built.module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        # collectives: the ranks agree on the replacements (the optimizer's, then ZeRO-3's bookkeeping)
        self.fast_path = with_zero3(streamline(self.engine.optimizer), streamline_zero3(self.engine))
        if recipe.train.compile:
            compile_model(self.engine, self.built.module.lm)
        self.head.attach(self.engine)
        self.grad_accum = ds_config["gradient_accumulation_steps"]
        # One listing of each hub dataset for the whole run, not one per reader (data/hub.py).
        self.hub_listings = list_for_all_ranks([*recipe.data.sources, *recipe.data.validation], slow_work_group())
        self.loader = self._dataloader("train")
        self.step, self.tokens_seen, self.skipped_steps, self.nonfinite_in_a_row = 0, 0, 0, 0
        # The newest checkpoint this run wrote whole or resumed from: its step, and its folder (whatever it is named).
        self.last_saved_step: int | None = None
        self.last_checkpoint: Path | None = None
        set_seed(recipe.seed + self.rank)  # dropout differs between ranks; the weights were initialised alike
        self.flops_per_token = model_flops_per_token(self.built.module.lm, recipe.data.seq_len,
                                                     self.head.parameters_outside_model())  # fmt: skip
        self.device_peak_flops = device_peak_flops(self.engine.device, recipe.train.precision)

    def _tokenizer_spec(self) -> str:
        spec = self.recipe.tokenizer.path or self.recipe.init_from
        if spec is None and self.resume_from is not None:
            spec = str(self.resume_from / checkpoint.TOKENIZER)
        if spec is None:
            raise ValueError("tokenizer.path: null, and there is neither init_from nor a checkpoint to resume")
        return spec

    def _dataloader(self, split: str):
        return build_dataloader(
            self.recipe.data,
            self.tokenizer,
            micro_batch_size=self.recipe.train.micro_batch_size,
            dp_rank=self.rank,
            dp_world_size=self.world_size,
            seed=self.recipe.seed,
            split=split,
            grad_accum=self.grad_accum,
            hub_listings=self.hub_listings,
        )

    # ---- run -----------------------------------------------------------------------------------------------

    def train(self) -> bool:
        """Train to `train.max_steps`; False when a stop signal ended the run early (after saving)."""
        self.resume()
        self.console = self._make_console()
        self._announce_start()
        self.logger = self._make_logger()
        resumed_at = self.step
        steps = self._step_batches()
        profiler = self._make_profiler()
        try:
            while self.step < self.recipe.train.max_steps:
                waited = time.perf_counter()
                batches = next(steps)
                profiler.before(self.step + 1)
                record = self.train_step(batches, data_seconds=time.perf_counter() - waited)
                profiler.after(self.step)
                if self.step == resumed_at + 1:
                    self._take_output_dir(resumed_at)
                    self._say_if_ntl_has_nothing(record)
                self.logger.log(record)
                self.console.step(record)
                self._stop_if_nonfinite()
                self._save_and_evaluate_when_due()
                # A stop asked for during the last step (its save, say) ends the run finished, not stopped.
                if self._stop_agreed() and self.step < self.recipe.train.max_steps:
                    self._stop_early()
                    return False
            self._finish()
        finally:
            profiler.close()
            self.console.close()
            self.logger.close()
        return True

    def _make_profiler(self) -> StepProfiler:
        return StepProfiler(self.recipe.logging.profile_steps, self.output_dir, torch.device(self.engine.device),
                            dist.get_rank(), self.console.say)  # fmt: skip

    def _step_batches(self) -> Iterator[list[dict]]:
        """Each step's micro-batches. The first step's are read before any rank enters the step's collectives, and
        the ranks wait for each other in the slow-work group: a hub stream's first batch (resolving files, opening
        connections, filling the shuffle buffer) can take one rank longer than `train.dist_timeout_seconds`."""
        batches = iter(self.loader)
        first = [next(batches) for _ in range(self.grad_accum)]
        dist.barrier(group=slow_work_group())
        yield first
        while True:
            yield [next(batches) for _ in range(self.grad_accum)]

    def _announce_start(self) -> None:
        """The run's first line says where it starts from (the same command starts and continues a run), the
        second its shape, a third for a mixture of experts how its routers are balanced, the last which of
        DeepSpeed's internals the trainer replaces (train/zero_optimizer.py, train/zero3_bookkeeping.py)."""
        if self.resume_from is not None:
            where = f"resuming from {self.resume_from} (step {self.step})"
            if self.recipe.init_from is not None:
                where += f"; init_from {self.recipe.init_from} is not loaded"
        elif self.recipe.init_from is not None:
            where = f"starting from the weights of init_from {self.recipe.init_from}"
        else:
            where = "starting from scratch"
        self.console.say(f"{self.output_dir}: {where}; attention {self.built.attention}; AdamW {self.optimizer_kind}")
        train = self.recipe.train
        self.console.say(startup_line(count_parameters(self.built.module.lm), self.world_size, train.micro_batch_size,
                                      train.global_batch_size, self.grad_accum, self.recipe.data.seq_len,
                                      train.precision))  # fmt: skip
        warmup = warmup_note(self.recipe.schedule, train.max_steps)
        if warmup is not None and lifeline.VARIABLE not in os.environ:  # `ntl-pretrain train` said it before launch
            self.console.say(f"note: {warmup}")
        balancing = balancing_line(self.built.module.lm, self.built.module.balancing)
        if balancing is not None:
            self.console.say(balancing)
        self.console.say(self.fast_path.line())

    def _stop_agreed(self) -> bool:
        """Whether any rank got a stop signal (one small all-reduce per step, so all ranks stop at the same step)."""
        flag = torch.tensor([1.0 if self.stop.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stop_signal(self) -> str | None:
        """The signal that stopped the run, whichever rank got it (rank 0, which logs it, may have got none)."""
        names = [None] * self.world_size
        dist.all_gather_object(names, self.stop.signal_name)
        return next((name for name in names if name is not None), None)

    def _stop_early(self) -> None:
        """Checkpoint the step just finished and record the stop; the same command continues from here."""
        if self.last_saved_step != self.step:
            self._checkpoint()
        self.logger.log({"step": self.step, "split": "stop", "signal": self._stop_signal()})
        self.console.close_bar()
        self.console.say(f"saved step {self.step}; stopping (exit code {EXIT_STOPPED})")

    def _make_console(self) -> RunConsole:
        logging = self.recipe.logging
        return RunConsole(
            enabled=self.rank == 0,
            total_steps=self.recipe.train.max_steps,
            first_step=self.step,
            first_tokens=self.tokens_seen,
            progress_bar=logging.progress_bar,
            every_steps=logging.console_every_steps,
            every_seconds=logging.console_every_seconds,
        )

    def _make_logger(self) -> MetricsLogger:
        return MetricsLogger(str(self.output_dir), enabled=self.rank == 0, wandb_settings=self._wandb_settings())

    def _log_evaluation(self, record: dict) -> None:
        self.logger.log(record)
        self.console.evaluated(record)

    # What takes seconds to minutes between steps is announced first, so that a console is never silent for long.
    def _checkpoint(self) -> None:
        with self.console.doing(f"saving checkpoint step {self.step}"):
            self.save()

    def _validate(self) -> None:
        with self.console.doing(f"validating at step {self.step}"):
            record = self.evaluate()
        self._log_evaluation(record)

    def _generate(self) -> None:
        with self.console.doing(f"generating answers to eval.qa_sets at step {self.step}"):
            record = self.generation_eval()
        self._log_evaluation(record)

    def _save_and_evaluate_when_due(self) -> None:
        """The step's checkpoint first: an evaluation that fails must not cost it."""
        eval_every, save_every = self.recipe.train.eval_every_steps, self.recipe.checkpoint.every_steps
        if save_every and self.step % save_every == 0:
            self._checkpoint()
        if eval_every and self.step % eval_every == 0:
            self._validate()
        generate_every = self.recipe.eval.every_steps
        if generate_every and self.step % generate_every == 0:
            self._generate()

    def _finish(self) -> None:
        """The last step is always checkpointed and, when evaluation is on, evaluated; then the summary."""
        if self.last_saved_step != self.step:
            self._checkpoint()
        eval_every = self.recipe.train.eval_every_steps
        if eval_every and self.step % eval_every:
            self._validate()
        generate_every = self.recipe.eval.every_steps
        if generate_every and self.step % generate_every:
            self._generate()
        self.console.summary(self.last_checkpoint, self.output_dir)

    def _wandb_settings(self) -> dict | None:
        logging = self.recipe.logging
        if not logging.wandb:
            return None
        return {
            "project": logging.wandb_project,
            "name": logging.wandb_run_name,
            "dir": str(self.output_dir),
            "config": dataclasses.asdict(self.recipe),
            **({"mode": "offline"} if logging.wandb == "offline" else {}),
        }

    # ---- step ----------------------------------------------------------------------------------------------

    def train_step(self, batches: list[dict], data_seconds: float = 0.0) -> dict:
        """One optimizer update from `grad_accum` micro-batches, normalised by the global batch's counts.
        `data_seconds`: how long the step waited for its batches, counted in its tokens/s (and so in MFU).

        Each micro-batch's loss is this rank's share of the global-batch loss `ΣCE/N + λ·ΣNTL/N_num` (for a MoE plus
        `w·aux/M`, M micro-batches in the global batch: heads/router_aux.py). DeepSpeed averages gradients over
        data-parallel ranks; the world-size factor turns that mean back into the sum of the ranks' shares, so the
        update equals the single-process gradient of the global-batch loss.
        """
        started = time.perf_counter()
        counts = self._global_counts(batches)
        num_tokens, num_number_tokens, num_inputs, micro_batches = counts.tolist()
        normalisers = head_normalisers(counts, self.engine.device)
        lr = self.optimizer.param_groups[0]["lr"]
        sums = torch.zeros(3, dtype=torch.float64, device=self.engine.device)  # read once per step: no host sync
        for index, batch in enumerate(batches, start=1):
            out = self.engine(**self._to_device(batch), num_tokens=normalisers[0], num_number_tokens=normalisers[1],
                              micro_batches=micro_batches)  # fmt: skip
            self.engine.backward(out.loss * self.world_size, scale_wrt_gas=False)
            if index == len(batches):
                self.head.before_engine_step()
            self.engine.step()
            aux_loss = out.ce.new_zeros(()) if out.aux_loss is None else out.aux_loss
            sums += torch.stack([out.ce.detach().double(), out.ntl.detach().double(), aux_loss.double()])
        self.head.after_engine_step(self.engine)
        dist.all_reduce(sums)
        ce_sum, ntl_sum, aux_sum = sums.tolist()
        ce, ntl = ce_sum / max(num_tokens, 1), ntl_sum / max(num_number_tokens, 1)
        aux_loss = aux_sum / micro_batches if self.built.module.balancing is not None else None
        self.step += 1
        self.tokens_seen += int(num_inputs)
        self._count_nonfinite(self._objective(ce, ntl, aux_loss))
        step_seconds = time.perf_counter() - started
        seconds = step_seconds + data_seconds
        record = self._step_record(ce, ntl, aux_loss, lr, num_inputs / seconds, num_number_tokens / max(num_tokens, 1))
        # Both parts of the step's time (rank 0's): the doctor's throughput row judges the model step apart from
        # a loader that cannot keep up.
        timing = {"step_seconds": step_seconds, "data_seconds": data_seconds}
        return {**record, **timing, "peak_mem_mib": self._peak_memory_mib()}

    def _peak_memory_mib(self) -> float:
        """The largest of the ranks' peaks (`metrics.peak_memory_mib`)."""
        peak = torch.tensor([peak_memory_mib(self.engine.device)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item()

    def _global_counts(self, batches: list[dict]) -> torch.Tensor:
        """[label tokens, NTL terms (number-label tokens, or numbers for kind number), input tokens, micro-batches]
        over all micro-batches and ranks (one all-reduce)."""
        classes = None if self.built.number_vocab is None else self.built.number_vocab.classes
        ntl = self.recipe.loss.ntl
        counts = torch.zeros(4, dtype=torch.float64)
        for batch in batches:
            labels_BT = batch["labels"]
            number_labels_BT = batch.get("ntl_labels", labels_BT)  # where NTL applies (packing.make_batch)
            counts[0] += (labels_BT != IGNORE_INDEX).sum()
            if classes is not None and ntl.kind == "number":  # one NTL term per number, not per number token
                counts[1] += count_numbers(number_labels_BT, self.built.number_vocab, float_level=ntl.float_level)
            elif classes is not None:
                counts[1] += ((number_labels_BT != IGNORE_INDEX) & (classes[number_labels_BT.clamp(min=0)] >= 0)).sum()
            counts[2] += labels_BT.numel()
            counts[3] += 1
        dist.all_reduce(counts)
        return counts

    def _to_device(self, batch: dict) -> dict:
        """The model's inputs of a micro-batch on the rank's device, with flash-attention 2's document boundaries when
        it needs them; on CUDA through pinned memory, so the copy does not block."""
        keys = [key for key in ("input_ids", "labels", "position_ids", "ntl_labels") if key in batch]
        inputs = {key: batch[key] for key in keys}
        if self.varlen_attention:
            inputs.update(varlen_arguments(batch["position_ids"]))
        cuda = self.engine.device.type == "cuda"
        return {key: (value.pin_memory() if cuda else value).to(self.engine.device, non_blocking=cuda)
                if torch.is_tensor(value) else value for key, value in inputs.items()}  # fmt: skip

    def _count_nonfinite(self, loss: float) -> None:
        """DeepSpeed skips the update when the gradient norm is not finite; count those steps."""
        if math.isfinite(loss) and self.engine.was_step_applied():
            self.nonfinite_in_a_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1

    def _stop_if_nonfinite(self) -> None:
        if self.nonfinite_in_a_row >= self.recipe.train.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"step {self.step}: {self.nonfinite_in_a_row} steps in a row had a non-finite "
                f"loss or gradient (train.max_nonfinite_steps)"
            )

    def _objective(self, ce: float, ntl: float, aux_loss: float | None) -> float:
        """The step's global-batch loss: `ce + λ·ntl`, plus `w·aux_loss` for a MoE with a balancing loss."""
        loss = ce + self.recipe.loss.ntl.weight * ntl
        return loss if aux_loss is None else loss + self.built.module.balancing.weight * aux_loss

    def _step_record(self, ce: float, ntl: float, aux_loss: float | None, lr: float, tokens_per_s: float,
                     number_fraction: float) -> dict:  # fmt: skip
        peak = self.recipe.logging.peak_flops_per_device or self.device_peak_flops
        record = {
            "step": self.step,
            "loss": self._objective(ce, ntl, aux_loss),
            "ce": ce,
            "ntl": ntl,
            **({} if aux_loss is None else {"aux_loss": aux_loss}),
            "lr": lr,
            "grad_norm": _float_or_none(self.engine.get_global_grad_norm()),
            "tokens": self.tokens_seen,
            "tokens_per_s": tokens_per_s,
            "number_token_fraction": number_fraction,
            "mfu": mfu(self.flops_per_token, tokens_per_s, peak, self.world_size),
            "skipped_steps": self.skipped_steps,
        }
        record.update({f"data/{key}": value for key, value in self.loader.metrics(all_ranks=True).items()})
        return record

    # ---- eval ----------------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """Validation CE / NTL over the data validation split, summed over all ranks; with NTL on, also the CE at
        number labels (`val_number_ce`, what `ntl-pretrain eval` reports too); with Q/A validation sources, CE and
        NTL at their answer labels alone (`val_answer_ce`, `val_answer_ntl`), from a second forward."""
        answers = self.recipe.data.answer_labels
        sums = torch.zeros(9 if answers else 5, dtype=torch.float64)
        self.engine.eval()
        with torch.no_grad():
            for batch in self._lockstep(self._dataloader("validation")):
                outs = [self.engine(**self._to_device(batch))]
                if answers:
                    outs.append(self.engine(**self._to_device(answer_labels_only(batch))))
                terms = [outs[0].number_ce]
                terms += [term for out in outs for term in (out.ce, out.ntl, out.num_tokens, out.num_number_tokens)]
                sums += torch.tensor([float(term) for term in terms], dtype=torch.float64)
        self.engine.train()
        dist.all_reduce(sums)
        number_ce, ce, ntl, tokens, number_tokens, *answer_sums = sums.tolist()
        ce, ntl = ce / max(tokens, 1), ntl / max(number_tokens, 1)
        record = {
            "step": self.step,
            "split": "validation",
            "val_loss": ce + self.recipe.loss.ntl.weight * ntl,
            "val_ce": ce,
            "val_ntl": ntl,
            "val_tokens": int(tokens),
            "val_number_tokens": int(number_tokens),
        }
        if self.built.number_vocab is not None:  # a CE-only run does not know which labels are numbers
            record["val_number_ce"] = number_ce / max(number_tokens, 1)
        if answers:
            answer_ce, answer_ntl, answer_tokens, answer_number_tokens = answer_sums
            record["val_answer_ce"] = answer_ce / max(answer_tokens, 1)
            record["val_answer_ntl"] = answer_ntl / max(answer_number_tokens, 1)
        return record

    def generation_eval(self) -> dict:
        """Greedy answers to the recipe's question/answer sets (`eval:`): exact match, MAE, R², digit accuracy."""
        metrics = generation_metrics(self.engine.module.lm, self.tokenizer, self.recipe.eval)
        return {"step": self.step, "split": "eval", **metrics}

    def _lockstep(self, loader) -> Iterator[dict]:
        """Yield batches until every rank is exhausted; a rank that runs out first feeds all-ignored batches,
        because every ZeRO-3 forward gathers parameters collectively."""
        limit = self.recipe.train.eval_max_batches
        batches, template, count = iter(loader), None, 0
        while limit is None or count < limit:
            batch = next(batches, None)
            has_batch = torch.tensor([0.0 if batch is None else 1.0])
            dist.all_reduce(has_batch, op=dist.ReduceOp.MAX)
            if has_batch.item() == 0:
                return
            if batch is None:
                batch = template if template is not None else self._empty_batch()
                batch = {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX)}
            template, count = batch, count + 1
            yield batch

    def _empty_batch(self) -> dict:
        """A validation batch's keys and shapes (every rank must run the same forwards)."""
        shape = (self.recipe.train.micro_batch_size, self.recipe.data.seq_len)
        positions_BT = torch.arange(shape[1]).expand(shape).contiguous()
        batch = {
            "input_ids": torch.zeros(shape, dtype=torch.long),
            "labels": torch.zeros(shape, dtype=torch.long),
            "position_ids": positions_BT,
        }
        if self.recipe.data.answer_labels:
            batch["answer_mask"] = torch.zeros(shape, dtype=torch.bool)
        return batch

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save(self) -> Path:
        client_state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
        }
        root = checkpoint.checkpoints_root(self.output_dir)
        folder = checkpoint.save(
            self.engine,
            root,
            self.step,
            client_state,
            self.recipe.checkpoint.keep_last,
            self._write_export_files,
            self._write_rank_files,
        )
        self.last_saved_step, self.last_checkpoint = self.step, folder  # only once it is whole: a failed save is none
        return folder

    def _write_rank_files(self, folder: Path) -> None:
        checkpoint.write_rank_state(folder, {"data": self.loader.state_dict(), "rng": checkpoint.rng_state()})
        self.head.save(folder)

    def _write_export_files(self, folder: Path) -> None:
        self.built.module.lm.config.save_pretrained(folder / checkpoint.HF_CONFIG)
        self.tokenizer.save_pretrained(folder / checkpoint.TOKENIZER)
        (folder / "recipe.yaml").write_text(dump_recipe(self.recipe))
        resume_guard.write_data_fingerprint(folder, self.recipe)

    def _say_if_ntl_has_nothing(self, record: dict) -> None:
        """NTL on, and the run's first step held no label NTL acts on: `ntl 0` would be all the console says."""
        ntl = self.recipe.loss.ntl
        if ntl.kind is not None and record["number_token_fraction"] == 0:
            self.console.say(f"note: step {self.step} held no label NTL acts on (a number token), so NTL (weight "
                             f"{ntl.weight:g}) learned nothing in it; if the data holds no numbers it never will "
                             f"(`ntl-pretrain data preview` shows them)")  # fmt: skip

    def _take_output_dir(self, resumed_at: int) -> None:
        """The first step has run: only now does the run change its output folder, so that a launch that dies
        before it (a model, data or memory error) leaves the folder as it was and the same command runs again."""
        if self.rank == 0:
            prepare_output_dir(self.recipe)
            checkpoint.set_aside(self.resume_point.skipped)
            (self.output_dir / FAST_PATH_LOG).parent.mkdir(exist_ok=True)
            (self.output_dir / FAST_PATH_LOG).write_text(self.fast_path.details())
        dist.barrier()  # no rank starts a save (step_<N>.tmp) while rank 0 still removes the leftover ones
        self._log_resume(resumed_at)

    def _log_resume(self, step: int) -> None:
        """One `split: resume` record: where the run continued from and the damaged checkpoints passed over."""
        point = self.resume_point
        if point.folder is not None or point.skipped:
            resumed_from = None if point.folder is None else str(point.folder)
            record = {"step": step, "split": "resume", "resumed_from": resumed_from}
            self.logger.log({**record, "skipped_checkpoints": point.skipped})
        elif logged_steps(self.logger.path):
            # Killed before its first checkpoint: this attempt logs steps 1, 2, ... again; readers drop the old ones.
            self.logger.log({"step": 0, "split": "restart"})

    def resume(self) -> None:
        folder = self.resume_from
        if folder is None:
            return
        state = reshard.load(self.engine, folder)  # re-partitions weights and optimizer state for a new world size
        self.head.load(folder)
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]
        self.last_saved_step, self.last_checkpoint = self.step, folder
        # Checkpoints written before per-rank state files hold every rank's state in the client state.
        per_rank = state.get("per_rank") or checkpoint.SavedRankStates(folder, state["world_size"])
        self.loader.load_world_state(checkpoint.Part(per_rank, "data"))
        if state["world_size"] == self.world_size:  # on a new world size every rank keeps its fresh dropout seed
            checkpoint.set_rng_state(per_rank[self.rank]["rng"])
        self._apply_recipe_schedule(folder)

    def _apply_recipe_schedule(self, folder: Path) -> None:
        """The recipe's learning rate and schedule from the resumed step on (docs/training.md), logged when they
        differ from the checkpoint's, so that the run's recipe.yaml describes what it does."""
        schedulers = [self.scheduler, *([self.head.scheduler] if hasattr(self.head, "scheduler") else [])]
        resume_guard.apply_recipe_learning_rate(schedulers, self.recipe.optimizer.lr)
        changes = resume_guard.schedule_changes(folder, self.recipe)
        if changes and self.rank == 0:
            listed = "; ".join(map(str, changes))
            message = f"resuming step {self.step} with the recipe's {listed} (checkpoint → recipe, from the next step)"
            print(f"ntl-pretrain: {message}", file=sys.stderr, flush=True)


def answer_labels_only(batch: dict) -> dict:
    """`batch` with every label outside a Q/A record's answer ignored (`answer_mask`, packing.make_batch)."""
    answer_BT = batch["answer_mask"]
    return {**batch, "labels": torch.where(answer_BT, batch["labels"], IGNORE_INDEX)}


def head_normalisers(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[label tokens, NTL terms] of the global batch (at least 1 each), fp32 on the device: one copy per step.
    Python numbers would cost the heads a host-to-device copy each per micro-batch (`torch.as_tensor`), and such
    a copy from pageable memory waits for the device to catch up."""
    return counts[:2].clamp_min(1).to(device, torch.float32)


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def prepare_output_dir(recipe: Recipe) -> None:
    """Rank 0, once the run has passed every check and trained its first step: remove what a killed save left,
    and with `train.overwrite` the earlier run; then write the recipe this run follows."""
    output_dir = Path(recipe.train.output_dir)
    checkpoint.remove_leftover_saves(output_dir)
    if recipe.train.overwrite:
        shutil.rmtree(checkpoint.checkpoints_root(output_dir), ignore_errors=True)
        (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "recipe.yaml").write_text(dump_recipe(recipe))
