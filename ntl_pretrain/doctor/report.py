"""Check results: one row per check, merged over ranks, printed as a table and written as JSON."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Check:
    name: str
    ok: bool | None
    """None: skipped (`figure` says why)."""
    figure: str
    detail: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "skip" if self.ok is None else ("ok" if self.ok else "FAIL")


def guarded(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """The checks `run` returns, or one failed check naming the exception it raised: a broken check is reported,
    and the checks after it still run."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - every failure becomes a row of the report
        return [Check(name, False, f"{type(error).__name__}: {error}", {"traceback": traceback.format_exc()})]


def merge_ranks(per_rank: list[list[Check]]) -> list[Check]:
    """One row per check name (in the order ranks report them): failed when any rank failed it (the figure names
    those ranks), else rank 0's row. By name, not position: a check that raised on one rank is one row there."""
    names = list(dict.fromkeys(check.name for rows in per_rank for check in rows))
    merged = []
    for name in names:
        rows = {rank: check for rank, checks in enumerate(per_rank) for check in checks if check.name == name}
        failed = [rank for rank, row in rows.items() if row.ok is False]
        first = rows[failed[0]] if failed else next(iter(rows.values()))
        many = len(per_rank) > 1
        figure = f"rank {', '.join(map(str, failed))}: {first.figure}" if failed and many else first.figure
        detail = {f"rank{rank}": row.detail for rank, row in rows.items()} if many else first.detail
        merged.append(Check(name, False if failed else first.ok, figure, detail))
    return merged


def table(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = [f"{'check':<{width}}  {'':4}  figure", f"{'-' * width}  ----  ------"]
    lines += [f"{check.name:<{width}}  {check.status:<4}  {check.figure}" for check in checks]
    lines.append(summary_line(checks))
    return "\n".join(lines)


def summary_line(checks: list[Check]) -> str:
    """`11 passed, 3 skipped (name: why; ...)`, failures first: "all passed" would hide what was not checked."""
    counts = {status: sum(check.status == status for check in checks) for status in ("FAIL", "ok", "skip")}
    parts = [f"{counts['FAIL']} failed"] if counts["FAIL"] else []
    parts.append(f"{counts['ok']} passed")
    skipped = [f"{check.name}: {check.figure}" for check in checks if check.status == "skip"]
    if skipped:
        parts.append(f"{len(skipped)} skipped ({'; '.join(skipped)})")
    return f"{', '.join(parts)} of {len(checks)} checks"


def write_json(checks: list[Check], path: Path, world_size: int) -> None:
    report = {"world_size": world_size, "ok": all(check.ok is not False for check in checks),
              "checks": [{**asdict(check), "status": check.status} for check in checks]}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
