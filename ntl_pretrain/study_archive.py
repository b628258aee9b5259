"""A study run's small result files, copied into a committed folder so that a study resumes in a fresh clone.

Run folders (`--runs-dir`, git-ignored) hold checkpoints and vanish with the machine; `--archive DIR` keeps, per
finished run, `DIR/<run name>/` with what the report, `runs.csv`, the statistics and the plot read:
`eval.json`, `answers.jsonl.gz` (the answers compressed: ~10x smaller), `metrics.jsonl`, `recipe.yaml` and
`study.json`. Never a checkpoint. A copy is written into a temporary folder and renamed into place, so an archived
run is either complete or absent.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

ANSWERS = "answers.jsonl"
ARCHIVED = ("eval.json", f"{ANSWERS}.gz", "metrics.jsonl", "recipe.yaml", "study.json")


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ARCHIVED)


def archive_run(run_dir: Path, folder: Path) -> None:
    """Copy a finished run's result files from `run_dir` into `folder` (replacing an earlier, partial copy)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in ARCHIVED:
        if name == f"{ANSWERS}.gz":
            with (run_dir / ANSWERS).open("rb") as source, gzip.open(partial / name, "wb") as target:
                shutil.copyfileobj(source, target)
        else:
            shutil.copy2(run_dir / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def read_answers(folder: Path) -> list[dict] | None:
    """The `ntl-pretrain eval --answers` records of a run folder or its archived copy; None when it has none."""
    plain, packed = folder / ANSWERS, folder / f"{ANSWERS}.gz"
    if plain.is_file():
        text = plain.read_text()
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode()
    else:
        return None
    return [json.loads(line) for line in text.splitlines() if line.strip()]
