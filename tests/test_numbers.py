"""NumberVocab on real tokenizers, checked against an independent enumeration of each vocabulary file."""

import base64
import math
import re
import struct

import pytest
import sentencepiece
import tiktoken
import torch
from helpers.real_tokenizers import TOKENIZER_FILES, real_tokenizer
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer, models

from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import GPT2_PATTERN, resolve_path

ASCII_DIGITS = re.compile(rb"[0-9]+")


def tiktoken_number_tokens(spec: str) -> dict[int, tuple[str, bytes]]:
    """id -> (marker, digits) straight from the rank file's bytes, with no tokenizer library involved."""
    found = {}
    for line in resolve_path(spec).read_text().splitlines():
        token_b64, rank = line.split()
        raw = base64.b64decode(token_b64)
        if ASCII_DIGITS.fullmatch(raw):
            found[int(rank)] = ("none", raw)
        elif raw[:1] == b" " and ASCII_DIGITS.fullmatch(raw[1:]):
            found[int(rank)] = ("space", raw[1:])
    return found


def quicktok_number_tokens(spec: str) -> dict[int, tuple[str, bytes]]:
    blob = resolve_path(spec).read_bytes()
    (count,) = struct.unpack_from("<I", blob, 0)
    offset, found = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", blob, offset)
        raw = blob[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", blob, offset + 2 + length)
        offset += 6 + length
        if ASCII_DIGITS.fullmatch(raw):
            found[rank] = ("none", raw)
        elif raw[:1] == b" " and ASCII_DIGITS.fullmatch(raw[1:]):
            found[rank] = ("space", raw[1:])
    return found


def sentencepiece_number_tokens(spec: str) -> dict[int, tuple[str, bytes]]:
    processor = sentencepiece.SentencePieceProcessor(model_file=str(resolve_path(spec)))
    found = {}
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i).encode()
        if ASCII_DIGITS.fullmatch(piece):
            found[i] = ("none", piece)
        elif piece.startswith("▁".encode()) and ASCII_DIGITS.fullmatch(piece[3:]):
            found[i] = ("space", piece[3:])
    return found


INDEPENDENT_ENUMERATION = {
    "gpt2": tiktoken_number_tokens,
    "qwen2": tiktoken_number_tokens,
    "llama3": quicktok_number_tokens,
    "cl100k": quicktok_number_tokens,
    "mistral": sentencepiece_number_tokens,
}
# Totals written down from the field notes and the issue; the enumeration above must agree with them too.
EXPECTED_COUNTS = {"gpt2": 994 + 697, "llama3": 1110, "cl100k": 1110, "qwen2": 10, "mistral": 10}


@pytest.mark.parametrize("name", sorted(INDEPENDENT_ENUMERATION))
def test_number_tokens_match_independent_enumeration(name):
    expected = INDEPENDENT_ENUMERATION[name](TOKENIZER_FILES[name])
    nv = NumberVocab.from_tokenizer(real_tokenizer(name))

    assert len(expected) == EXPECTED_COUNTS[name]
    assert nv.number_ids.tolist() == sorted(expected)
    for token_id, (marker, digits) in expected.items():
        number_class = nv.class_info[nv.classes[token_id]]
        assert (number_class.marker, number_class.digits) == (marker, len(digits))
        assert nv.values[token_id] == int(digits)
        assert nv.scales[token_id] == 10.0 ** (len(digits) - 1)
        text = digits.decode("ascii") if isinstance(digits, bytes) else digits
        assert nv.digits[token_id].tolist() == [int(d) for d in text] + [0] * (nv.digits.shape[1] - len(text))
    non_numbers = nv.classes < 0
    assert torch.isnan(nv.values[non_numbers]).all() and torch.isnan(nv.scales[non_numbers]).all()
    assert (nv.digits[non_numbers] == 0).all()
    assert nv.digits.shape[1] == max(len(digits) for _, digits in expected.values())


def test_llama3_classes_are_one_two_and_three_digit_chunks():
    nv = NumberVocab.from_tokenizer(real_tokenizer("llama3"))
    sizes = {(c.marker, c.digits): int((nv.classes == i).sum()) for i, c in enumerate(nv.class_info)}
    assert sizes == {("none", 1): 10, ("none", 2): 100, ("none", 3): 1000}
    assert nv.class_spread.tolist() == pytest.approx([9.0, 9.9, 9.99])


