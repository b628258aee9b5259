"""Continue a saved training stream on another data-parallel layout (ranks, workers, micro-batch) at the same
global batch, without repeating or skipping a document.

A run's stream is the union of *streams*: the readers of the run that started it (`ranks x workers`), each with its
own source shards, mixture RNG, shuffle buffer and packer (`pipeline.TrainReader`). A stream's content depends only
on its index and the number of streams, never on who reads it, so the streams outlive the layout that created them.

Each optimizer step takes `R = global rows / streams` consecutive rows from every stream. The step's global rows are
stream-major: stream k fills positions `[k*R, (k+1)*R)`. Rank r of M takes positions `[r*g*B, (r+1)*g*B)` (g
micro-batches of B rows) and runs the streams these positions fall in; it draws all R rows of each of them per step
and keeps its own, so a stream shared by two ranks is read by both and stays identical on both.

A run on its first layout without workers reads exactly this way (rank k is stream k, and its g micro-batches are
stream k's next g*B rows), so after a resume on M ranks every optimizer step sees the same global batch as the
uninterrupted run. With workers the saved streams may stand one micro-batch apart (workers hand out batches in
turns); each continues exactly where it stopped, so no document repeats or is skipped, but the rows of a step are
grouped differently from the uninterrupted run.

Shapes: B micro-batch rows, T = seq_len.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ntl_pretrain.data.counters import EPOCH_PREFIX, combine
from ntl_pretrain.data.packing import make_batch
from ntl_pretrain.data.pipeline import Batch, TrainReader

# A stream's saved position: a reader state (None = fresh) and the rows drawn after it.
Position = dict


class ResumeRefused(ValueError):
    """The saved stream cannot continue exactly under this run's layout; the message says why."""


def positions_from_ranks(states: list[dict], allow_inside_step: bool = False) -> tuple[dict[int, Position], int, int]:
    """(position of every stream, number of streams, global rows per step) from the states of all saved ranks.

    A state saved inside an optimizer step is refused unless `allow_inside_step` (the caller resumes on the very
    layout that saved it and skips the micro-batches already handed out).
    """
    if not states:
        raise ResumeRefused("data loader state: the checkpoint holds no data-loader state")
    if "streams" in states[0]:
        return _positions_of_sliced_run(states, allow_inside_step)
    return _positions_of_first_layout(states)


def _positions_of_first_layout(states: list[dict]) -> tuple[dict[int, Position], int, int]:
    """Readers `rank * workers + k` of a run still on the layout it started with; batches are `micro_batch_size`."""
    first = states[0]
    if len(states) != first["dp_world_size"]:
        raise ResumeRefused(f"data loader state: {len(states)} rank states saved for {first['dp_world_size']} ranks")
    grad_accum, micro_batch_size = first["grad_accum"], first["micro_batch_size"]
    positions: dict[int, Position] = {}
    for rank, state in enumerate(states):
        handed_out = sum(int(saved["progress"].get("batches", 0)) for saved in state["readers"])
        if handed_out % grad_accum:
            raise ResumeRefused(
                f"data loader state: rank {rank} saved after {handed_out} micro-batches, in the middle of an "
                f"optimizer step of {grad_accum}; only a checkpoint taken between steps can change the layout"
            )
        for local, saved in enumerate(state["readers"]):
            positions[rank * len(state["readers"]) + local] = {
                "snapshot": saved["snapshot"],
                "replay_rows": saved["replay"] * micro_batch_size,
            }
    global_rows = first["dp_world_size"] * grad_accum * micro_batch_size
    return positions, len(positions), global_rows


def _positions_of_sliced_run(states: list[dict], allow_inside_step: bool) -> tuple[dict[int, Position], int, int]:
    """A run that was itself resliced: every stream is held by at least one rank (identically by all)."""
    positions: dict[int, Position] = {}
    for rank, state in enumerate(states):
        if state["into_step"] and not allow_inside_step:
            raise ResumeRefused(
                f"data loader state: rank {rank} saved {state['into_step']} micro-batches into an optimizer step; "
                f"only a checkpoint taken between steps can change the layout"
            )
        for stream, reader_state in state["streams"].items():
            positions[int(stream)] = {"snapshot": reader_state, "replay_rows": 0}
    num_streams = states[0]["num_streams"]
    if sorted(positions) != list(range(num_streams)):
        raise ResumeRefused(f"data loader state: streams {sorted(positions)} saved, expected 0..{num_streams - 1}")
    return positions, num_streams, states[0]["global_rows"]


