r"""Train the tiny byte-level BPE tokenizers that ship in `ntl_pretrain/corpus/`.

`tiny-tokenizer/`: digits are split before BPE sees them, so every number is spelled in single-digit tokens (one
NTL class, exactly the paper's digit-level setting) and no merge can ever contain a digit.

`tiny-tokenizer-3digit/`: the same word vocabulary and merges, plus every 2- and 3-digit string as a token, and
numbers pre-split into 1–3-digit chunks left to right as Llama-3 does (`\p{N}{1,3}`: `12345` is `123`, `45`). The
two differ only in how they spell numbers, so a study can compare them with everything else equal.

Training is deterministic: the same texts in the same order give the same files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
DIGITS = "0123456789"


def corpus_texts(files: Iterable[Path]) -> Iterator[str]:
    """The training documents as the recipes render them: prose `text`, Q/A `question answer`."""
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                yield record["text"] if "text" in record else f"{record['question']} {record['answer']}"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, max_digits: int = 1) -> PreTrainedTokenizerFast:
    """BPE over `texts` with numbers in chunks of at most `max_digits` digits (`vocab_size` counts the word
    vocabulary; the chunks' 10^2 + ... + 10^max_digits tokens come on top)."""
    tokenizer = _train_single_digit(texts, vocab_size)
    if max_digits > 1:
        tokenizer = _with_digit_chunks(tokenizer, max_digits)
    # GPT-2 convention: one special token serves as BOS, EOS and padding.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS, model_max_length=4096
    )


def _train_single_digit(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _with_digit_chunks(tokenizer: Tokenizer, max_digits: int) -> Tokenizer:
    """`tokenizer` (whose merges never touch a digit) with every 2..max_digits-digit string as a token and numbers
    pre-split into chunks of at most `max_digits` digits, left to right.

    A chunk's digits are merged in whatever order BPE's ranks pick, so every split of a string into two shorter
    digit tokens is a merge: each order ends in the whole chunk. Appended after the word merges, they leave the
    spelling of everything else unchanged."""
    spec = json.loads(tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    for length in range(2, max_digits + 1):
        for chunk in _digit_strings(length):
            vocab[chunk] = len(vocab)
            merges += [[chunk[:cut], chunk[cut:]] for cut in range(1, length)]
    digit_split = {"type": "Split", "pattern": {"Regex": f"\\p{{N}}{{1,{max_digits}}}"}, "behavior": "Isolated"}
    spec["pre_tokenizer"]["pretokenizers"][0] = {**digit_split, "invert": False}
    return Tokenizer.from_str(json.dumps(spec))


def _digit_strings(length: int) -> list[str]:
    chunks = [""]
    for _ in range(length):
        chunks = [chunk + digit for chunk in chunks for digit in DIGITS]
    return chunks


def train_and_save(
    files: Iterable[Path], out_dir: Path, vocab_size: int = 2048, max_digits: int = 1
) -> PreTrainedTokenizerFast:
    tokenizer = train_tokenizer(corpus_texts(files), vocab_size, max_digits)
    tokenizer.save_pretrained(out_dir)
    _name_portable_class(out_dir / "tokenizer_config.json")
    return tokenizer


def _name_portable_class(config_path: Path) -> None:
    """transformers 5 writes its new class name `TokenizersBackend`, which 4.x cannot load; both
    versions load a folder that names `PreTrainedTokenizerFast`."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
