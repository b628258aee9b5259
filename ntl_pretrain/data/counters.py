"""The data counters in metrics: per reader, summed over a rank's readers and over all ranks, with the realised
mixture next to the configured weights.

Counters are sums (`documents`, `tokens`, `batches`, `skipped/<reason>`, and per source `source/<label>/...`)
except `epoch/<label>`, a source's completed passes, which combine by minimum (the reader furthest behind). Every
rank holds the same names, in the same order, because they follow from the recipe alone: that is what lets one
`all_gather` of a small vector combine them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.sources import SKIP_REASONS

EPOCH_PREFIX = "epoch/"


def source_key(label: str, name: str) -> str:
    return f"source/{label}/{name}"


def zero_counters(cfg: DataConfig) -> dict[str, float]:
    """Every counter a training reader reports, at zero."""
    counters = {"documents": 0.0, "tokens": 0.0, "batches": 0.0}
    counters.update({f"skipped/{reason}": 0.0 for reason in SKIP_REASONS})
    for source in cfg.sources:
        counters[source_key(source.label, "documents")] = 0.0
        counters[source_key(source.label, "tokens")] = 0.0
        counters.update({source_key(source.label, f"skipped/{reason}"): 0.0 for reason in SKIP_REASONS})
        counters[f"{EPOCH_PREFIX}{source.label}"] = 0.0
    return counters


def combine(parts: Iterable[dict[str, float]], cfg: DataConfig) -> dict[str, float]:
    """Sums of the counters of `parts` (readers or ranks), and the smallest epoch of each source."""
    total = zero_counters(cfg)
    parts = list(parts)
    for name in total:
        values = [part[name] for part in parts if name in part]
        if values:
            total[name] = min(values) if name.startswith(EPOCH_PREFIX) else sum(values)
    return total


def combined_over_ranks(counters: dict[str, float], cfg: DataConfig) -> dict[str, float]:
    """`combine` over all ranks of the default process group: one `all_gather` of a float64 vector (exact for
    counts below 2^53). Collective: every rank must call it at the same step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counters
    names = list(zero_counters(cfg))
    local = torch.tensor([counters[name] for name in names], dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return combine((dict(zip(names, part.tolist(), strict=True)) for part in gathered), cfg)


def with_mixture(counters: dict[str, float], cfg: DataConfig) -> dict[str, float]:
    """Adds `epoch` (the fewest passes over any source) and, per source, the configured `weight` (normalised)
    next to the realised `document_share` (what the weight sets) and `token_share` (what the model reads)."""
    metrics = dict(counters)
    metrics["epoch"] = min(counters[f"{EPOCH_PREFIX}{source.label}"] for source in cfg.sources)
    total_weight = sum(source.weight for source in cfg.sources)
    for source in cfg.sources:
        metrics[source_key(source.label, "weight")] = source.weight / total_weight
        for name, share in (("documents", "document_share"), ("tokens", "token_share")):
            metrics[source_key(source.label, share)] = counters[source_key(source.label, name)] / max(counters[name], 1)
    return metrics
