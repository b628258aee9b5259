"""The console of a run: rank 0's lines (start-up, progress, evaluations, summary) and errors; a progress bar on a
terminal, plain lines off one (issue 31); `logging.verbose: true` brings back DeepSpeed's launcher INFO lines and the
deprecation warnings its collectives raise in torch."""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers.launches import as_a_user_runs_it, records, train_one_rank, unattended_run
from transformers.utils import logging as transformers_logging

from ntl_pretrain.reporting.console import RunConsole, evaluation_line, stop_line
from ntl_pretrain.train.main import quiet_console

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
DEPRECATION = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`"
)


@pytest.fixture(scope="module")
def unattended(tmp_path_factory) -> tuple[Path, str]:
    return unattended_run(tmp_path_factory)


def ours(console: str) -> list[str]:
    return [line.removeprefix("ntl-pretrain: ") for line in console.splitlines() if line.startswith("ntl-pretrain: ")]


@pytest.mark.slow
def test_unattended_console_starts_with_the_runs_shape(unattended):
    from transformers import AutoConfig, AutoModelForCausalLM

    output_dir, console = unattended
    config = AutoConfig.from_pretrained(output_dir / "checkpoints" / "step_4" / "hf_config")
    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # while the checks take more than 3 s (torch's import most of it), every 3 s the check under way
    checking = [line for line in ours(console) if line.startswith(f"checking {TINY} before launch: ")]
    assert all(re.fullmatch(r"checking .* before launch: [^()]+ \(\d+ s\)", line) for line in checking), checking
    lines = ours(console)[len(checking) :]
    # said by `ntl-pretrain train` once the checks passed (a note on the schedule first: the fixture's 4 steps are
    # shorter than the recipe's warmup, said once): the ranks' half minute of start-up is not silent
    assert lines[0].startswith("note: schedule.warmup_steps=10 is longer than train.max_steps=4")
    assert lines[1] == (f"training {TINY.resolve()} into {output_dir}: starting 1 process; each loads the "
                        "libraries and builds the model before step 1")  # fmt: skip
    # then, after every 4.5 s without a line until the rank's first line, that the run is still starting
    starting = [line for line in lines if line.startswith("still starting (")]
    assert lines[2 : 2 + len(starting)] == starting
    assert all(line.endswith(" s): the ranks import torch and DeepSpeed, then build the model") for line in starting)
    assert lines[2 + len(starting) : 5 + len(starting)] == [
        f"{output_dir}: starting from scratch; attention sdpa; AdamW default",
        f"{parameters:,} parameters; world size 1; micro-batch 2, global batch 4 sequences (gradient accumulation 2); "
        "128 tokens per step (32 per sequence); precision fp32",
        # which of DeepSpeed's internals the trainer replaces (train/zero_optimizer.py), also in logs/
        "DeepSpeed fast path: on: foreach_gradient_norm, ranges_off, lazy_debug_lines, cached_module_parameters, "
        "mark_forward_at_once, release_every_parameter, gather_persistent_at_once, bucket_gradients_directly, "
        "partition_gradients_at_once, scatter_alone, fetch_in_one_pass, hooks_without_wrapping, lean_linear; not for "
        "this run: skip_gradient_scan, reduce_into_partition, keep_weights_in_place, clear_skipped_gradients "
        "(DeepSpeed runs DeepSpeedZeroOptimizer_Stage3)",
    ]
    assert (output_dir / "logs" / "deepspeed-fast-path.txt").read_text() == lines[4 + len(starting)] + "\n"
    assert "[INFO]" not in console and "FutureWarning" not in console and "[WARNING]" not in console, console


@pytest.mark.slow
def test_the_profiled_steps_are_written_and_said_once(unattended):
    output_dir, console = unattended
    summary = json.loads((output_dir / "profile" / "steps-2-3.json").read_text())
    assert summary["steps"] == [2, 3] and summary["aten_ops_per_step"] > 100 and summary["self_cpu_ms_per_step"] > 0
    assert "aten::mm" in (output_dir / "profile" / "steps-2-3.txt").read_text()
    profiled = [line for line in ours(console) if line.startswith("profile of steps")]
    assert len(profiled) == 1 and profiled[0].endswith(f"{output_dir / 'profile' / 'steps-2-3'}.txt")
    assert "USDT" not in console  # the profiler's own start/stop lines stay off the console


@pytest.mark.slow
def test_unattended_console_prints_plain_steps_and_evaluations_as_they_come(unattended):
    output_dir, console = unattended
    steps, validation = records(output_dir), records(output_dir, "validation")
    assert "\r" not in console  # no progress bar redrawn into the log
    printed = [line for line in ours(console) if line.startswith("step ")]

    def step_line(step: int) -> str:
        r = steps[step]
        return (f"step {step}/4 loss {r['loss']:.4f} ce {r['ce']:.4f} ntl {r['ntl']:.4f} lr {r['lr']:.3g} "
                f"{r['tokens_per_s']:,.0f} tok/s mem {r['peak_mem_mib']:,.0f} MiB; 0m00s elapsed, ETA "
                "0m00s")  # fmt: skip

    def validation_line(step: int) -> str:  # the tiny recipe's validation sources are Q/A: answer labels too
        r = validation[step]
        return (f"step {step} validation: loss {r['val_loss']:.4f}, ce {r['val_ce']:.4f}, ntl {r['val_ntl']:.4f}, "
                f"number_ce {r['val_number_ce']:.4f}, answer_ce {r['val_answer_ce']:.4f}, answer_ntl "
                f"{r['val_answer_ntl']:.4f}, over {r['val_tokens']:,} tokens")  # fmt: skip

    # the first step, every 3rd, the last; each validation right after its step
    timing = re.compile(r"\d+m\d\ds elapsed, ETA \d+m\d\ds$")
    assert all(timing.search(line) for line in printed if "/4 " in line), printed
    printed = [timing.sub("0m00s elapsed, ETA 0m00s", line) for line in printed]
    assert printed == [step_line(1), validation_line(2), step_line(3), step_line(4), validation_line(4)]
    # what takes time between steps is announced before it starts
    announced = [line for line in ours(console) if line.startswith(("saving", "validating"))]
    assert announced == ["validating at step 2", "validating at step 4", "saving checkpoint step 4"], announced


@pytest.mark.slow
def test_unattended_console_ends_with_a_summary_whose_export_command_works(unattended, tmp_path):
    output_dir, console = unattended
    last, validation = records(output_dir)[4], records(output_dir, "validation")[4]
    done, throughput, where, export = ours(console)[-4:]
    assert done == (f"done: step 4 of 4; train loss {last['loss']:.4f} (ce {last['ce']:.4f}, ntl {last['ntl']:.4f}), "
                    f"validation loss {validation['val_loss']:.4f} (ce {validation['val_ce']:.4f}, ntl "
                    f"{validation['val_ntl']:.4f})")  # fmt: skip
    peak = max(record["peak_mem_mib"] for record in records(output_dir).values())
    assert re.fullmatch(rf"{last['tokens']:,} tokens in 0m\d\ds \([\d,]+ tokens/s\); peak memory {peak:,.0f} MiB",
                        throughput), throughput  # fmt: skip
    checkpoint = output_dir / "checkpoints" / "step_4"
    assert where == f"checkpoint {checkpoint}; metrics {output_dir / 'metrics.jsonl'}"
    command = shlex.split(export.removeprefix("export to a Hugging Face folder: "))
    assert command[:2] == ["ntl-pretrain", "export"] and command[2] == str(checkpoint)
    exported = subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", *command[1:3], str(tmp_path / "hf")],
                              cwd=REPO, env=as_a_user_runs_it(), check=True, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert exported.stdout == f"{tmp_path / 'hf'}\n"  # the folder only: DeepSpeed's lines went to stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_verbose_console_shows_the_launcher_and_deprecations(tmp_path):
    verbose = train_one_rank(tmp_path / "verbose", "logging.verbose=true")
    assert "[INFO] [launch.py" in verbose and "[WARNING] [runner.py" in verbose
    assert f"FutureWarning: {DEPRECATION}" in verbose


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


STEP = {"loss": 2.0, "ce": 1.5, "ntl": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0, "peak_mem_mib": 10.0, "tokens": 64}


def test_a_terminal_gets_the_bar_and_lines_above_it():
    terminal = Terminal()
    console = RunConsole(enabled=True, total_steps=2, first_step=0, first_tokens=0, progress_bar=True, every_steps=1,
                         stream=terminal)  # fmt: skip
    console.step({**STEP, "step": 1})
    console.say("between steps")
    console.close_bar()
    shown = terminal.getvalue()
    assert "1/2" in shown and "\r" in shown and "ntl-pretrain: between steps\n" in shown
    assert "ntl-pretrain: step 1/2" not in shown  # the bar carries the step's fields instead


def test_plain_lines_when_the_bar_is_off_and_nothing_on_other_ranks():
    terminal = Terminal()
    console = RunConsole(enabled=True, total_steps=5, first_step=2, first_tokens=0, progress_bar=False, every_steps=0,
                         stream=terminal)  # fmt: skip
    for step in (3, 4, 5):
        console.step({**STEP, "step": step})
    assert [line.split(" loss")[0] for line in terminal.getvalue().splitlines()] == [
        "ntl-pretrain: step 3/5",  # the first step of a resumed run
        "ntl-pretrain: step 5/5",
    ]
    silent = io.StringIO()
    other_rank = RunConsole(enabled=False, total_steps=1, first_step=0, first_tokens=0, progress_bar=True,
                            every_steps=1, stream=silent)  # fmt: skip
    other_rank.step({**STEP, "step": 1})
    other_rank.say("rank 0 only")
    other_rank.summary(Path("c"), Path("o"))
    assert silent.getvalue() == ""


def test_stop_line_names_the_saved_step_only_after_a_save(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert stop_line(tmp_path, 10) is None
    metrics.write_text('{"step": 3, "loss": 1.0}\n{"step": 3, "split": "stop", "signal": "SIGINT"}\n')
    assert stop_line(tmp_path, 10) == "stopped at step 3 of 10 with a checkpoint; run the same command to continue"
    metrics.write_text('{"step": 3, "loss": 1.0}\n')  # stopped before its save was done
    assert stop_line(tmp_path, 10) is None


@pytest.fixture
def restored_console():
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_level, transformers_level = deepspeed_logger.level, transformers_logging.get_verbosity()
    with warnings.catch_warnings():
        yield deepspeed_logger
    for logger_or_handler in (deepspeed_logger, *deepspeed_logger.handlers):  # DeepSpeed sets both alike
        logger_or_handler.setLevel(deepspeed_level)
    transformers_logging.set_verbosity(transformers_level)
    transformers_logging.enable_progress_bar()


def test_rank_0_hides_only_the_deprecated_collectives(restored_console):
    quiet_console(rank=0)
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn(DEPRECATION + " instead.", FutureWarning, stacklevel=1)
        warnings.warn("a warning of its own", UserWarning, stacklevel=1)
        warnings.warn("`torch.load` default changes", FutureWarning, stacklevel=1)
    assert [str(warning.message) for warning in shown] == ["a warning of its own", "`torch.load` default changes"]
    assert restored_console.getEffectiveLevel() == logging.WARNING


def test_other_ranks_show_errors_only(restored_console):
    quiet_console(rank=1)
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn("rank 0 shows this one", UserWarning, stacklevel=1)
    assert shown == []
    assert restored_console.getEffectiveLevel() == logging.ERROR
    assert transformers_logging.get_verbosity() == logging.ERROR
    assert not transformers_logging.is_progress_bar_enabled()  # no loading bar beside rank 0's


def test_a_validation_line_carries_the_answer_label_figures_when_there_are_some():
    record = {"step": 5, "split": "validation", "val_loss": 2.0, "val_ce": 1.5, "val_ntl": 1.0, "val_tokens": 1024,
              "val_number_tokens": 64, "val_number_ce": 3.0, "val_answer_ce": 0.5, "val_answer_ntl": 0.25}  # fmt: skip
    assert evaluation_line(record) == ("step 5 validation: loss 2.0000, ce 1.5000, ntl 1.0000, number_ce 3.0000, "
                                       "answer_ce 0.5000, answer_ntl 0.2500, over 1,024 tokens")  # fmt: skip
    generation = {"step": 5, "split": "eval", "eval/sums/exact_match": 0.25, "eval/sums/mae": 12.5}
    assert evaluation_line(generation) == "step 5 eval: sums/exact_match 0.25, sums/mae 12.5"
