"""The pages a newcomer reads: README.md, docs/*.md and the archive of earlier rounds, docs/archive/*.md. Study
reports under docs/study-v*/ and the raw GPU outputs under docs/gpu-runs/ are records written by code."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def doc_pages() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "docs" / "archive").glob("*.md")),
    ]
