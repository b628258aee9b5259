"""The loader the trainer iterates: readers per rank and worker, resumable state, metrics.

Reader `dp_rank * num_workers + k` of `dp_world_size * num_workers` runs in worker k (or in the training
process when `num_workers` is 0). Each worker yields its batches together with its reader's state, and
the DataLoader hands batches out round-robin over the workers, so the loader knows the exact state behind
every batch it has handed out, however far the workers have prefetched (torchdata's StatefulDataLoader
does the same; doing it here avoids a dependency). Shipping a full state (shuffle buffer included) from a
worker costs more than making the batch, so a reader snapshots every `SNAPSHOT_EVERY` batches and the
loader counts the batches since; a resumed reader restores the snapshot and replays those few batches.

On resume the round-robin must continue with the worker that was next: worker w therefore runs local reader
`(w + first_reader) % num_workers`, and `first_reader` is saved with the state.

A checkpoint written under another layout (number of ranks, workers or micro-batch size) at the same global batch
continues through `load_world_state`, which hands the saved readers to `reslice.SlicedStreams`; those then run in
the training process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from functools import partial

from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import PreTrainedTokenizerBase

from ntl_pretrain.data.config import DataConfig, validate_sources
from ntl_pretrain.data.counters import combine, combined_over_ranks, with_mixture
from ntl_pretrain.data.hub import HubListing, list_once
from ntl_pretrain.data.pipeline import Batch, DocumentEncoder, TrainReader, validation_batches
from ntl_pretrain.data.reslice import ResumeRefused, SlicedStreams, positions_from_ranks
from ntl_pretrain.data.sources import SKIP_REASONS

STATE_VERSION = 2  # 2: per-source counters, the source of each buffered document, a streamed document
SNAPSHOT_EVERY = 16


class _ReaderDataset(IterableDataset):
    """What each DataLoader worker runs: one `TrainReader`, restored from its saved state if any."""

    def __init__(self, loader: PackedLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[Batch, int, dict | None, dict[str, float]]]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        local = (worker + self.loader.first_reader) % num_workers
        reader = self.loader.make_reader(local)
        while True:
            batch = reader.next_batch()
            snapshot = reader.state_dict() if reader.counts["batches"] % SNAPSHOT_EVERY == 0 else None
            yield batch, local, snapshot, reader.progress()


class PackedLoader:
    """Iterates `{"input_ids", "labels", "position_ids"}` int64 `[B, T]` micro-batches (see `packing.py`).

    The train split is infinite and every new `iter()` continues after the last batch handed out; the
    validation split is one finite pass that starts over with every `iter()`.
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        split: str = "train",
        grad_accum: int = 1,
        hub_listings: Mapping[tuple, HubListing] | None = None,
    ):
        if split not in ("train", "validation"):
            raise ValueError(f"split: expected 'train' or 'validation', got {split!r}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside a data-parallel world of {dp_world_size}")
        validate_sources(cfg)
        self.cfg, self.split, self.seed = cfg, split, seed
        self.micro_batch_size, self.dp_rank, self.dp_world_size = micro_batch_size, dp_rank, dp_world_size
        self.grad_accum = grad_accum
        self.encoder = DocumentEncoder(tokenizer, max_chars=cfg.tokenize_batch_chars)
        self.num_workers = cfg.num_workers if split == "train" else 0
        self.first_reader = 0
        # Per local reader: its last snapshot (None = fresh start), batches handed out since, counters.
        self.readers = [{"snapshot": None, "replay": 0, "progress": {}} for _ in range(max(1, self.num_workers))]
        self.validation_skipped: Counter = Counter()
        self.sliced: SlicedStreams | None = None
        # Listed here (once per rank) unless the caller listed for all ranks; the workers get the lists.
        self.hub_listings = hub_listings if hub_listings is not None else list_once([*cfg.sources, *cfg.validation])

    def make_reader(self, local: int) -> TrainReader:
        readers_per_rank = max(1, self.num_workers)
        reader = TrainReader(
            self.cfg,
            self.encoder,
            self.micro_batch_size,
            reader=self.dp_rank * readers_per_rank + local,
            num_readers=self.dp_world_size * readers_per_rank,
            seed=self.seed,
            hub_listings=self.hub_listings,
        )
        saved = self.readers[local]
        if saved["snapshot"] is not None:
            reader.load_state_dict(saved["snapshot"])
        for _ in range(saved["replay"]):
            reader.next_batch()
        return reader

    def __iter__(self) -> Iterator[Batch]:
        if self.split == "validation":
            self.validation_skipped.clear()
            yield from validation_batches(
                self.cfg, self.encoder, self.micro_batch_size, self.dp_rank, self.dp_world_size,
                self.validation_skipped, self.hub_listings,
            )  # fmt: skip
            return
        if self.sliced is not None:
            yield from self.sliced
            return
        for batch, local, snapshot, progress in self._worker_batches():
            saved = self.readers[local]
            if snapshot is None:
                saved["replay"] += 1
            else:
                saved["snapshot"], saved["replay"] = snapshot, 0
            saved["progress"] = progress
            self.first_reader = (local + 1) % len(self.readers)
            yield batch

    def _worker_batches(self) -> Iterator[tuple[Batch, int, dict | None, dict[str, float]]]:
        if self.num_workers == 0:
            return iter(_ReaderDataset(self))
        return iter(
            DataLoader(
                _ReaderDataset(self),
                batch_size=None,
                num_workers=self.num_workers,
                prefetch_factor=self.cfg.prefetch_batches,
            )
        )

    def _layout(self) -> dict:
        """What a saved stream position depends on; resuming under any other layout cannot be exact."""
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "dp_world_size": self.dp_world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.cfg.seq_len,
            "sources": [source.label for source in self.cfg.sources],
        }

    def _global_batch(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum}

    def state_dict(self) -> dict:
        """Plain Python and CPU tensors: positions, RNG states, shuffle buffers and partial blocks."""
        if self.sliced is not None:
            return {**self._layout(), **self._global_batch(), "num_workers": 0, **self.sliced.state_dict()}
        return {
            **self._layout(),
            **self._global_batch(),
            "first_reader": self.first_reader,
            "readers": [dict(saved) for saved in self.readers],
        }

    def load_state_dict(self, state: dict) -> None:
        for key, expected in self._layout().items():
            if state.get(key) != expected:
                raise ValueError(
                    f"data loader state: {key}={state.get(key)!r} was saved, this run has {expected!r}; the "
                    f"data stream resumes exactly only with the same ranks, workers, batch, seq_len and sources "
                    f"(load_world_state continues on other ranks, workers or batch at the same global batch)"
                )
        self.first_reader = state["first_reader"]
        self.readers = [dict(saved) for saved in state["readers"]]

    def load_world_state(self, states: list[dict]) -> None:
        """Resume from the states of every rank of the saved run (`states[rank]`), whatever its layout.

        The saved ranks, workers and micro-batch size resume exactly as `load_state_dict`. Another number of
        ranks, workers or micro-batch size at the same global batch continues every saved stream where it stopped
        (see `reslice.py`). A
        different corpus, seq_len or global batch, or a layout change in the middle of an optimizer step, raises
        `ResumeRefused` rather than restart or reshuffle the data.
        """
        saved = states[0] if states else {}
        for key in ("version", "split", "seq_len", "sources"):
            if saved.get(key) != self._layout()[key]:
                raise ResumeRefused(
                    f"data loader state: {key}={saved.get(key)!r} was saved, this run has {self._layout()[key]!r}; "
                    f"the data stream can only continue on the same corpus and sequence length"
                )
        same_ranks = len(states) == self.dp_world_size and all(
            saved.get(key) == value for key, value in self._layout().items()
        )
        if same_ranks and "readers" in saved:  # each rank's own stream continues, whatever the global batch
            self.load_state_dict(states[self.dp_rank])
            return
        same_layout = same_ranks and all(saved.get(key) == value for key, value in self._global_batch().items())
        into_step = states[self.dp_rank]["into_step"] if same_layout else 0
        self.sliced = self._sliced_streams(*positions_from_ranks(states, allow_inside_step=same_layout))
        self.sliced.skip(into_step)

    def _sliced_streams(self, positions: dict, num_streams: int, global_rows: int) -> SlicedStreams:
        rows_per_rank = self.micro_batch_size * self.grad_accum
        if global_rows != rows_per_rank * self.dp_world_size:
            raise ResumeRefused(
                f"data loader state: the saved run took {global_rows} sequences per optimizer step, this run takes "
                f"{rows_per_rank * self.dp_world_size} (micro_batch_size {self.micro_batch_size} x grad_accum "
                f"{self.grad_accum} x {self.dp_world_size} ranks); keep train.global_batch_size to change the ranks"
            )
        make_reader = partial(self._stream_reader, num_streams=num_streams)
        return SlicedStreams(
            make_reader, positions, num_streams, global_rows, self.dp_rank, rows_per_rank, self.micro_batch_size
        )

    def _stream_reader(self, stream: int, num_streams: int) -> TrainReader:
        return TrainReader(self.cfg, self.encoder, 1, reader=stream, num_readers=num_streams, seed=self.seed,
                           hub_listings=self.hub_listings)  # fmt: skip

    def metrics(self, all_ranks: bool = False) -> dict[str, float]:
        """Counters (see `counters.py`): `documents`, `tokens`, `batches`, `skipped/<reason>`, `epoch/<source>`,
        `epoch` (the fewest completed passes over any source), and per source `source/<label>/documents`,
        `.../tokens`, `.../skipped/<reason>`, with `.../weight` (normalised) next to the realised
        `.../document_share` and `.../token_share`. This rank's readers, or with `all_ranks` (a collective: every
        rank calls it at the same step) the sums over all ranks. Passes are the readers': they include the
        documents read ahead into the shuffle buffer, so a source smaller than the buffer is several epochs in
        before the first step."""
        if self.split == "validation":
            return {f"skipped/{reason}": float(self.validation_skipped[reason]) for reason in SKIP_REASONS}
        if self.sliced is not None:
            counters = self.sliced.counters()
        else:
            counters = combine((saved["progress"] for saved in self.readers if saved["progress"]), self.cfg)
        if all_ranks:
            counters = combined_over_ranks(counters, self.cfg)
        return with_mixture(counters, self.cfg)


def build_dataloader(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    split: str = "train",
    grad_accum: int = 1,
    hub_listings: Mapping[tuple, HubListing] | None = None,
) -> PackedLoader:
    """The trainer's entry point; see `PackedLoader`. `grad_accum` (micro-batches per rank per optimizer step)
    fixes, with the other sizes, the global batch that a resume on another layout keeps. `hub_listings`: the
    file lists of the hub sources, made once for all ranks (`hub.list_for_all_ranks`); None = list them here."""
    return PackedLoader(
        cfg,
        tokenizer,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        split=split,
        grad_accum=grad_accum,
        hub_listings=hub_listings,
    )
