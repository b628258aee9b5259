"""Resume on a different number of ranks at the same global batch.

Data: loaders of a 2-rank run are checkpointed between optimizer steps and resumed on 1, 3 and 4 ranks (and on
other micro-batch sizes); every later optimizer step must hold exactly the rows (tokens) of the uninterrupted
2-rank run, in the same order, so no document repeats or is skipped.

Training: the 2-rank run's ZeRO-3 checkpoint (weights, Adam moments, step, scheduler, data state) continues on 1
and 3 ranks; the first resumed step must give the uninterrupted run's loss up to reduction-order rounding, and the
rest of the curve must stay within 1e-5 of it.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from helpers.launches import SAVE_AT, STEPS, partition_all_config, single_launcher_run, step_records, two_node_run
from transformers import AutoTokenizer

from ntl_pretrain import cli
from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.data import build_dataloader
from ntl_pretrain.data.commands import CORPUS
from ntl_pretrain.data.reslice import ResumeRefused

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
TOKENIZER = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
GLOBAL_ROWS, SAVED_STEPS, DATA_STEPS = 12, 2, 5


def data_config(num_workers: int = 0):
    recipe = load_recipe(TINY_RECIPE, ["data.seq_len=32", "data.shuffle_buffer=64", f"data.num_workers={num_workers}"])
    return recipe.data


def loaders(cfg, world: int, micro_batch_size: int) -> list:
    grad_accum = GLOBAL_ROWS // (world * micro_batch_size)
    return [
        build_dataloader(
            cfg,
            TOKENIZER,
            micro_batch_size=micro_batch_size,
            dp_rank=rank,
            dp_world_size=world,
            seed=3,
            grad_accum=grad_accum,
        )  # fmt: skip
        for rank in range(world)
    ]


def global_steps(rank_loaders: list, steps: int) -> list[torch.Tensor]:
    """Each optimizer step's rows `[GLOBAL_ROWS, T+1]` (inputs plus last label), ranks in order."""
    iterators = [iter(loader) for loader in rank_loaders]
    grad_accum = GLOBAL_ROWS // sum(loader.micro_batch_size for loader in rank_loaders)
    result = []
    for _ in range(steps):
        batches = [next(iterator) for iterator in iterators for _ in range(grad_accum)]
        result.append(torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in batches]))
    return result


def take(loader, count: int) -> list[dict]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(count)]


def through_checkpoint(states: list[dict]) -> list[dict]:
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed(cfg, states: list[dict], world: int, micro_batch_size: int) -> list:
    rank_loaders = loaders(cfg, world, micro_batch_size)
    for loader in rank_loaders:
        loader.load_world_state(through_checkpoint(states))
    return rank_loaders


@pytest.fixture(scope="module")
def uninterrupted():
    """Two ranks, micro-batch 2, 3 micro-batches per step: all steps, and the states after SAVED_STEPS."""
    cfg = data_config()
    reference = global_steps(loaders(cfg, 2, 2), DATA_STEPS)
    saving = loaders(cfg, 2, 2)
    global_steps(saving, SAVED_STEPS)
    return reference, [loader.state_dict() for loader in saving]


@pytest.mark.parametrize(("world", "micro_batch_size"), [(1, 4), (3, 2), (3, 1), (4, 3), (2, 3)])
def test_resume_on_other_layout_continues_the_same_global_batches(uninterrupted, world, micro_batch_size):
    reference, states = uninterrupted
    got = global_steps(resumed(data_config(), states, world, micro_batch_size), DATA_STEPS - SAVED_STEPS)
    for step, rows in enumerate(got, start=SAVED_STEPS):
        assert torch.equal(rows, reference[step]), f"step {step}: rows differ from the uninterrupted 2-rank run"


def test_resliced_run_resumes_again_on_yet_another_layout(uninterrupted):
    """2 ranks -> 3 ranks for one step -> 1 rank: still the uninterrupted run's batches."""
    reference, states = uninterrupted
    cfg = data_config()
    three = resumed(cfg, states, 3, 2)
    global_steps(three, 1)
    one = resumed(cfg, [loader.state_dict() for loader in three], 1, 6)
    for step, rows in enumerate(global_steps(one, DATA_STEPS - SAVED_STEPS - 1), start=SAVED_STEPS + 1):
        assert torch.equal(rows, reference[step])


