"""One training rank: `python -m ntl_pretrain.train RECIPE [key.path=value ...]` (what `deepspeed
--module ntl_pretrain.train` and `ntl-pretrain train` start on every rank): load the recipe, join the
process group, hold the output folder, train, and exit with one line on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import typing
import warnings
from pathlib import Path

import torch.distributed as dist

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.deepspeed import load_run
from ntl_pretrain.config.recipe import Recipe, RecipeError, TrainConfig
from ntl_pretrain.data.errors import DataError
from ntl_pretrain.reporting.console import failure_line, first_line, library_lines_to, on_terminal, whole_lines
from ntl_pretrain.runtime import lifeline, run_lock
from ntl_pretrain.runtime.process_group import (
    bind_local_device,
    default_backend,
    rendezvous_failure,
)
from ntl_pretrain.runtime.stopping import EXIT_STOPPED, StopRequest
from ntl_pretrain.train import resume_guard
from ntl_pretrain.train.engine import compile_failures_named
from ntl_pretrain.train.trainer import Trainer

# DeepSpeed's ZeRO-3 calls collectives that torch deprecated (all_gather_into_tensor and reduce_scatter_tensor in
# torch 2.13): a warning for DeepSpeed's maintainers, printed by every rank.
DEPRECATED_COLLECTIVE = r"`torch\.distributed\.\w+` is deprecated\. Please use `torch\.distributed\.\w+` instead"
PREFIX = "ntl-pretrain: "
MAX_REFUSAL_CHARS = 300  # a refusal is one line a terminal shows whole
# gloo's and NCCL's words for a peer process that died: a consequence on this rank, not a cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited or there was a network")


def quiet_console(rank: int) -> None:
    """`logging.verbose: false`: DeepSpeed's deprecated-collective warnings are hidden, and ranks other than 0 show
    errors only (they run the same code as rank 0, which shows the warnings once). Errors, tracebacks and this
    project's own lines are printed, not logged or warned, so every rank still shows them."""
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVE, category=FutureWarning)
    if rank == 0:
        return
    from deepspeed.utils import logger as deepspeed_logger
    from deepspeed.utils import set_log_level_from_string
    from transformers.utils import logging as transformers_logging

    warnings.simplefilter("ignore")
    set_log_level_from_string("error", deepspeed_logger)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # rank 0's "Loading weights" bar is the one shown


def library_log(recipe: Recipe) -> Path:
    return Path(recipe.train.output_dir) / "logs" / "libraries-rank0.log"


def quiet_libraries(recipe: Recipe) -> bool:
    """Rank 0 off a terminal (a log, a pipe), unless `logging.verbose`: DeepSpeed's and transformers' lines and
    Python warnings go to `library_log`, and transformers' bars are off (the other ranks show errors only)."""
    return dist.get_rank() == 0 and not recipe.logging.verbose and not on_terminal(sys.stderr)


