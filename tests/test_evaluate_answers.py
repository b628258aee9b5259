"""Answer parsing and per-digit scoring against hand-worked cases."""

from decimal import Decimal

import pytest

from ntl_pretrain.evaluation.answers import digit_matches, parse_answer, place_digits


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" 289", "289"),
        ("289", "289"),
        (" -15219", "-15219"),
        ("\u22123.5", "-3.5"),  # Unicode minus
        ("+7", "7"),
        (" 3778.82", "3778.82"),
        (" 12.50", "12.5"),
        (" .5", "0.5"),
        (" -.25", "-0.25"),
        (" 1,234,567", "1234567"),
        (" 1,234.5 dollars", "1234.5"),
        (" 42 apples.", "42"),
        (" 42. The next question", "42"),
        ("The answer is -8 (check)", "-8"),
        (" 3,4", "3"),  # a comma not followed by three digits ends the number
        (" 12,3456", "12"),  # grouping must be exactly three digits
        (" 1234,567", "1234"),  # a group of four digits cannot start a comma-grouped number
        (" 007", "7"),
        (" 5 - 3", "5"),  # the first number is the answer
        ("- 4", "4"),  # a sign must touch its digits
        (" 0", "0"),
        (" -0", "0"),
        ("\u0663\u0664 or 5", "5"),  # Arabic-Indic digits are text: the first ASCII number is the answer
        ("\uff11\uff12 = 12", "12"),  # so are fullwidth digits
        (" 1\uff123", "1"),  # a non-ASCII digit ends a number like any other character
        (" 7.\u0665", "7"),  # and is no fraction
    ],
)
def test_parse_answer(text: str, expected: str) -> None:
    assert parse_answer(text) == Decimal(expected)


@pytest.mark.parametrize(
    "text", ["", "   ", "no number here", " - . , ", "-", ".", "\u0663\u0664", "\uff11\uff12", "\u0967"]
)
def test_parse_answer_without_a_number(text: str) -> None:
    assert parse_answer(text) is None


@pytest.mark.parametrize(
    ("prompt", "text", "expected"),
    [
        ("f(469,484)=", "(452,229", None),  # study v6: another question begun, read plainly as 452229
        ("f(10,66)=", "(313,283", None),
        ("f(452,229)=", "f(452,229)=681", "681"),  # the echo passed over, the answer after it read
        ("f(452,229)=", ",229)=681", "681"),
        ("How many? 3 apples", "5 apples", "5"),
        ("f(0,5)=", "5", "5"),  # a bare number the prompt also holds is an answer
        ("f(0,5)=", " 5", "5"),
        ("f(0,5)=", ",5", None),
        ("What is 40+2?", "42", "42"),
        ("What is 1,234 + 1?", " 1,235", "1235"),
        ("What is 1,234 + 1?", "1,234 + 1 is 1,235", "1235"),
    ],
)
def test_a_number_echoed_from_the_prompt_is_not_the_answer(prompt: str, text: str, expected: str | None) -> None:
    assert parse_answer(text, prompt) == (None if expected is None else Decimal(expected))
    if expected is not None:
        assert parse_answer(text) is not None


def test_exact_match_is_numeric_not_textual() -> None:
    assert parse_answer(" 12.50") == Decimal("12.5")
    assert parse_answer(" 0.30") == Decimal("0.1") + Decimal("0.2")


@pytest.mark.parametrize(
    ("value", "places"),
    [
        ("1234", {3: "1", 2: "2", 1: "3", 0: "4"}),
        ("1200", {3: "1", 2: "2", 1: "0", 0: "0"}),
        ("-3778.82", {3: "3", 2: "7", 1: "7", 0: "8", -1: "8", -2: "2"}),
        ("0.05", {0: "0", -1: "0", -2: "5"}),
        ("12.50", {1: "1", 0: "2", -1: "5"}),
        ("0", {0: "0"}),
    ],
)
def test_place_digits(value: str, places: dict[int, str]) -> None:
    assert place_digits(Decimal(value)) == places


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("289", "289", (3, 3)),
        ("288", "289", (2, 3)),
        ("-289", "289", (3, 3)),  # the sign is not a digit
        ("2890", "289", (0, 3)),  # shifted by one place: nothing in place
        ("89", "289", (2, 3)),  # the missing hundreds digit is wrong
        ("3778.8", "3778.82", (5, 6)),
        ("3778.83", "3778.82", (5, 6)),
        ("1000", "0.5", (1, 2)),  # both have units digit 0; the tenths differ
        (None, "12", (0, 2)),
    ],
)
def test_digit_matches(prediction: str | None, reference: str, expected: tuple[int, int]) -> None:
    parsed = None if prediction is None else Decimal(prediction)
    assert digit_matches(parsed, Decimal(reference)) == expected
