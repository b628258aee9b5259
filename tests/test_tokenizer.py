"""load_tokenizer: the offline formats, the conversion cache, and clear errors."""

import base64

import pytest
from helpers.real_tokenizers import TOKENIZER_FILES
from sentencepiece import SentencePieceProcessor

from ntl_pretrain.tokenizer import load_tokenizer, resolve_path

TEXT = "Order 66: 3 ships, 1024 crew and 12.5% fuel left in 2031."


def test_sentencepiece_conversion_encodes_like_sentencepiece():
    reference = SentencePieceProcessor(model_file=str(resolve_path(TOKENIZER_FILES["mistral"])))
    ours = load_tokenizer(TOKENIZER_FILES["mistral"])
    assert ours.encode(TEXT, add_special_tokens=False) == reference.encode(TEXT)
    assert ours.eos_token == "</s>"


def test_quicktok_conversion_keeps_special_token_ids():
    llama3 = load_tokenizer(TOKENIZER_FILES["llama3"])
    assert len(llama3) == 128_256
    assert llama3.convert_tokens_to_ids("<|begin_of_text|>") == 128_000
    assert llama3.eos_token == "<|end_of_text|>" and llama3.eos_token_id == 128_001
    # cl100k leaves id 100256 unused; its specials must keep their real ids all the same.
    cl100k = load_tokenizer(TOKENIZER_FILES["cl100k"])
    assert cl100k.convert_tokens_to_ids("<|endoftext|>") == 100_257


def test_conversion_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("NTL_PRETRAIN_CACHE", str(tmp_path))
    first = load_tokenizer(TOKENIZER_FILES["qwen2"])
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").exists()
    second = load_tokenizer(TOKENIZER_FILES["qwen2"])
    assert second.encode(TEXT) == first.encode(TEXT)
    assert list((tmp_path / "tokenizers").iterdir()) == cached


def test_resolve_path_finds_package_files_without_importing_them():
    assert resolve_path("pkg:whisper/assets/gpt2.tiktoken").is_file()  # importing whisper itself would fail
    with pytest.raises(FileNotFoundError, match="no installed package named 'not_a_package'"):
        resolve_path("pkg:not_a_package/x.json")


def test_bad_specs_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.tiktoken"):
        load_tokenizer(str(tmp_path / "missing.tiktoken"))
    unknown = tmp_path / "vocab.bin"
    unknown.write_bytes(b"\0")
    with pytest.raises(ValueError, match="unknown format of 'vocab.bin'"):
        load_tokenizer(str(unknown))
    stranger = tmp_path / "mystery.tiktoken"
    stranger.write_text(f"{base64.b64encode(b'a').decode()} 0\n")
    with pytest.raises(ValueError, match="mystery.tiktoken: unknown tiktoken vocabulary"):
        load_tokenizer(str(stranger))
