"""Run metrics: `metrics.jsonl` records, optional W&B, and the MFU estimate (what the console shows: console.py).

MFU (model FLOPs utilisation, as in PaLM appendix B and nanoGPT, with causal attention counted as half):
    flops_per_token = 6 * N + 6 * L * A * T
where N counts the parameters that take part in matrix multiplies (all parameters minus the input embedding
table, a lookup; a tied output projection is counted once, through N; a mixture of experts counts the routed
experts a token uses, `model.active_parameters`), L layers, A = attention heads x head
dimension (the width of QKᵀ and AV, which differs from the hidden size in Gemma, Qwen3 and others), T sequence
length. 6N is forward (2N) plus backward (4N); the attention scores and weighted sum (QKᵀ and AV) are 2·2·T·A
per layer and token forward, times 3 with backward, halved because a causal query attends only to the keys before
it (what flash-attention computes; PaLM's 12·L·H·T counts the masked half too). Activation recomputation is not
counted (it is not useful work). tokens_per_s includes the wait for the step's batches, so a data loader that
cannot keep up lowers MFU. MFU = flops_per_token * tokens_per_s / (peak_flops_per_device * world_size), with the
device's dense bf16
peak from `BF16_PEAK_FLOPS` (vendor datasheets, without sparsity) or `logging.peak_flops_per_device`; null on CPU,
on a GPU the table does not know, and for fp32 runs (no tensor-core peak applies to them) unless that key is set.

Peak memory (`peak_mem_mib`, the largest over ranks): on CUDA the caching allocator's peak of allocated tensor
memory since the previous step (`torch.cuda.max_memory_allocated`, reset after each read); on CPU the process's
maximum resident set size (`getrusage` ru_maxrss), a high-water mark over the whole process lifetime that never
goes down, so it shows the largest step so far rather than each step's own peak.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

BF16_PEAK_FLOPS = (  # (fragment of torch.cuda.get_device_name, dense bf16 FLOP/s); the first match wins
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def device_peak_flops(device: torch.device | str, precision: str) -> float | None:
    """One device's dense peak for a bf16 run, from its name (`BF16_PEAK_FLOPS`); None where it is not known."""
    device = torch.device(device)
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for fragment, peak in BF16_PEAK_FLOPS if fragment in name), None)


def peak_memory_mib(device: torch.device | str) -> float:
    """This process's peak memory since the previous call on CUDA (then reset), its lifetime high-water mark on
    CPU (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss / 2**20 if sys.platform == "darwin" else max_rss / 2**10  # bytes on macOS, KiB on Linux


def flops_per_token(num_matmul_params: int, num_layers: int, attention_width: int, seq_len: int) -> float:
    """`attention_width`: attention heads x head dimension."""
    return 6.0 * num_matmul_params + 6.0 * num_layers * attention_width * seq_len


def mfu(flops_per_token_: float, tokens_per_s: float, peak_flops_per_device: float | None, world_size: int):
    if not peak_flops_per_device:
        return None
    return flops_per_token_ * tokens_per_s / (peak_flops_per_device * world_size)


def open_for_append(path: Path):
    """`path` opened to append records, after ending a torn last line (a write cut by a kill or a full disk) with a
    newline, so that the next record starts a line of its own; readers skip the torn one (`plot.read_metrics`)."""
    torn = path.is_file() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
    file = open(path, "a")  # noqa: SIM115 - the caller owns it
    if torn:
        file.write("\n")
    return file


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as file:
        file.seek(-1, 2)
        return file.read(1)


def written_records(path: Path) -> list[dict]:
    """The records of a live run's metrics.jsonl that are whole: those of lines ended by their newline and parsed as
    JSON objects. The last line may be one the run is writing at this moment, and a line a kill cut short is ended
    by `open_for_append` without becoming a record; both are left out (a watcher polls again)."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    records = []
    for line in text.split("\n")[:-1]:  # the text after the last newline is not a whole line yet
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def logged_steps(path: Path) -> bool:
    """Whether metrics.jsonl already holds records of training steps (an earlier attempt of this run)."""
    return any(isinstance(record.get("step"), int) and record["step"] > 0 for record in written_records(path))


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing, so call sites need no rank checks."""

    def __init__(self, output_dir: str, *, enabled: bool, wandb_settings: dict | None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.file = None  # opened by the first record: a run that dies before it leaves no empty metrics.jsonl
        self.wandb_run = _start_wandb(wandb_settings) if enabled and wandb_settings else None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.file is None:
            self.file = open_for_append(self.path)
        self.file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            step = record.get("step")
            self.wandb_run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or infinity; `numeric` reads them back
    return value


def numeric(record: dict) -> dict:
    """`record` with the non-finite floats that `_jsonable` wrote as "nan", "inf" or "-inf" read back as floats."""
    return {key: float(value) if value in ("nan", "inf", "-inf") else value for key, value in record.items()}


def _start_wandb(settings: dict):
    try:
        import wandb  # optional extra: imported only when a recipe asks for it
    except ImportError as error:
        raise RuntimeError("logging.wandb: true needs the wandb package: pip install 'ntl_pretrain[wandb]'") from error
    return wandb.init(**settings)
