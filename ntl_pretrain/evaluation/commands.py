"""`ntl-pretrain eval TARGET`: validation CE/perplexity/NTL and generation metrics of a run or an HF folder.

Single process, or one process per device under `torchrun` / `deepspeed` (each rank holds the whole model and
answers its share; sums are all-reduced). Prints one JSON record; `--log-metrics` also appends it to the run's
metrics.jsonl so that `ntl-pretrain plot` shows it beside the training curves. stdout carries that record only
(`ntl-pretrain eval RUN | python -m json.tool` works); progress and library messages go to stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ntl_pretrain.checkpoint.store import verify_before_reading
from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.probe import check_source_files
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.errors import InputError
from ntl_pretrain.evaluation.config import EvalConfig, QaSetConfig
from ntl_pretrain.evaluation.generation import (
    answer_records,
    answer_sets,
    gather_answers,
    summarise_sets,
    uses_chat_template,
)
from ntl_pretrain.evaluation.model_folder import (
    Target,
    check_seq_len,
    export_for_eval,
    model_config,
    recipe_eval,
    recipe_validation,
    resolve_target,
    validation_layout,
)
from ntl_pretrain.evaluation.validation import MICRO_BATCH, sequence_cap, validation_metrics
from ntl_pretrain.outputs import check_output, write_text
from ntl_pretrain.reporting.console import no_library_progress_bars, ongoing, stdout_to_stderr
from ntl_pretrain.reporting.metrics import open_for_append
from ntl_pretrain.runtime.process_group import bind_local_device, default_backend
from ntl_pretrain.tokenizer import resolve_path

EVAL_PREFIX = "ntl-pretrain eval: "
INSTRUCT_MODEL = ("an Instruct model (its end-of-sequence token {eos} ends a turn of its chat template): the questions "
                  "go in as user messages in that template; --chat-template none sends them as text")  # fmt: skip


def evaluate_target(
    path: str | Path,
    cfg: EvalConfig,
    seq_len: int | None = None,
    ntl_kind: str = "was",
    answers_out: Path | None = None,
    per_document_attention: bool | None = None,
    stage: Callable[..., None] = lambda *_, **__: None,
) -> dict:
    """Evaluate a run directory, checkpoint or HF folder; call on every rank of a launch (or without one).

    Validation uses `cfg.validation`, else the run's `data.validation`; none for a bare HF folder without
    `cfg.validation`. `seq_len` and `per_document_attention` default to the run's `data` settings (512 and false
    for an HF folder). `answers_out`: also write every question's generated answer there (jsonl, question order),
    to see which answers were wrong and how. `stage(what, say=True)` is told each stage (`console.ongoing`).
    """
    target = resolve_target(path)
    max_sequences = sequence_cap(cfg.max_validation_batches, *validation_layout(target, MICRO_BATCH))
    with tempfile.TemporaryDirectory(prefix="ntl-eval-") as scratch:
        if target.hf_folder is None:
            stage(f"exporting {target.checkpoint} to a temporary HF folder", say=True)
            target = _export_on_rank0(target, Path(scratch), stage)
        stage("loading the model", say=True)
        model, tokenizer = _load(target.hf_folder)
        if cfg.chat_template is None and uses_chat_template(tokenizer, None):
            stage(INSTRUCT_MODEL.format(eos=tokenizer.eos_token), say=True)
        record: dict = {"step": target.step, "split": "eval", "model": str(path)}
        data = _validation_data(target, cfg, seq_len, per_document_attention)
        if data is not None:
            stage(f"validating on {', '.join(source.label for source in data.validation)}", say=True)
            record.update(validation_metrics(model, tokenizer, data.validation, seq_len=data.seq_len,
                                             max_sequences=max_sequences, ntl_kind=ntl_kind,
                                             per_document_attention=data.per_document_attention))  # fmt: skip
        stage(f"answering {', '.join(qa.label for qa in cfg.qa_sets)} (greedy, batches of {cfg.batch_size})", say=True)
        answered = answer_sets(model, tokenizer, cfg, progress=stage)
        record.update(summarise_sets(answered))
        if answers_out is not None:
            _write_answers(gather_answers(answered), answers_out)
    return record


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_answers(answered: dict, path: Path) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(record) + "\n" for record in answer_records(answered)))


def _export_on_rank0(target: Target, scratch: Path, stage: Callable[[str], None]) -> Target:
    """One rank writes the HF folder; the others wait and read it (same machine: `scratch` is rank 0's)."""
    distributed = dist.is_initialized()
    folder = [None]
    if not distributed or dist.get_rank() == 0:
        folder = [str(export_for_eval(target, scratch, stage).hf_folder)]
    if distributed:
        dist.broadcast_object_list(folder, src=0)
    return Target(Path(folder[0]), target.checkpoint)


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.model import WITHOUT_HUB_KERNELS
    from ntl_pretrain.tokenizer import load_tokenizer

    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **WITHOUT_HUB_KERNELS).to(device)
    return model, load_tokenizer(str(folder))


