"""The loader: exact resume (twice, with workers), disjoint ranks, metrics, a real tokenizer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader
from ntl_pretrain.data.commands import CORPUS
from ntl_pretrain.data.packing import IGNORE_INDEX

TINY = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")


def write_corpus(folder: Path) -> list[SourceConfig]:
    """Three sources in two formats: Q/A jsonl (with bad lines), prose jsonl, parquet."""
    qa = [json.dumps({"question": f"What is {i} + {i * 7}?", "answer": str(i * 8)}) for i in range(300)]
    qa[10], qa[20] = "{not json", json.dumps({"question": "no answer"})
    (folder / "qa.jsonl").write_text("\n".join(qa) + "\n")
    prose = [json.dumps({"text": f"Passage {i}: " + "the cat sat on the mat. " * (1 + i % 9)}) for i in range(120)]
    (folder / "prose.jsonl").write_text("\n".join(prose) + "\n")
    pq.write_table(
        pa.table({"body": [f"Parquet row {i} costs {i * 3}.5 yen" for i in range(200)]}), folder / "p.parquet"
    )
    return corpus_sources(folder)


def corpus_sources(folder: Path) -> list[SourceConfig]:
    """The sources of the corpus `write_corpus` wrote."""
    return [
        SourceConfig(path=str(folder / "qa.jsonl"), template="{question} {answer}", weight=3.0),
        SourceConfig(path=str(folder / "prose.jsonl"), weight=1.0),
        SourceConfig(path=str(folder / "p.parquet"), text_field="body", weight=1.0),
    ]


def loader(cfg: DataConfig, rank: int = 0, world: int = 1, tokenizer=TINY, batch: int = 2):
    return build_dataloader(cfg, tokenizer, micro_batch_size=batch, dp_rank=rank, dp_world_size=world, seed=7)


def take(data_loader, count: int) -> list[dict[str, torch.Tensor]]:
    iterator = iter(data_loader)
    return [next(iterator) for _ in range(count)]


def through_checkpoint(state: dict) -> dict:
    """The state as a DeepSpeed client state round-trips: torch.save, then a weights-only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_twice_reproduces_the_uninterrupted_run(tmp_path, num_workers):
    cfg = DataConfig(sources=write_corpus(tmp_path), seq_len=48, shuffle_buffer=64, num_workers=num_workers)
    expected = take(loader(cfg, rank=1, world=2), 50)
    got, state = [], None
    for count in (7, 30, 13):  # a fresh loader (a new process in real life) resumes from each checkpoint
        resumed = loader(cfg, rank=1, world=2)
        if state is not None:
            resumed.load_state_dict(state)
        got += take(resumed, count)
        state = through_checkpoint(resumed.state_dict())
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(a[key], b[key]), f"batch {step}: {key} differs after resume"


def reader_documents(batches: list[dict], num_readers: int) -> list[list[str]]:
    """Each reader's document stream, rebuilt from its blocks (they overlap by one token)."""
    streams: list[list[int]] = [[] for _ in range(num_readers)]
    for index, batch in enumerate(batches):
        stream = streams[index % num_readers]  # workers hand out batches round-robin
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            block = [*ids.tolist(), int(labels[-1])]
            stream += block if not stream else block[1:]
    return [TINY.decode(stream).split(TINY.eos_token)[:-1] for stream in streams]


@pytest.mark.parametrize(("world", "num_workers"), [(2, 0), (3, 0), (2, 2)])
def test_ranks_and_workers_read_disjoint_complete_epochs(tmp_path, world, num_workers):
    documents = [f"record {i} " + "x" * (i % 17) for i in range(97)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))], seq_len=32, shuffle_buffer=0, num_workers=num_workers
    )
    first_epochs = []
    for rank in range(world):
        # Enough batches for every reader to finish its first epoch and start the next.
        batches = take(loader(cfg, rank, world), 40 * max(1, num_workers))
        for stream in reader_documents(batches, max(1, num_workers)):
            first_epochs.append(stream[: stream.index(stream[0], 1)])
    seen = [document for epoch in first_epochs for document in epoch]
    assert sorted(seen) == sorted(documents)