def test_gpt2_space_marked_numbers_form_their_own_classes():
    nv = NumberVocab.from_tokenizer(real_tokenizer("gpt2"))
    markers = [nv.class_info[c].marker for c in nv.classes[nv.number_ids].tolist()]
    assert markers.count("none") == 994 and markers.count("space") == 697
    space_12 = real_tokenizer("gpt2").convert_tokens_to_ids("Ġ12")
    assert nv.values[space_12] == 12 and nv.class_info[nv.classes[space_12]].marker == "space"


def test_converted_gpt2_tokenizer_encodes_like_tiktoken():
    ranks = load_tiktoken_bpe(str(resolve_path(TOKENIZER_FILES["gpt2"])))
    reference = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = "In 1987, 3 cats ate 12345 mice; pi is 3.14159 and 007 is a spy. Total: 10,000,000!"
    assert real_tokenizer("gpt2").encode(text, add_special_tokens=False) == reference.encode_ordinary(text)


def test_from_tokenizer_never_mutates_the_tokenizer():
    tokenizer = real_tokenizer("mistral")
    before = (len(tokenizer), dict(tokenizer.get_vocab()))
    NumberVocab.from_tokenizer(tokenizer, vocab_size=32_064)
    assert (len(tokenizer), tokenizer.get_vocab()) == before


def test_padded_vocab_ids_are_not_numbers():
    nv = NumberVocab.from_tokenizer(real_tokenizer("qwen2"), vocab_size=151_936)
    assert nv.vocab_size == 151_936
    assert (nv.classes[len(real_tokenizer("qwen2")) :] == -1).all()
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        NumberVocab.from_tokenizer(real_tokenizer("qwen2"), vocab_size=1000)


def wordpiece_tokenizer(vocab: list[str]):
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_markers_leading_zeros_and_non_numbers():
    vocab = ["[UNK]", "12", "##34", "##5", "▁7", " 8", "007", "1.5", "-3", "²", "٣", "1e5", "a1", "##"]
    nv = NumberVocab.from_tokenizer(wordpiece_tokenizer(vocab))
    facts = {
        vocab[i]: (nv.class_info[nv.classes[i]].marker, nv.class_info[nv.classes[i]].digits, float(nv.values[i]))
        for i in nv.number_ids.tolist()
    }
    assert facts == {
        "12": ("none", 2, 12.0),
        "##34": ("wordpiece", 2, 34.0),
        "##5": ("wordpiece", 1, 5.0),
        "▁7": ("space", 1, 7.0),
        " 8": ("space", 1, 8.0),
        "007": ("none", 3, 7.0),
    }
    assert nv.classes[vocab.index("▁7")] == nv.classes[vocab.index(" 8")]
    assert math.isclose(float(nv.scales[vocab.index("007")]), 100.0)
    assert nv.digits[vocab.index("007")].tolist() == [0, 0, 7]  # leading zeros kept: the digit-wise NTL reads them
    assert nv.digits[vocab.index("##34")].tolist() == [3, 4, 0]


def test_ntl_on_a_vocabulary_without_numbers_is_a_clear_error():
    nv = NumberVocab.from_tokenizer(wordpiece_tokenizer(["[UNK]", "a", "b", "##c"]))
    with pytest.raises(ValueError, match="has none"):
        nv.require_numbers()


def test_shard_holds_only_its_columns():
    nv = NumberVocab.from_tokenizer(real_tokenizer("gpt2"))
    lo, hi = 20_000, 30_000
    shard = nv.shard(lo, hi, "cpu")
    ids = nv.number_ids
    inside = ids[(ids >= lo) & (ids < hi)]
    assert torch.equal(shard.local_ids + lo, inside)
    assert torch.equal(shard.values, nv.values[inside]) and torch.equal(shard.classes, nv.classes[inside])
    assert nv.shard(lo, hi, "cpu") is shard
    with pytest.raises(ValueError, match="outside"):
        nv.shard(0, nv.vocab_size + 1, "cpu")
