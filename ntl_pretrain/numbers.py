"""Which tokens are numbers, what they are worth, and which class they belong to, for any tokenizer.

A number token is one whose surface text, after removing one leading marker (byte-level `Ġ`, SentencePiece `▁`,
a plain space, or WordPiece `##`), is one or more ASCII digits. Its class is (marker, digit count): NTL compares a
label only with tokens of its own class, so a 3-digit chunk competes with 3-digit chunks, and ` 7` with ` 7`-like
tokens, never across. For a single-digit tokenizer all ten digits form one class, which is the paper's NTL.
Its scale `s = 10**(digits-1)` keeps multi-digit losses on the digit scale so that λ carries over between
tokenizers. Each number token also keeps its digits (leading zeros too: `007` is 0, 0, 7) for the digit-wise NTL.

The number-level loss also needs to know where a number goes on: an unmarked number token continues the number
before it (Llama-3 `"123","45"` is 12345), a marked one starts a new one; in a WordPiece vocabulary only `##`
continues. And which tokens are a decimal point (surface exactly `.`), which `float_level` lets join two runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

SPACE_MARKERS = ("Ġ", "▁", " ")
WORDPIECE_MARKER = "##"
MARKER_NAMES = ("none", "space", "wordpiece")
DIGITS = re.compile(r"[0-9]+")
DECIMAL_POINT = "."


@dataclass(frozen=True)
class NumberClass:
    marker: str
    """One of MARKER_NAMES."""
    digits: int
    """Digit count of every token in the class."""


def parse_number_token(surface: str) -> tuple[str, int, int] | None:
    """(marker, digit count, value) of a token's surface text, or None when it is not a number token."""
    parsed = parse_number_digits(surface)
    return None if parsed is None else (parsed[0], len(parsed[1]), int(parsed[1]))


def parse_number_digits(surface: str) -> tuple[str, str] | None:
    """(marker, digit string) of a token's surface text, or None when it is not a number token."""
    marker = "none"
    if surface.startswith(WORDPIECE_MARKER):
        marker, surface = "wordpiece", surface[len(WORDPIECE_MARKER) :]
    elif surface[:1] in SPACE_MARKERS:
        marker, surface = "space", surface[1:]
    if not DIGITS.fullmatch(surface):
        return None
    return marker, surface


@dataclass(frozen=True)
class NumberShard:
    """The number-token columns of one vocabulary shard (the whole vocabulary when not sharded), on one device."""

    vocab: NumberVocab
    """The full vocabulary's tables on the same device (labels are global ids)."""
    local_ids: torch.Tensor
    """int64 [K]: column of each number token within the shard."""
    values: torch.Tensor
    """float32 [K]: their values."""
    classes: torch.Tensor
    """int64 [K]: their class ids."""
    class_spread: torch.Tensor
    """float64 [C]: see NumberVocab.class_spread."""
    digits: torch.Tensor
    """float32 [K, D]: their digits (see NumberVocab.digits)."""


