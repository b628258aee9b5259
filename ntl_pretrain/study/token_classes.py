"""Exact match on a run's answers split by how the run's tokenizer spells each reference answer.

NTL compares a label only with the number tokens of its own class (marker, digit count:
`numbers.parse_number_token`) and scales a class by 10^(digits − 1), so on a 1–3-digit tokenizer its push on a
3-digit answer token is a tenth of that on a 2-digit one (issue 38); whether it helps one class and not another is
invisible in the exact match over all answers. Each reference answer is tokenized alone (no special tokens) with the
tokenizer the run trained with: one number token names the answer's class (`2digit`, or `space_2digit` for a
marked one); anything else is `multi` (several tokens, or one token that is not a number). In the addition and
regression tasks the answer follows `=`, where the tokenizers here start a new piece, so the answer alone is spelled
as in the training text; after a space, a tokenizer that merges the space into the number (GPT-2's `Ġ42`) would
give the training text's token another marker than the answer alone, never another digit count.

The figures are computed by the study from each run's `answers.jsonl` rather than by `ntl-pretrain eval`, so that
runs archived before they existed (study v3's) get them too. Per question set and class, beside `eval.json`'s keys:
`eval/<set>/exact_match_<class>_token` (the share of that class's questions answered exactly; an answer with no
number in it is wrong, as in `exact_match`) and `eval/<set>/examples_<class>_token` (how many questions).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

from ntl_pretrain.numbers import MARKER_NAMES, parse_number_token

MULTI_TOKEN = "multi"
CLASS_KEY = re.compile(r"eval/(?P<set>[^/]+)/exact_match_(?P<label>[a-z0-9_]+)_token")


def class_label(marker: str, digits: int) -> str:
    return f"{digits}digit" if marker == "none" else f"{marker}_{digits}digit"


@functools.cache
def _tokenizer(spec: str, trust_remote_code: bool):
    from ntl_pretrain.tokenizer import load_tokenizer  # transformers: imported only when a report needs it

    return load_tokenizer(spec, trust_remote_code=trust_remote_code)


@functools.cache
def answer_class(spec: str, answer: str, trust_remote_code: bool = False) -> str:
    """The class of the token that spells `answer` under the tokenizer `spec`, or MULTI_TOKEN (module docstring)."""
    tokenizer = _tokenizer(spec, trust_remote_code)
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    number = parse_number_token(tokenizer.convert_ids_to_tokens(ids)[0]) if len(ids) == 1 else None
    return MULTI_TOKEN if number is None else class_label(*number[:2])


def trained_tokenizer(recipe_file: Path) -> tuple[str, bool] | None:
    """(spec, trust_remote_code) of the tokenizer a run trained with, read from the recipe it saved: `tokenizer.path`,
    else `init_from`'s (as the trainer chooses); None when the recipe names neither."""
    recipe = yaml.safe_load(recipe_file.read_text()) if recipe_file.is_file() else None
    tokenizer = (recipe or {}).get("tokenizer") or {}
    spec = tokenizer.get("path") or (recipe or {}).get("init_from")
    return None if spec is None else (spec, bool(tokenizer.get("trust_remote_code", False)))


def exact_match_by_class(records: list[dict], spec: str, trust_remote_code: bool = False) -> dict[str, float]:
    """`eval/<set>/exact_match_<class>_token` and `eval/<set>/examples_<class>_token` for every (set, class) that
    the records (`ntl-pretrain eval --answers`: set, answer, exact) hold."""
    exact: dict[tuple[str, str], list[bool]] = {}
    for record in records:
        label = answer_class(spec, record["answer"], trust_remote_code)
        exact.setdefault((record["set"], label), []).append(bool(record["exact"]))
    sets = list(dict.fromkeys(qa_set for qa_set, _ in exact))
    results = {}
    # In the order of the sets, then of the classes (as the report lists them), whatever the answers' order.
    for qa_set, label in sorted(exact, key=lambda pair: (sets.index(pair[0]), _class_order(pair[1]))):
        hits = exact[qa_set, label]
        results[f"eval/{qa_set}/exact_match_{label}_token"] = sum(hits) / len(hits)
        results[f"eval/{qa_set}/examples_{label}_token"] = float(len(hits))
    return results


def labels_in(keys: set[str], qa_set: str) -> list[str]:
    """The classes that `exact_match_by_class` keys of `qa_set` name, in the order of the tokenizer's classes
    (unmarked before marked, fewer digits first), MULTI_TOKEN last."""
    labels = {m["label"] for key in keys if (m := CLASS_KEY.fullmatch(key)) and m["set"] == qa_set}
    return sorted(labels, key=_class_order)


def _class_order(label: str) -> tuple[int, int]:
    if label == MULTI_TOKEN:
        return len(MARKER_NAMES), 0
    marker, _, digits = label.rpartition("_")
    return MARKER_NAMES.index(marker or "none"), int(digits.removesuffix("digit"))


def class_title(label: str) -> str:
    """How a report names the answers of a class: `2-digit-token`, `space 2-digit-token`, `multi-token`."""
    if label == MULTI_TOKEN:
        return "multi-token"
    marker, _, digits = label.rpartition("_")
    title = f"{digits.removesuffix('digit')}-digit-token"
    return f"{marker} {title}" if marker else title
