"""Reading a numeric answer out of generated text, scoring it digit by digit, and profiling how answers were wrong.

A model's continuation may carry a sign, a decimal point, thousands separators and trailing words
("-1,234.50 apples."). The answer is the first number in the text; everything after it is ignored. A number
inside a fragment in the prompt's shape is an echo, not an answer, and is passed over: after `f(469,484)=` the
continuation `(452,229` (the model began another question) holds no answer, where a plain reading takes the
thousands-grouped 452229; `f(469,484)=953` answers 953, and a bare `5` after `f(0,5)=` answers 5 (`_echoes`).
A Q/A file's reference answers are read by the same rules, but must be one number and nothing else ("62,417",
"-3.5", "+7"); anything else ("1e3", "about 5", "") is refused, naming the file, line and value, before any run
or evaluation starts (`check_qa_file`).
Values are kept as `Decimal` so that exact match is exact ("12.50" equals "12.5", 0.1 + 0.2 is not a problem).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from decimal import Decimal, InvalidOperation
from pathlib import Path

# Sign (ASCII or Unicode minus), then either digits grouped by commas in threes or a plain run of digits,
# then an optional fraction; a bare fraction (".5") is a number too. A comma not followed by exactly three
# digits ends the number ("3,4" is 3), as does a point not followed by a digit ("12." is 12).
# Digits are ASCII only (`[0-9]`, not `\d`, which also matches "٣" or "１"): the tokenizers' number tokens and
# the NTL act on ASCII digits (`ntl_pretrain.numbers`), so other scripts' digits are text, not an answer.
NUMBER = re.compile(
    r"(?P<sign>[-+\u2212])?"
    r"(?P<integer>[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)?"
    r"(?:\.(?P<fraction>[0-9]+))?"
)
MINUS_SIGNS = ("-", "\u2212")


def parse_answer(text: str, prompt: str = "") -> Decimal | None:
    """The first number in `text` that is not an echo of `prompt`, or None when there is none."""
    for match in NUMBER.finditer(text):
        value = _value(match)
        if value is not None and not _echoes(text, match, prompt):
            return value
    return None


def _echoes(text: str, match: re.Match, prompt: str) -> bool:
    """Whether the number is part of a fragment in the shape of the prompt: the continuation from its first visible
    character through the number, with every run of digits read as one placeholder, has text before the number and
    is in the prompt's shape (`(313,283` after `f(10,66)=`: the model began another question); or the number alone
    starts a literal copy of the prompt (`1,234 + 1 is 1,235` after `What is 1,234 + 1?`). A bare number is an
    answer, also one the prompt holds (`5` after `f(0,5)=`)."""
    start = len(text) - len(text.lstrip())
    lead = text[start : match.end()]
    if _shape(lead) != _shape(match.group(0)):
        return _shape(lead) in _shape(prompt)
    return match.end() < len(text) and text[start : match.end() + 1] in prompt


def _shape(text: str) -> str:
    return re.sub("[0-9]+", "#", text)


def parse_reference(text: str) -> Decimal:
    """A reference answer: exactly one number, read as `parse_answer` reads one; ValueError otherwise."""
    match = NUMBER.fullmatch(text.strip())
    value = None if match is None else _value(match)
    if value is None:
        raise ValueError(f"answer {text!r} is not a number (digits, optionally a sign, thousands commas and a "
                         f"decimal point, as in -1,234.5)")  # fmt: skip
    return value


def _value(match: re.Match) -> Decimal | None:
    integer, fraction = match.group("integer"), match.group("fraction")
    if integer is None and fraction is None:
        return None
    digits = (integer or "0").replace(",", "") + ("." + fraction if fraction else "")
    try:
        value = Decimal(digits)
    except InvalidOperation:
        return None
    return -value if match.group("sign") in MINUS_SIGNS else value


def read_qa_file(path: Path, max_examples: int | None = None) -> list[tuple[str, str]]:
    """The first `max_examples` (question, answer) records of a jsonl Q/A file, in file order; a record that is not
    `{"question": ..., "answer": <one number>}` raises ValueError naming the file, line and value."""
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if max_examples is not None and len(records) == max_examples:
                break
            if line.strip():
                records.append(_qa_record(line, f"{path} line {number}"))
    return records


def _qa_record(line: str, where: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
        question, answer = str(record["question"]), str(record["answer"])
        parse_reference(answer)
    except (ValueError, TypeError, KeyError) as error:
        reason = f"no {error} field" if isinstance(error, KeyError) else str(error)
        raise ValueError(f"{where}: {reason}") from None
    return question, answer


def place_digits(value: Decimal) -> dict[int, str]:
    """Digit at each place value of |value|: exponent 0 is the units, -1 the tenths; no leading/trailing zeros
    beyond the units digit."""
    sign, digits, exponent = abs(value).normalize().as_tuple()
    if not isinstance(exponent, int):
        raise ValueError(f"not a finite number: {value}")
    places = {exponent + len(digits) - 1 - index: str(digit) for index, digit in enumerate(digits)}
    places.setdefault(0, "0")
    return {place: places.get(place, "0") for place in range(min(places), max(places) + 1)}


def digit_matches(prediction: Decimal | None, reference: Decimal) -> tuple[int, int]:
    """(digits of the reference that the prediction has at the same place value, digits of the reference).

    The sign is not a digit; a missing prediction gets none right.
    """
    wanted = place_digits(reference)
    if prediction is None:
        return 0, len(wanted)
    got = place_digits(prediction)
    return sum(got.get(place) == digit for place, digit in wanted.items()), len(wanted)


def error_profile(records: list[dict]) -> dict[str, float]:
    """How answers were wrong, from `ntl-pretrain eval --answers` records ("answer", "parsed", "exact"): shares of
    all answers exact, with a wrong last digit, or with the right last digit but a wrong answer (a missed carry, a
    wrong leading digit); and how far the wrong last digits were from the right ones, which is what a digit-level
    NTL acts on. Integer answers only (others count as neither). Then how large the errors were (`error_size`)."""
    exact = last_wrong = higher_wrong = 0
    distances = []
    for record in records:
        if record["exact"]:
            exact += 1
            continue
        if record["parsed"] is None:
            continue
        got, want = Decimal(record["parsed"]), parse_reference(record["answer"])
        if got != got.to_integral_value() or want != want.to_integral_value():
            continue
        got_last, want_last = place_digits(got)[0], place_digits(want)[0]
        if got_last == want_last:
            higher_wrong += 1
        else:
            last_wrong += 1
            distances.append(abs(int(got_last) - int(want_last)))
    total = max(len(records), 1)
    return {
        "exact": exact / total,
        "last_digit_wrong": last_wrong / total,
        "higher_digit_wrong": higher_wrong / total,
        "last_digit_off_by_one": distances.count(1) / len(distances) if distances else math.nan,
        "last_digit_distance": statistics.fmean(distances) if distances else math.nan,
    } | error_size(records)


TRIMMED_SHARE = 0.9
"""`trimmed_mae` keeps this share of the answers, the smallest errors: one wild answer (study v4's pilot had one off
by 316,072) moves MAE by hundreds, the trimmed mean by nothing, and a median ignores how close the rest came."""


def error_size(records: list[dict]) -> dict[str, float]:
    """How large the errors were, robust to a few wild answers: the median absolute error and the mean of the
    smallest `TRIMMED_SHARE` of them, over the answers with a number in them (as `eval`'s MAE); NaN without any."""
    errors = sorted(float(abs(Decimal(r["parsed"]) - parse_reference(r["answer"])))
                    for r in records if r["parsed"] is not None)  # fmt: skip
    if not errors:
        return {"median_ae": math.nan, "trimmed_mae": math.nan}
    kept = errors[: max(1, math.floor(TRIMMED_SHARE * len(errors)))]
    return {"median_ae": statistics.median(errors), "trimmed_mae": statistics.fmean(kept)}
