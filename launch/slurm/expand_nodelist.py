"""Expand a Slurm node list (`gpu[01-03,07],login1`) into one host name per line, in order.

`scontrol show hostnames` does this where Slurm is installed; `train.sbatch` falls back to this file elsewhere
(dry runs on a laptop, the tests). Bracket groups may repeat (`rack[1-2]-n[1-2]`); zero padding is kept.
"""

from __future__ import annotations

import re
import sys

BRACKET = re.compile(r"\[([^\]]+)\]")


def split_top_level(nodelist: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in nodelist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current else parts


def expand_ranges(ranges: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07']."""
    names = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        width = len(low)
        names += [str(number).zfill(width) for number in range(int(low), int(high or low) + 1)]
    return names


def expand(pattern: str) -> list[str]:
    match = BRACKET.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + name + rest for name in expand_ranges(match.group(1)) for rest in expand(tail)]


def hostnames(nodelist: str) -> list[str]:
    return [host for part in split_top_level(nodelist.strip()) for host in expand(part)]


if __name__ == "__main__":
    print("\n".join(hostnames(sys.argv[1])))