class SlicedStreams:
    """One rank's micro-batches from its slice of every step's stream-major global rows (see module docstring)."""

    def __init__(
        self,
        make_reader: Callable[[int], TrainReader],
        positions: dict[int, Position],
        num_streams: int,
        global_rows: int,
        rank: int,
        rows_per_rank: int,
        micro_batch_size: int,
    ):
        if global_rows % num_streams:
            raise ResumeRefused(
                f"data loader state: a global batch of {global_rows} rows does not split evenly over the "
                f"{num_streams} saved streams (ranks x workers of the run that started them)"
            )
        self.num_streams, self.global_rows = num_streams, global_rows
        self.rows_per_stream = global_rows // num_streams
        self.first_row, self.rows_per_rank = rank * rows_per_rank, rows_per_rank
        self.micro_batch_size = micro_batch_size
        last_row = self.first_row + rows_per_rank - 1
        streams = range(self.first_row // self.rows_per_stream, last_row // self.rows_per_stream + 1)
        self.readers = {stream: _restore(make_reader(stream), positions[stream]) for stream in streams}
        self.step_start = {stream: reader.state_dict() for stream, reader in self.readers.items()}
        self.pending: list[Batch] = []
        self.into_step = 0

    def skip(self, micro_batches: int) -> None:
        """Resume `micro_batches` into the current step (same layout only)."""
        for _ in range(micro_batches):
            next(iter(self))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            if not self.pending:
                self._draw_step()
            self.into_step += 1
            yield self.pending.pop(0)

    def _draw_step(self) -> None:
        self.step_start = {stream: reader.state_dict() for stream, reader in self.readers.items()}
        self.into_step = 0
        rows = []
        for stream, reader in self.readers.items():
            for index in range(self.rows_per_stream):
                block = reader.next_block()
                if self.first_row <= stream * self.rows_per_stream + index < self.first_row + self.rows_per_rank:
                    rows.append(block)
        any_reader = next(iter(self.readers.values()))
        eos_id, cfg = any_reader.encoder.eos_id, any_reader.cfg
        self.pending = [
            make_batch(
                np.stack(rows[start : start + self.micro_batch_size]),
                eos_id,
                cfg.per_document_attention,
                label_roles=cfg.label_roles,
            )
            for start in range(0, len(rows), self.micro_batch_size)
        ]

    def state_dict(self) -> dict:
        """Between steps: the readers as they stand; inside a step: as the step started, plus batches handed out."""
        between_steps = not self.pending
        if between_steps:
            streams = {stream: reader.state_dict() for stream, reader in self.readers.items()}
        else:
            streams = self.step_start
        return {
            "num_streams": self.num_streams,
            "global_rows": self.global_rows,
            "streams": streams,
            "into_step": 0 if between_steps else self.into_step,
        }

    def counters(self) -> dict[str, float]:
        """Sums over the streams whose first row of a step is this rank's (each stream counts on one rank);
        epochs over every stream this rank reads."""
        cfg = next(iter(self.readers.values())).cfg
        progress = {stream: reader.progress() for stream, reader in self.readers.items()}
        owned = [
            p
            for stream, p in progress.items()
            if self.first_row <= stream * self.rows_per_stream < self.first_row + self.rows_per_rank
        ]
        counters = combine(owned, cfg)
        epochs = combine(progress.values(), cfg)
        counters.update({name: value for name, value in epochs.items() if name.startswith(EPOCH_PREFIX)})
        return counters


def _restore(reader: TrainReader, position: Position) -> TrainReader:
    if position["snapshot"] is not None:
        reader.load_state_dict(position["snapshot"])
    for _ in range(position["replay_rows"]):
        reader.next_block()
    return reader