@dataclass
class NumberVocab:
    """Per-token number facts over a vocabulary of `vocab_size` ids (tensors live on CPU; see `to`)."""

    values: torch.Tensor
    """float32 [V]: numeric value of each number token, NaN elsewhere."""
    classes: torch.Tensor
    """int64 [V]: index into `class_info` of each number token, -1 elsewhere."""
    scales: torch.Tensor
    """float32 [V]: per-token scale s = 10**(digits-1), NaN elsewhere."""
    class_info: tuple[NumberClass, ...]
    """What each class id means."""
    decimal_points: torch.Tensor
    """bool [V]: the token's surface is exactly a decimal point."""
    class_continues: torch.Tensor
    """bool [C]: a token of the class continues a number whose previous token is a number token (unmarked tokens
    do; in a WordPiece vocabulary, one with `##` number tokens, only `##` tokens do)."""
    class_digits: torch.Tensor
    """int64 [C]: digit count of the class's tokens."""
    digits: torch.Tensor
    """uint8 [V, D]: each number token's digits, most significant first, zero-padded on the right to D, the
    longest token's digit count (0 everywhere else). Tokens of one class have equally many digits, so padding never
    separates two members of a class."""
    _device_copies: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.values.numel()

    @property
    def number_ids(self) -> torch.Tensor:
        """int64 [K]: ids of the number tokens, ascending."""
        return torch.nonzero(self.classes >= 0).flatten()

    @property
    def num_number_tokens(self) -> int:
        return int((self.classes >= 0).sum())

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> NumberVocab:
        """Read the number tokens of an HF tokenizer (never modifies it). `vocab_size` is the model's output
        size when it pads past the tokenizer; padded ids are not numbers."""
        surfaces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        return cls.from_surfaces(surfaces, vocab_size)

    @classmethod
    def from_surfaces(cls, surfaces: list[str | None], vocab_size: int | None = None) -> NumberVocab:
        """Like `from_tokenizer`, from the surface text of ids 0..len(surfaces)-1."""
        size = len(surfaces) if vocab_size is None else vocab_size
        if size < len(surfaces):
            raise ValueError(f"vocab_size={size} is smaller than the tokenizer's {len(surfaces)} tokens")
        parsed_digits = {i: p for i, s in enumerate(surfaces) if s and (p := parse_number_digits(s)) is not None}
        parsed = {i: (marker, len(text), int(text)) for i, (marker, text) in parsed_digits.items()}
        class_info = tuple(
            sorted(
                {NumberClass(marker, digits) for marker, digits, _ in parsed.values()},
                key=lambda c: (MARKER_NAMES.index(c.marker), c.digits),
            )
        )
        class_index = {c: i for i, c in enumerate(class_info)}
        values = torch.full((size,), float("nan"), dtype=torch.float32)
        scales = torch.full((size,), float("nan"), dtype=torch.float32)
        classes = torch.full((size,), -1, dtype=torch.int64)
        for token_id, (marker, digits, value) in parsed.items():
            values[token_id] = value
            scales[token_id] = 10.0 ** (digits - 1)
            classes[token_id] = class_index[NumberClass(marker, digits)]
        longest = max((len(text) for _, text in parsed_digits.values()), default=0)
        digits = torch.zeros((size, longest), dtype=torch.uint8)
        for token_id, (_, text) in parsed_digits.items():
            digits[token_id, : len(text)] = torch.tensor([int(d) for d in text], dtype=torch.uint8)
        decimal_points = torch.zeros(size, dtype=torch.bool)
        decimal_points[[i for i, s in enumerate(surfaces) if s == DECIMAL_POINT]] = True
        markers = [c.marker for c in class_info]
        joining = "wordpiece" if "wordpiece" in markers else "none"
        return cls(
            values=values,
            classes=classes,
            scales=scales,
            class_info=class_info,
            decimal_points=decimal_points,
            class_continues=torch.tensor([m == joining for m in markers], dtype=torch.bool),
            class_digits=torch.tensor([c.digits for c in class_info], dtype=torch.int64),
            digits=digits,
        )

    @property
    def class_spread(self) -> torch.Tensor:
        """float64 [C]: (largest - smallest value) / scale per class, the largest distance NTL-WAS can see
        (float64 so that fp64 losses get it exactly; fp32 losses round it once)."""
        spread = torch.zeros(len(self.class_info), dtype=torch.float64)
        for i in range(len(self.class_info)):
            members = self.values[self.classes == i].double()
            spread[i] = (members.max() - members.min()) / 10.0 ** (self.class_info[i].digits - 1)
        return spread

    def shard(self, vocab_start: int, vocab_end: int, device: torch.device | str) -> NumberShard:
        """The number tokens among columns [vocab_start, vocab_end), with ids local to that shard, on `device`;
        built once per (range, device) and reused."""
        if not 0 <= vocab_start < vocab_end <= self.vocab_size:
            raise ValueError(
                f"vocabulary shard [{vocab_start}, {vocab_end}) is outside the {self.vocab_size}-token "
                f"vocabulary this NumberVocab describes"
            )
        key = (vocab_start, vocab_end, torch.device(device))
        if key not in self._device_copies:
            ids = self.number_ids
            ids = ids[(ids >= vocab_start) & (ids < vocab_end)]
            on = self.to(device)
            self._device_copies[key] = NumberShard(
                vocab=on,
                local_ids=(ids - vocab_start).to(device),
                values=self.values[ids].to(device),
                classes=self.classes[ids].to(device),
                class_spread=self.class_spread.to(device),
                digits=self.digits[ids].float().to(device),
            )
        return self._device_copies[key]

    def require_numbers(self, way_out: str = "use loss.ntl.kind: null") -> None:
        """Raise when NTL is asked for but the vocabulary has no number token; `way_out` in the caller's words."""
        if not self.class_info:
            raise ValueError(
                "NTL needs number tokens, but this tokenizer has none (no token whose text is ASCII "
                f"digits, optionally after a Ġ/▁/space/## marker); {way_out}"
            )

    def to(self, device: torch.device | str) -> NumberVocab:
        """This vocabulary with tensors on `device`; copies are made once per device and reused."""
        device = torch.device(device)
        if self.values.device == device:
            return self
        if device not in self._device_copies:
            self._device_copies[device] = NumberVocab(
                values=self.values.to(device),
                classes=self.classes.to(device),
                scales=self.scales.to(device),
                class_info=self.class_info,
                decimal_points=self.decimal_points.to(device),
                class_continues=self.class_continues.to(device),
                class_digits=self.class_digits.to(device),
                digits=self.digits.to(device),
            )
        return self._device_copies[device]

    def describe(self) -> str:
        """One line per class: marker, digits, count, value range."""
        lines = []
        for i, c in enumerate(self.class_info):
            members = self.values[self.classes == i]
            lines.append(
                f"class {i}: marker={c.marker} digits={c.digits} tokens={members.numel()} "
                f"values={int(members.min())}..{int(members.max())}"
            )
        return "\n".join(lines)