def init_distributed(timeout_s: int = TrainConfig.dist_timeout_seconds) -> None:
    import deepspeed

    # Training never uses DeepSpeed's shared-memory op; without this it compiles for ~140 s per process on CPU.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    bind_local_device()
    try:  # NCCL alone would reject our CPU metric sums
        deepspeed.init_distributed(dist_backend=default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as error:
        print(f"ntl-pretrain: {rendezvous_failure(error, timeout_s)}", file=sys.stderr, flush=True)
        os._exit(1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ntl_pretrain.train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. loss.ntl.weight=0.5")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by `deepspeed`
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train one rank; returns the exit code (0, or `EXIT_STOPPED` for a run stopped by a signal)."""
    whole_lines()  # ranks share the launcher's pipes
    args = parse_args(argv)
    try:  # launched by hand (`deepspeed --module ntl_pretrain.train`), a recipe has had no pre-flight
        recipe, ds_config = load_run(args.recipe, args.overrides, int(os.environ.get("WORLD_SIZE", "1")))
    except RecipeError as error:
        refuse(f"recipe error: {error.one_line()}", alike=True)
    if not recipe.logging.verbose:
        quiet_console(int(os.environ.get("RANK", "0")))
    who = f"rank {os.environ.get('RANK', '0')}: "
    stop = StopRequest(recipe.train.stop_grace_seconds, who=who)
    stop.install()  # from here on a signal means "stop at the next step boundary", also during start-up
    lifeline.watch_supervisor(who)
    init_distributed(recipe.train.dist_timeout_seconds)
    try:
        resume_guard.check_same_recipe(recipe)
        lock = hold_output_dir(recipe)
        try:
            with library_lines_to(library_log(recipe), enabled=quiet_libraries(recipe)):
                trainer = Trainer(recipe, ds_config, stop)
                finished = train_reporting_failures(trainer)
        finally:
            run_lock.release(lock)
    except RecipeError as error:  # the recipe, its files or its checkpoint: alike on every rank (resume_guard.py)
        refuse(f"recipe error: {error.one_line()}", alike=True)
    except DataError as error:  # this rank's share of the data
        refuse(f"rank {dist.get_rank()}: data error: {error.one_line()}", alike=False)
    dist.barrier()
    dist.destroy_process_group()
    checkpoint.old_checkpoints_pruned()  # rank 0 exits only when the last save's rotation is done
    lifeline.report_outcome(finished)
    return 0 if finished else EXIT_STOPPED


def refuse(line: str, alike: bool) -> typing.NoReturn:
    """Exit 2 with the one line that says why this rank refuses its input (at most `MAX_REFUSAL_CHARS` with its
    prefix), said once: under `ntl-pretrain train` the supervisor says it, last, after the launcher's lines; else
    rank 0 says a refusal every rank makes `alike`, and each rank its own. At once: the launcher then stops the ranks
    still starting, or waiting in a collective for this one."""
    line = line if len(line) <= MAX_REFUSAL_CHARS - len(PREFIX) else line[: MAX_REFUSAL_CHARS - len(PREFIX) - 1] + "…"
    if lifeline.supervised():
        lifeline.report_refusal(line)
    elif not alike or int(os.environ.get("RANK", "0")) == 0:
        print(PREFIX + line, file=sys.stderr, flush=True)
    os._exit(2)


def train_reporting_failures(trainer: Trainer) -> bool:
    """`trainer.train()`; a failure inside it (an evaluation, a tracker, a non-finite loss, a full disk) ends this
    rank with one line naming it and the log file that holds its traceback. The checkpoints saved so far and
    metrics.jsonl are left as they are (a save is published whole or not at all; the logger is closed)."""
    try:
        with compile_failures_named():
            return trainer.train()
    except (resume_guard.RunRefused, DataError):
        raise
    except Exception as error:
        where = f"rank {trainer.rank}: after step {trainer.step}"
        if any(sign in str(error) for sign in PEER_LOST):  # the cause is another rank's, which says so itself
            line = f"{where}: stopped, another rank is gone ({first_line(error)})"
        else:
            line = failure_line(where, error, trainer.output_dir, trainer.rank, trainer.last_checkpoint)
        print(f"ntl-pretrain: {line}", file=sys.stderr, flush=True)
        os._exit(1)  # at once: the launcher stops the other ranks, which would wait in a collective


def hold_output_dir(recipe: Recipe) -> Path | None:
    """Rank 0 takes the output folder's lock before the run reads or writes anything in it; every rank learns the
    outcome (`run_lock.RunLocked` on all of them when it is refused). Returns the lock on rank 0."""
    outcome: list = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = run_lock.acquire(recipe.train.output_dir)
        except run_lock.RunLocked as error:
            outcome[1] = str(error)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise run_lock.RunLocked(outcome[1])
    return outcome[0] if dist.get_rank() == 0 else None