def test_resliced_run_resumes_inside_a_step_on_its_own_layout(uninterrupted):
    reference, states = uninterrupted
    cfg = data_config()
    three = resumed(cfg, states, 3, 2)  # 2 micro-batches per rank and step
    first_half = [next(iter(loader)) for loader in three]
    again = resumed(cfg, [loader.state_dict() for loader in three], 3, 2)
    second_half = [next(iter(loader)) for loader in again]
    rows = [
        torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1)
        for pair in zip(first_half, second_half, strict=True)
        for b in pair
    ]
    assert torch.equal(torch.cat(rows), reference[SAVED_STEPS])
    with pytest.raises(ResumeRefused, match="into an optimizer step"):
        resumed(cfg, [loader.state_dict() for loader in three], 1, 4)


def test_refuses_another_global_batch_a_mid_step_state_or_other_data(uninterrupted):
    _, states = uninterrupted
    cfg = data_config()
    smaller = build_dataloader(cfg, TOKENIZER, micro_batch_size=1, dp_rank=0, dp_world_size=3, seed=3, grad_accum=2)
    with pytest.raises(ResumeRefused, match="12 sequences per optimizer step, this run takes 6"):
        smaller.load_world_state(states)
    two = loaders(cfg, 2, 2)
    for loader in two:
        next(iter(loader))  # one micro-batch of three
    with pytest.raises(ResumeRefused, match="in the middle of an optimizer step"):
        resumed(cfg, [loader.state_dict() for loader in two], 1, 4)
    longer = load_recipe(TINY_RECIPE, ["data.seq_len=48"]).data
    with pytest.raises(ResumeRefused, match="seq_len=32 was saved"):
        resumed(longer, states, 1, 4)


def test_same_ranks_with_another_global_batch_continue_each_ranks_stream(uninterrupted):
    """Changing only grad_accum keeps every rank's own stream (the data path of a batch-size change)."""
    reference, states = uninterrupted
    cfg = data_config()
    twice = [build_dataloader(cfg, TOKENIZER, micro_batch_size=2, dp_rank=rank, dp_world_size=2, seed=3, grad_accum=1)
             for rank in range(2)]  # fmt: skip
    for loader in twice:
        loader.load_world_state(through_checkpoint(states))
    rank1_rows = torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in take(twice[1], 3)])
    assert torch.equal(rank1_rows, reference[SAVED_STEPS][6:])  # rank 1's half of the next 12-row step


def test_workers_streams_continue_without_repeats_or_skips():
    """1 rank x 2 workers (2 streams) -> 3 ranks: every saved stream continues at its next row."""
    cfg = data_config(num_workers=2)
    single = build_dataloader(cfg, TOKENIZER, micro_batch_size=2, dp_rank=0, dp_world_size=1, seed=3, grad_accum=6)
    batches = iter(single)
    for _ in range(6):
        next(batches)
    states = [single.state_dict()]
    uninterrupted = [next(batches) for _ in range(12)]  # workers alternate: even batches are stream 0
    streams = [torch.cat([b["input_ids"] for b in uninterrupted[k::2]]) for k in range(2)]
    got = global_steps(resumed(data_config(), states, 3, 2), 2)
    for step, rows in enumerate(got):
        inputs = rows[:, :-1]
        assert torch.equal(inputs[:6], streams[0][6 * step : 6 * step + 6])
        assert torch.equal(inputs[6:], streams[1][6 * step : 6 * step + 6])


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
def test_training_resumes_on_another_number_of_ranks(tmp_path_factory, tmp_path, ranks):
    """The 2-rank (two-node) run's step-3 checkpoint continues on 1 and 3 ranks at the same global batch."""
    uninterrupted = two_node_run(tmp_path_factory)
    output_dir = tmp_path / "run"
    saved = f"step_{SAVE_AT}"
    shutil.copytree(uninterrupted / "checkpoints" / saved, output_dir / "checkpoints" / saved)
    single_launcher_run(output_dir, partition_all_config(tmp_path), ranks)
    continued, reference = step_records(output_dir), step_records(uninterrupted)
    assert sorted(continued) == list(range(SAVE_AT + 1, STEPS + 1))
    assert (output_dir / "checkpoints" / saved / "universal" / "zero").is_dir()
    assert cli.main(["verify", str(output_dir)]) == 0  # the universal copy and `latest_universal` are the checkpoint's
    first = SAVE_AT + 1  # same weights, optimizer state and batch: only the reduction order over ranks differs
    assert continued[first]["loss"] == pytest.approx(reference[first]["loss"], rel=1e-6)
    assert continued[first]["grad_norm"] == pytest.approx(reference[first]["grad_norm"], rel=1e-5)
    assert [continued[s]["tokens"] for s in continued] == [reference[s]["tokens"] for s in continued]
    differences = {step: continued[step]["loss"] - reference[step]["loss"] for step in continued}
    print(f"2 -> {ranks} ranks, loss difference from the uninterrupted 2-rank run by step: {differences}")
    assert all(abs(difference) < 1e-5 for difference in differences.values()), differences


