"""Packing, labels and position ids against plain-Python references; the validation pass across ranks."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from ntl_pretrain.data import DataConfig, SourceConfig
from ntl_pretrain.data.commands import CORPUS
from ntl_pretrain.data.packing import IGNORE_INDEX, Packer, make_batch
from ntl_pretrain.data.pipeline import DocumentEncoder, validation_batches

EOS = 0


def random_documents(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    return [np.append(rng.integers(1, 50, rng.integers(1, 30)), EOS).astype(np.int32) for _ in range(count)]


def test_blocks_overlap_by_one_token_and_drop_nothing():
    documents = random_documents(np.random.default_rng(0), 40)
    stream = np.concatenate(documents)
    packer, blocks = Packer(seq_len=16), []
    for document in documents:
        packer.add(document)
        while packer.has_block():
            blocks.append(packer.take_block())
    expected = [stream[k * 16 : k * 16 + 17] for k in range((len(stream) - 1) // 16)]
    assert len(blocks) == len(expected)
    for got, want in zip(blocks, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    state = packer.state_dict()["tokens"].numpy()
    np.testing.assert_array_equal(state, stream[len(blocks) * 16 :])


class CountedTokens(np.ndarray):
    """A document that counts the tokens numpy functions read from it or from any view of it (`np.concatenate`,
    copies): work counted, not timed, so that a loaded machine cannot fail the test. Re-joining the pending
    document for every block (the quadratic packer this test caught) reads all of it per block. What a function
    returns is counted in turn when read again."""

    read = 0

    def __array_function__(self, func, types, args, kwargs):
        CountedTokens.read += sum(arg.size for arg in _arrays(args) if isinstance(arg, CountedTokens))
        result = super().__array_function__(func, types, args, kwargs)
        return result.view(CountedTokens) if isinstance(result, np.ndarray) else result


def _arrays(args) -> list:
    found = []
    for arg in args:
        found += _arrays(arg) if isinstance(arg, (list, tuple)) else [arg]
    return found


def tokens_read_packing(length: int, seq_len: int) -> int:
    document = np.arange(length, dtype=np.int32).view(CountedTokens)
    packer, blocks = Packer(seq_len), 0
    CountedTokens.read = 0
    packer.add(document)
    while packer.has_block():
        block = packer.take_block()
        blocks += 1
    np.testing.assert_array_equal(block, np.arange((blocks - 1) * seq_len, blocks * seq_len + 1))
    return CountedTokens.read


def test_packing_one_long_document_reads_each_token_a_bounded_number_of_times():
    """Linear, not quadratic, in the document's length: 4x the tokens read at most 4.1x as many (the quadratic
    packer: ~16x), and each token about once per block it is in (twice at most: blocks overlap by one token)."""
    short, long = tokens_read_packing(100_000, 32), tokens_read_packing(400_000, 32)
    assert short > 0, "the counter saw no read: the packer no longer reads through numpy functions"
    assert long <= 4.1 * short, f"4x the tokens read {long / short:.1f}x as many"
    assert long <= 2 * 400_000, long


def test_state_of_a_partly_packed_long_document_resumes_the_same_blocks():
    documents = [np.arange(1000, dtype=np.int32), np.arange(5, dtype=np.int32), np.arange(300, dtype=np.int32)]
    packer = Packer(seq_len=64)
    for document in documents:
        packer.add(document)
    first = [packer.take_block() for _ in range(7)]
    resumed = Packer(seq_len=64)
    resumed.load_state_dict(packer.state_dict())
    rest, resumed_rest = [], []
    while packer.has_block():
        rest.append(packer.take_block())
        resumed_rest.append(resumed.take_block())
    assert not resumed.has_block()
    stream = np.concatenate(documents)
    for index, block in enumerate(first + rest):
        np.testing.assert_array_equal(block, stream[index * 64 : index * 64 + 65])
    for got, want in zip(resumed_rest, rest, strict=True):
        np.testing.assert_array_equal(got, want)


def reference_sample(block: list[int], per_document: bool) -> tuple[list[int], list[int], list[int]]:
    inputs, labels, positions, position = block[:-1], list(block[1:]), [], 0
    for index, token in enumerate(inputs):
        positions.append(position if per_document else index)
        position = 0 if token == EOS else position + 1
        if per_document and token == EOS:
            labels[index] = IGNORE_INDEX
    return inputs, labels, positions


@pytest.mark.parametrize("per_document", [False, True])
def test_labels_are_shifted_and_positions_reset_after_eos(per_document):
    blocks = np.stack([np.concatenate(random_documents(np.random.default_rng(seed), 8))[:25] for seed in (1, 2, 3)])
    batch = make_batch(blocks, EOS, per_document)
    for row, block in enumerate(blocks.tolist()):
        inputs, labels, positions = reference_sample(block, per_document)
        assert batch["input_ids"][row].tolist() == inputs
        assert batch["labels"][row].tolist() == labels
        assert batch["position_ids"][row].tolist() == positions
    assert all(tensor.dtype == torch.int64 and tensor.shape == (3, 24) for tensor in batch.values())


def write_validation(tmp_path) -> DataConfig:
    lines = [json.dumps({"text": f"held out passage {i} " + "word " * (i % 13)}) for i in range(50)]
    (tmp_path / "val.jsonl").write_text("\n".join(lines) + "\n")
    source = SourceConfig(path=str(tmp_path / "val.jsonl"))
    return DataConfig(sources=[source], validation=[source], seq_len=32, tokenize_batch=7)


@pytest.mark.parametrize("world", [2, 3])
def test_validation_ranks_are_disjoint_complete_and_equally_long(tmp_path, world):
    cfg = write_validation(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    encoder = DocumentEncoder(tokenizer)

    def labelled_rows(rank: int, world_size: int) -> list[tuple]:
        batches = list(validation_batches(cfg, encoder, 4, rank, world_size, Counter()))
        rows = [
            (tuple(ids.tolist()), tuple(labels.tolist()))
            for batch in batches
            for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
            if (labels != IGNORE_INDEX).any()
        ]
        return batches, rows

    single_batches, single_rows = labelled_rows(0, 1)
    per_rank = [labelled_rows(rank, world) for rank in range(world)]
    assert len({len(batches) for batches, _ in per_rank}) == 1
    assert sorted(row for _, rows in per_rank for row in rows) == sorted(single_rows)
    labels = torch.cat([batch["labels"] for batch in single_batches])
    tokens = sum(len(tokenizer(json.loads(line)["text"])["input_ids"]) + 1 for line in open(tmp_path / "val.jsonl"))
    assert int((labels != IGNORE_INDEX).sum()) == tokens - 1


def test_each_validation_source_is_packed_on_its_own(tmp_path):
    """Two held-out sources: every source's labelled tokens are its own documents' tokens after the first, with no
    block joining the end of one source to the start of the next (the trainer and `ntl-pretrain eval` agree)."""
    tokenizer = AutoTokenizer.from_pretrained(CORPUS / "tiny-tokenizer")
    sources, streams = [], []
    for name, words in (("first", "alpha "), ("second", "beta gamma ")):
        texts = [f"{name} {i} " + words * (i % 5) for i in range(9)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        sources.append(SourceConfig(path=str(tmp_path / f"{name}.jsonl")))
        streams.append([token for text in texts for token in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]])
    cfg = DataConfig(sources=sources, validation=sources, seq_len=16, tokenize_batch=4)
    batches = list(validation_batches(cfg, DocumentEncoder(tokenizer), 3, 0, 1, Counter()))
    labels = torch.cat([batch["labels"] for batch in batches]).flatten()
    assert labels[labels != IGNORE_INDEX].tolist() == streams[0][1:] + streams[1][1:]