def test_metrics_count_skipped_records_and_epochs(tmp_path):
    lines = [json.dumps({"text": f"line {i}"}) for i in range(20)] + ["{bad", json.dumps({"text": ""}), "\xff"]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="latin-1")
    (tmp_path / "v.jsonl").write_text('{"text": "held out"}\n{"txt": "wrong field"}\n')
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "d.jsonl"), name="tiny")],
        validation=[SourceConfig(path=str(tmp_path / "v.jsonl"))],
        seq_len=16,
        shuffle_buffer=0,
        tokenize_batch=4,
    )
    train = loader(cfg)
    take(train, 12)  # 20 short documents (~4 tokens each) per epoch: several epochs
    metrics = train.metrics()
    epochs = metrics["epoch/tiny"]
    assert epochs >= 2 and metrics["epoch"] == epochs
    assert metrics["skipped/invalid_json"] == metrics["skipped/empty"] == metrics["skipped/invalid_utf8"] == epochs
    assert metrics["batches"] == 12
    validation = build_dataloader(cfg, TINY, micro_batch_size=2, dp_rank=0, dp_world_size=1, seed=7, split="validation")
    assert len(list(validation)) == 1
    assert validation.metrics()["skipped/missing_field"] == 1


def test_resume_refuses_a_different_world_size(tmp_path):
    cfg = DataConfig(sources=write_corpus(tmp_path)[:1], seq_len=16)
    state = loader(cfg, 0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_world_size=2 was saved"):
        loader(cfg, 0, 4).load_state_dict(state)


def test_real_sentencepiece_tokenizer_packs_its_own_encoding(tmp_path):
    from ntl_pretrain.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("pkg:mistral_common/data/tokenizer.model.v1")
    documents = [f"Item {i} costs 3.{i} dollars; total {i * 12}." for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(tmp_path / "d.jsonl"))],
        seq_len=24,
        shuffle_buffer=0,
        per_document_attention=True,
    )
    batches = take(loader(cfg, tokenizer=tokenizer), 3)
    stream = [
        t for d in documents for t in [*tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]
    for row, ids in enumerate(torch.cat([batch["input_ids"] for batch in batches])):
        assert ids.tolist() == stream[row * 24 : row * 24 + 24]
    labels = torch.cat([batch["labels"] for batch in batches])
    inputs = torch.cat([batch["input_ids"] for batch in batches])
    assert (labels[inputs == tokenizer.eos_token_id] == IGNORE_INDEX).all()


def check_counters_over_ranks(folder: str) -> None:
    import torch.distributed as dist
    from helpers.distributed import counting_collectives

    rank = dist.get_rank()
    # the parent wrote the corpus: a rank rewriting it would race with the other rank reading it
    cfg = DataConfig(sources=corpus_sources(Path(folder)), seq_len=48, shuffle_buffer=16, tokenize_batch=8)
    data_loader = loader(cfg, rank=rank, world=2)
    take(data_loader, 5 + 20 * rank)  # the ranks stand at different points
    local = data_loader.metrics()
    with counting_collectives() as calls:
        summed = data_loader.metrics(all_ranks=True)
    assert calls == {"all_gather": 1}
    per_rank: list[dict] = [{}, {}]
    dist.all_gather_object(per_rank, local)
    assert per_rank[1]["skipped/invalid_json"] == 0 < per_rank[0]["skipped/invalid_json"]  # bad lines 10, 20: even
    for name, value in summed.items():
        if name.startswith("epoch"):
            assert value == min(part[name] for part in per_rank), name
        elif not name.endswith(("_share", "/weight")):
            assert value == sum(part[name] for part in per_rank), name
    labels = [source.label for source in cfg.sources]
    assert summed["documents"] == sum(summed[f"source/{label}/documents"] for label in labels) > 0
    assert summed["skipped/invalid_json"] == sum(summed[f"source/{label}/skipped/invalid_json"] for label in labels)
    for label, weight in zip(labels, (0.6, 0.2, 0.2), strict=True):
        assert summed[f"source/{label}/weight"] == pytest.approx(weight)
        tokens = sum(part[f"source/{label}/tokens"] for part in per_rank)
        assert summed[f"source/{label}/token_share"] == pytest.approx(tokens / summed["tokens"])


@pytest.mark.slow
def test_counters_summed_over_two_gloo_ranks_equal_the_per_rank_sums(tmp_path):
    from helpers.distributed import run_distributed

    write_corpus(tmp_path)
    run_distributed(check_counters_over_ranks, 2, str(tmp_path))
