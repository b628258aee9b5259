"""Run a function on `world_size` CPU processes joined in a gloo process group (OLMo-core style test helper).

    run_distributed(check_something, 3, arg1, arg2)

spawns 3 processes; each sets the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, so
DeepSpeed works inside), initialises the default group on a free localhost port, calls
`check_something(arg1, arg2)` (which reads its rank from torch.distributed) and tears the group down. An exception
on any rank fails the call with that rank's traceback. Spawning costs a few seconds per call, so run many cases
inside one call rather than one call per case.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntl_pretrain.runtime.process_group import free_port

# Each rank gets one intra-op thread: ranks share the machine's cores, and oversubscription makes gloo tests crawl.
THREADS_PER_RANK = 1
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def run_distributed(fn: Callable[..., None], world_size: int, *args, timeout_s: float | None = None) -> None:
    """Call `fn(*args)` on every rank of a fresh `world_size`-process gloo group; raise if any rank raises.
    `timeout_s`: a run still going after that long (ranks waiting on each other in mismatched collectives) is killed
    and fails the call, instead of holding the test session until CI gives up."""
    context = mp.spawn(_rank_main, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
                process.join()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks still running after {timeout_s:.0f} s: killed")


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(THREADS_PER_RANK)
    # What a launcher would set: DeepSpeed reads these even when the process group already exists.
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(*args)
        # Every rank done before any tears its connections down: a gloo peer whose connection closes while its own
        # threads still use it aborts ("terminate called without an active exception", SIGABRT; seen 3 times in
        # ~1,000 two-rank runs on 2026-11-27).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_destructors()


def exit_without_destructors() -> None:
    """Exit 0 at once, once a rank's work and checks are done and its group is gone. At interpreter exit a C++
    destructor (a gloo or DeepSpeed thread still joinable) now and then aborts with "terminate called without an
    active exception" (SIGABRT): seen in CI in test_slow_work and test_evaluate_zero3 after every assertion had
    passed (sessions 6-9). What a test checks is done by then; the abort is not its subject."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Count calls of torch.distributed's collectives (by name) while the block runs."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def tiny_zero3_engine():
    """A two-layer model in a ZeRO-3 engine on gloo, inside a `run_distributed` rank (checkpoint tests)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    return engine
