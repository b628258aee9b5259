"""`logging.profile_steps`: the window of steps torch.profiler records, what rank 0 writes, and the refusals. The
trainer's use of it runs in the unattended run (tests/test_console.py)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.launches import TINY
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.reporting.profiling import StepProfiler, step_summary


def steps_of(profiler: StepProfiler, count: int, work) -> None:
    for step in range(1, count + 1):
        profiler.before(step)
        work()
        profiler.after(step)


def test_the_window_is_written_with_per_step_figures(tmp_path):
    said = []
    profiler = StepProfiler([2, 3], tmp_path, torch.device("cpu"), 0, said.append)
    weight = torch.randn(64, 64, requires_grad=True)
    steps_of(profiler, 6, lambda: (weight @ weight).sum().backward())
    summary = json.loads((tmp_path / "profile" / "steps-2-4.json").read_text())
    assert summary["steps"] == [2, 4] and summary["device"] == "cpu"
    assert summary["aten_ops_per_step"] >= 3  # mm, sum, their backward, per step (the window is 3 steps)
    assert summary["self_cpu_ms_per_step"] > 0 and summary["kernel_launches_per_step"] == 0
    table = (tmp_path / "profile" / "steps-2-4.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    assert said == [f"profile of steps 2-4, per step: {summary['self_cpu_ms_per_step']:.1f} ms of CPU ops "
                    f"({summary['aten_ops_per_step']:,.0f} ops), 0.0 ms of device kernels (0 launches); "
                    f"{tmp_path / 'profile' / 'steps-2-4'}.txt"]  # fmt: skip


def test_other_ranks_and_a_run_stopped_inside_the_window_write_nothing(tmp_path):
    other_rank = StepProfiler([1, 1], tmp_path / "a", torch.device("cpu"), 1, print)
    steps_of(other_rank, 2, lambda: torch.ones(3).sum())
    stopped = StepProfiler([2, 5], tmp_path / "b", torch.device("cpu"), 0, print)
    steps_of(stopped, 3, lambda: torch.ones(3).sum())
    stopped.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert stopped.active is None


def test_device_time_counts_each_kernel_once():
    """An op carries its kernel's device time as its own self time, and the kernel event carries it again: a step's
    device time is the kernels' (what torch's table totals), not the sum over all events."""
    event = functools.partial(FunctionEvent, thread=1, use_device="cuda", stack=[])
    op = event(0, "aten::mm", start_us=0, end_us=40)
    op.append_kernel("gemm_kernel", 0, 250)
    kernel = event(1, "gemm_kernel", start_us=10, end_us=260, device_type=DeviceType.CUDA)
    launch = event(2, "cudaLaunchKernel", start_us=5, end_us=9)
    profile = EventList([op, kernel, launch], use_device="cuda")
    profile._build_tree()  # what the profiler does when it stops
    events = profile.key_averages()
    assert op.self_device_time_total == kernel.self_device_time_total == 250  # the double count being avoided
    summary = step_summary(events, steps=1)
    assert summary["device_ms_per_step"] == pytest.approx(0.250)
    assert "Self CUDA time total: 250.000us" in events.table()  # torch's own total agrees
    assert summary["aten_ops_per_step"] == 1 and summary["kernel_launches_per_step"] == 1


@pytest.mark.parametrize("value", ["[0, 5]", "[3]", "[2, 0]", "[1, 2, 3]"])
def test_a_bad_window_is_refused_naming_the_key(value):
    with pytest.raises(RecipeError, match=r"logging.profile_steps: \[first step, number of steps\], both >= 1"):
        load_recipe(TINY, [f"logging.profile_steps={value}"])
