"""Reading a numeric answer out of generated text, scoring it digit by digit, and profiling how answers were wrong.

A model's continuation may carry a sign, a decimal point, thousands separators and trailing words
("-1,234.50 apples."). The answer is the first number in the text; everything after it is ignored.
Values are kept as `Decimal` so that exact match is exact ("12.50" equals "12.5", 0.1 + 0.2 is not a problem).
"""

from __future__ import annotations

import math
import re
import statistics
from decimal import Decimal, InvalidOperation

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


def parse_answer(text: str) -> Decimal | None:
    """The first number in `text`, or None when there is none."""
    for match in NUMBER.finditer(text):
        integer, fraction = match.group("integer"), match.group("fraction")
        if integer is None and fraction is None:
            continue
        digits = (integer or "0").replace(",", "") + ("." + fraction if fraction else "")
        try:
            value = Decimal(digits)
        except InvalidOperation:
            continue
        return -value if match.group("sign") in MINUS_SIGNS else value
    return None


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
    NTL acts on. Integer answers only (others count as neither)."""
    exact = last_wrong = higher_wrong = 0
    distances = []
    for record in records:
        if record["exact"]:
            exact += 1
            continue
        if record["parsed"] is None:
            continue
        got, want = Decimal(record["parsed"]), Decimal(record["answer"])
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
    }
