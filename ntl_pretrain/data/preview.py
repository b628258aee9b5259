"""`ntl-pretrain data preview`: what the model will see, with the tokens NTL acts on made visible."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from ntl_pretrain.data.loader import build_dataloader
from ntl_pretrain.data.packing import IGNORE_INDEX

ANSI_NUMBER = ("\033[1;33m", "\033[1;36m")  # alternate colours so that adjacent digit tokens stay apart
ANSI_RESET = "\033[0m"


def highlight_numbers(tokenizer, ids: list[int], is_number: list[bool], color: bool) -> str:
    """Decode `ids`; number tokens appear as `[1|2]` (or coloured on a terminal), runs of others as text."""
    parts = []
    for number, run in itertools.groupby(zip(ids, is_number, strict=True), key=lambda pair: pair[1]):
        run_ids = [token for token, _ in run]
        if not number:
            parts.append(tokenizer.decode(run_ids))
        elif color:
            pieces = (ANSI_NUMBER[i % 2] + tokenizer.decode([t]) + ANSI_RESET for i, t in enumerate(run_ids))
            parts.append("".join(pieces))
        else:
            parts.append("[" + "|".join(tokenizer.decode([token]) for token in run_ids) + "]")
    return "".join(parts)


def number_label_fraction(batches: Iterable[dict[str, torch.Tensor]], is_number_V: torch.Tensor) -> float:
    """Share of labelled positions whose label is a number token (the positions NTL acts on)."""
    labelled = numbers = 0
    for batch in batches:
        labels = batch["labels"][batch["labels"] != IGNORE_INDEX]
        labelled += labels.numel()
        numbers += int(is_number_V[labels].sum())
    return numbers / max(1, labelled)


def preview_recipe(recipe_path: Path, overrides: list[str], samples: int, batches: int, split: str) -> float:
    """Print the first `samples` packed sequences and the number-label fraction over `batches` batches."""
    from ntl_pretrain.config.loading import load_recipe
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.tokenizer import load_tokenizer

    recipe = load_recipe(recipe_path, overrides)
    tokenizer_spec = recipe.tokenizer.path or recipe.init_from
    tokenizer = load_tokenizer(tokenizer_spec, trust_remote_code=recipe.tokenizer.trust_remote_code)
    is_number_V = NumberVocab.from_tokenizer(tokenizer).classes >= 0
    loader = build_dataloader(
        recipe.data,
        tokenizer,
        micro_batch_size=recipe.train.micro_batch_size,
        dp_rank=0,
        dp_world_size=1,
        seed=recipe.seed,
        split=split,
    )
    taken = list(itertools.islice(iter(loader), max(1, batches)))
    color = sys.stdout.isatty()
    rows = [row for batch in taken for row in batch["input_ids"]][:samples]
    for index, row in enumerate(rows):
        ids = row.tolist()
        print(f"--- sample {index} ({len(ids)} tokens) ---")
        print(highlight_numbers(tokenizer, ids, [bool(is_number_V[i]) for i in ids], color))
    fraction = number_label_fraction(taken, is_number_V)
    print(f"--- {len(taken)} batches of {recipe.train.micro_batch_size} x {recipe.data.seq_len} tokens ---")
    print(f"number-token labels: {fraction:.1%} of labelled positions")
    skipped = {name: int(value) for name, value in loader.metrics().items() if name.startswith("skipped/") and value}
    print(f"skipped records: {skipped or 'none'}")
    return fraction
