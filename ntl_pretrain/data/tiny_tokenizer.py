"""Train the tiny byte-level BPE tokenizer that ships in `ntl_pretrain/corpus/tiny-tokenizer/`.

Digits are split before BPE sees them, so every number is spelled in single-digit tokens (one NTL class,
exactly the paper's digit-level setting) and no merge can ever contain a digit. Training is deterministic:
the same texts in the same order give the same files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def corpus_texts(files: Iterable[Path]) -> Iterator[str]:
    """The training documents as the recipes render them: prose `text`, Q/A `question answer`."""
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                yield record["text"] if "text" in record else f"{record['question']} {record['answer']}"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
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
    # GPT-2 convention: one special token serves as BOS, EOS and padding.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS, model_max_length=4096
    )


def train_and_save(files: Iterable[Path], out_dir: Path, vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    tokenizer = train_tokenizer(corpus_texts(files), vocab_size)
    tokenizer.save_pretrained(out_dir)
    _name_portable_class(out_dir / "tokenizer_config.json")
    return tokenizer


def _name_portable_class(config_path: Path) -> None:
    """transformers 5 writes its new class name `TokenizersBackend`, which 4.x cannot load; both
    versions load a folder that names `PreTrainedTokenizerFast`."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