def bytes_read(action) -> int:
    """Bytes this process read through read() calls while `action` ran (/proc/self/io `rchar`; a memory-mapped
    file's pages are not among them)."""

    def rchar() -> int:
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])

    before = rchar()
    action()
    return rchar() - before


def test_a_rank_reads_only_its_partition_of_a_universal_file(tmp_path):
    """DeepSpeed's ZeRO-3 universal load `torch.load`s a parameter's whole file and keeps 1/W of it: inside
    `universal_files_mapped` the file is memory-mapped, so one rank of 8 reads about its eighth, not all 32 MiB."""
    from ntl_pretrain.checkpoint.reshard import universal_files_mapped

    universal = tmp_path / "step_3" / "universal"
    path = universal / "zero" / "model.embed_tokens.weight" / "fp32.pt"
    path.parent.mkdir(parents=True)
    full = torch.arange(8 << 20, dtype=torch.float32)
    torch.save({"param": full}, path)
    partition = []

    def load_partition_of_rank_5() -> None:
        loaded = torch.load(str(path), weights_only=False)["param"].view(-1)  # DeepSpeed's call
        partition.append(loaded.narrow(0, 5 * (1 << 20), 1 << 20).clone())

    assert bytes_read(load_partition_of_rank_5) >= full.numel() * 4
    with universal_files_mapped(universal):
        assert bytes_read(load_partition_of_rank_5) < full.numel() * 4 / 8
    assert torch.equal(partition[0], full[5 << 20 : 6 << 20]) and torch.equal(partition[1], partition[0])


@pytest.mark.slow
def test_a_damaged_universal_copy_is_converted_again_from_the_shards(tmp_path_factory, tmp_path, capsys):
    """The universal copy is written with a manifest of its own; a copy damaged since (or without a manifest) is not
    loaded but converted again, and `verify` names it without calling the checkpoint damaged (it is derived)."""
    from ntl_pretrain.checkpoint import manifest
    from ntl_pretrain.checkpoint.reshard import convert_to_universal

    folder = tmp_path / f"step_{SAVE_AT}"
    shutil.copytree(two_node_run(tmp_path_factory) / "checkpoints" / folder.name, folder)
    universal = convert_to_universal(folder, workers=1)
    written = manifest.read(universal)
    assert set(written) == set(manifest.all_files(universal)) - {manifest.MANIFEST}
    assert any(name.endswith("/fp32.pt") for name in written) and manifest.universal_damage(universal) is None
    assert cli.main(["verify", str(folder)]) == 0
    assert capsys.readouterr().out == f"{folder}: intact\n"

    damaged = universal / next(name for name in sorted(written) if name.endswith("/exp_avg.pt"))
    original = damaged.read_bytes()
    damaged.write_bytes(original[:-9] + bytes([original[-9] ^ 1]) + original[-8:])  # one bit, the size unchanged
    assert manifest.universal_damage(universal, "size") is None
    assert manifest.universal_damage(universal).startswith(f"{damaged}: checksum xxh3_64 ")
    assert cli.main(["verify", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{folder}: intact" and out[1].startswith(f"{universal}: {damaged}: checksum xxh3_64 ")
    assert out[1].endswith("; a resume on another number of ranks converts it again")

    assert convert_to_universal(folder, workers=1) == universal
    assert damaged.read_bytes() == original and manifest.universal_damage(universal) is None
    assert capsys.readouterr().err.startswith(f"{universal}: {damaged}: checksum")
    (universal / manifest.MANIFEST).unlink()  # a copy written before copies had a manifest
    assert manifest.universal_damage(universal) == f"no {manifest.MANIFEST} (written before universal copies had one)"
