"""A study run's small result files, copied into a committed folder so that a study resumes in a fresh clone.

Run folders (`--runs-dir`, git-ignored) hold checkpoints and vanish with the machine; `--archive DIR` keeps, per
finished run, `DIR/<run name>/` with what the report, `runs.csv`, the statistics and the plot read: `eval.json`,
`answers.jsonl.gz`, `metrics.jsonl.gz` (the two large files compressed: ~1.2 MB of training records per 1,000 steps
becomes ~0.2 MB; gzip without a timestamp, so archiving a run again writes the same bytes), `recipe.yaml` and
`study.json`. Never a checkpoint. A copy is written into a temporary folder and renamed into place, so an archived
run is either complete or absent.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

COMPRESSED = ("answers.jsonl", "metrics.jsonl")
ARCHIVED = ("eval.json", *(f"{name}.gz" for name in COMPRESSED), "recipe.yaml", "study.json")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ARCHIVED)


def archive_run(run_dir: Path, folder: Path) -> None:
    """Copy a finished run's result files from `run_dir` into `folder` (replacing an earlier, partial copy)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in ARCHIVED:
        if name.removesuffix(".gz") in COMPRESSED:
            with (run_dir / name.removesuffix(".gz")).open("rb") as source, (partial / name).open("wb") as target:
                with gzip.GzipFile(filename="", mode="wb", fileobj=target, mtime=0) as packed:
                    shutil.copyfileobj(source, packed)
        else:
            shutil.copy2(run_dir / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def read_text(folder: Path, name: str) -> str | None:
    """`folder/name`, or its archived `name.gz`, as text; None when neither exists."""
    plain, packed = folder / name, folder / f"{name}.gz"
    if plain.is_file():
        return plain.read_text()
    if packed.is_file():
        return gzip.decompress(packed.read_bytes()).decode()
    return None


def read_answers(folder: Path) -> list[dict] | None:
    """The `ntl-pretrain eval --answers` records of a run folder or its archived copy; None when it has none."""
    text = read_text(folder, "answers.jsonl")
    return None if text is None else [json.loads(line) for line in text.splitlines() if line.strip()]
