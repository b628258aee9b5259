"""`logging.profile_steps: [first, count]`: torch.profiler over a window of optimizer steps, written by rank 0.

Where a step's time goes is the first question on a new machine (the first GPU run found the step at 3.4% MFU,
bound by something other than arithmetic). The window opens before step `first` (after the warm-up the user chose)
and closes after step `first + count - 1`; rank 0 writes `<output_dir>/profile/steps-A-B.txt`, the ops by self
time on the device (CPU where there is none), and `steps-A-B.json`: per step, the self CPU time of all ops, the
device time of all kernels, the number of ops and of kernel launches. Every rank profiles (no collective differs),
only rank 0 writes. A run that stops inside the window writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROW_LIMIT = 40
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


class StepProfiler:
    def __init__(self, window: list[int] | None, output_dir: Path, device: torch.device, rank: int,
                 say: Callable[[str], None]):  # fmt: skip
        self.first, self.last = (window[0], window[0] + window[1] - 1) if window else (None, None)
        self.folder, self.device, self.rank, self.say = Path(output_dir) / "profile", device, rank, say
        self.active: profile | None = None

    def before(self, step: int) -> None:
        """Called before step `step` runs (1-based)."""
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.active = profile(activities=activities)
            with _without_kineto_lines():
                self.active.__enter__()

    def after(self, step: int) -> None:
        """Called after step `step` finished; closes the window on its last step."""
        if self.active is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with _without_kineto_lines():
            self.active.__exit__(None, None, None)
        events, self.active = self.active.key_averages(), None
        if self.rank == 0:
            self._write(events)

    def close(self) -> None:
        """The run ends inside the window (a stop): the window is dropped."""
        if self.active is not None:
            with _without_kineto_lines():
                self.active.__exit__(None, None, None)
            self.active = None

    def _write(self, events) -> None:
        on_device = self.device.type == "cuda"
        name = f"steps-{self.first}-{self.last}"
        self.folder.mkdir(parents=True, exist_ok=True)
        sort = "self_cuda_time_total" if on_device else "self_cpu_time_total"
        (self.folder / f"{name}.txt").write_text(events.table(sort_by=sort, row_limit=ROW_LIMIT) + "\n")
        summary = {"steps": [self.first, self.last], "device": str(self.device),
                   **step_summary(events, self.last - self.first + 1)}  # fmt: skip
        (self.folder / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        per_step = (f"{summary['self_cpu_ms_per_step']:.1f} ms of CPU ops ({summary['aten_ops_per_step']:,.0f} ops), "
                    f"{summary['device_ms_per_step']:.1f} ms of device kernels "
                    f"({summary['kernel_launches_per_step']:,.0f} launches)")  # fmt: skip
        self.say(f"profile of steps {self.first}-{self.last}, per step: {per_step}; {self.folder / name}.txt")


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """The profiler's C++ side writes `USDT:... profiler_start` / `profiler_stop` to file descriptor 2 at each start
    and stop, with no setting to silence it; the run's console is for its own lines."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_summary(events, steps: int) -> dict:
    """Per step: self CPU time of every op (ms), device time of every kernel (ms), ops and kernel launches."""
    cpu_us = sum(event.self_cpu_time_total for event in events)
    device_us = sum(_self_device_us(event) for event in events if _on_device(event))
    launches = sum(event.count for event in events if event.key in LAUNCHES)
    ops = sum(event.count for event in events if event.key.startswith("aten::"))
    return {"self_cpu_ms_per_step": cpu_us / 1e3 / steps, "device_ms_per_step": device_us / 1e3 / steps,
            "aten_ops_per_step": ops / steps, "kernel_launches_per_step": launches / steps}  # fmt: skip


def _on_device(event) -> bool:
    """A kernel or device copy, not the op that launched it: an op's self device time is its kernels' time, which
    the kernel events carry again, so only device events are counted (as torch's table total does; the first H200
    profile counted both and read 216 ms a step where the table said 107)."""
    return event.device_type != DeviceType.CPU and not getattr(event, "is_user_annotation", False)


def _self_device_us(event) -> float:
    """The event's self time on the device (torch renamed the attribute from `cuda` to `device`)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return value
    return 0.0