def _validation_data(
    target: Target, cfg: EvalConfig, seq_len: int | None, per_document_attention: bool | None
) -> DataConfig | None:
    """The held-out sources and how to pack them: what was given, else the run's, else the defaults."""
    run = recipe_validation(target) or DataConfig()
    sources = cfg.validation or run.validation
    if not sources:
        return None
    if per_document_attention is None:
        per_document_attention = run.per_document_attention
    return DataConfig(validation=sources, seq_len=seq_len or run.seq_len, per_document_attention=per_document_attention)


def eval_config_from_args(args: argparse.Namespace, from_run: EvalConfig | None = None) -> EvalConfig:
    """The flags; what they leave out (the question sets, prompt and answer length) comes from the run's own
    `eval:` section when `from_run` has one, so a run is scored on the task it was trained for."""
    task = from_run or EvalConfig()
    cfg = EvalConfig(
        qa_sets=task.qa_sets,
        max_examples=args.max_examples or None,
        max_new_tokens=args.max_new_tokens or task.max_new_tokens,
        batch_size=args.batch_size,
        prompt_template=args.prompt_template or task.prompt_template,
        chat_template=args.chat_template or task.chat_template,
        max_validation_batches=args.max_validation_batches,
    )
    if args.qa:
        cfg = replace(cfg, qa_sets=[QaSetConfig(path=path) for path in args.qa])
        for qa in cfg.qa_sets:
            qa.check()  # every reference answer reads as a number, before the model is loaded
    if args.validation:
        sources = [SourceConfig(path=path, template=args.template) for path in args.validation]
        cfg = replace(cfg, validation=sources)
    cfg.check()
    return cfg


# Flag -> the least it may be; None (not given) means the run's own setting.
LEAST_VALUES = {"max_examples": 0, "max_new_tokens": 1, "batch_size": 1, "seq_len": 1, "max_validation_batches": 1}


def checked_arguments(args: argparse.Namespace) -> tuple[Target, EvalConfig]:
    """Every flag and file, before any model is loaded (an evaluation takes minutes: its output must not fail
    after it): the target to evaluate and the evaluation settings."""
    for name, least in LEAST_VALUES.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise InputError(f"--{name.replace('_', '-')}: must be >= {least}, got {value}")
    inputs = [args.target, *(args.qa or []), *(args.validation or [])]
    for option in ("out", "answers"):
        if getattr(args, option) is not None:
            check_output(f"--{option}", getattr(args, option), inputs, args.overwrite)
    if args.out is not None and args.answers is not None and args.out.resolve() == args.answers.resolve():
        raise InputError(f"--answers: {args.answers} is also --out; name two files")
    if args.template is not None and not args.validation:
        raise InputError("--template: formats the --validation records; give --validation too")
    target = resolve_target(args.target)
    if args.log_metrics and target.run_dir is None:
        raise InputError(f"--log-metrics: {args.target} is not a run (an HF folder, or a checkpoint outside "
                         f"<run>/checkpoints/): it has no metrics.jsonl")  # fmt: skip
    if target.checkpoint is not None:  # every process alike, before any file of the checkpoint is read
        verify_before_reading(target.checkpoint)
    for path in args.validation or []:
        source = SourceConfig(path=path, template=args.template)
        try:
            source.check()
            check_source_files(source)
        except ValueError as error:
            raise InputError(f"--validation {path}: {error}") from error
    try:
        cfg = eval_config_from_args(args, recipe_eval(target))
    except ValueError as error:  # the flags on top of the run's eval section
        raise InputError(f"eval settings: {error}") from error
    for qa in cfg.qa_sets:  # the run's own sets may have moved since it was trained
        if not resolve_path(qa.path).is_file():
            raise InputError(f"--qa: no such question/answer file {qa.path}")
        with resolve_path(qa.path).open(encoding="utf-8", errors="replace") as lines:
            empty = not any(line.strip() for line in lines)  # stops at the first record: the sets may be large
        if empty:
            raise InputError(f"--qa: {qa.path} holds no question/answer records (an empty file)")
    check_seq_len(model_config(target), args.seq_len, cfg.max_new_tokens)  # the model folder last: it reads files
    return target, cfg


def run_eval(args: argparse.Namespace, checked: tuple[Target, EvalConfig] | None = None) -> int:
    """`checked`: what `checked_arguments(args)` returned, when the caller checked them already."""
    target, cfg = checked or checked_arguments(args)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        bind_local_device()
        dist.init_process_group(default_backend())
    try:
        console = sys.stderr if _is_rank0() else io.StringIO()  # progress on stderr, rank 0's: stdout is the record
        with stdout_to_stderr(), no_library_progress_bars(), ongoing(args.target, EVAL_PREFIX, console) as stage:
            record = evaluate_target(
                args.target, cfg, args.seq_len, args.ntl_kind, args.answers, args.per_document_attention, stage
            )
        if not distributed or dist.get_rank() == 0:
            _publish(record, args)
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


def _publish(record: dict, args: argparse.Namespace) -> None:
    """The record into its files first, then onto stdout: a console that fails costs the line, never the result."""
    text = json.dumps(record)
    if args.out is not None:
        write_text(args.out, json.dumps(record, indent=1) + "\n")
    if args.log_metrics:
        run_dir = resolve_target(args.target).run_dir
        with open_for_append(run_dir / "metrics.jsonl") as metrics:
            metrics.write(text + "\n")
    print(text, flush=True)
