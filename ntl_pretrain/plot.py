"""`ntl-pretrain plot RUN_DIR [RUN_DIR ...] -o OUT.png`: training and numeric metrics of runs on shared axes.

Reads each run's metrics.jsonl (or metrics.jsonl.gz, a study's archived run; without the records a resume
superseded: `current_records`): training records (loss, CE, NTL; smoothed with an exponential moving average),
validation records (val_ce, val_ntl) and evaluation records (`eval/<set>/<metric>`, from `eval.every_steps` or
`ntl-pretrain eval --log-metrics`). One panel per metric, one line per run; runs of the same group (e.g. the seeds
of one study variant) share a colour. In the validation panels the trainer's periodic validation (records with
`"split": "validation"`, often the first `train.eval_max_batches` batches per rank) is a line, and `ntl-pretrain
eval --log-metrics` records (`"split": "eval"`, by default the whole split) are hollow diamonds beside it: different
measurements, never joined into one line. A metric measured once per run (a final evaluation) is drawn as one dot
per run above its group's name instead. A training NTL that is zero throughout (a CE-only run has no NTL term) is
left out rather than drawn as a flat line at 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ntl_pretrain.errors import InputError, add_verbose, run_reporting
from ntl_pretrain.outputs import IMAGE_METADATA, SIGNATURE, check_output, starts_with, write_file

TRAIN_PANELS = {
    "loss": "train loss (CE + λ·NTL)",
    "ce": "train CE",
    "ntl": "train NTL (each run's own kind)",
    "val_ce": "validation CE",
    "val_ntl": "validation NTL (each run's own kind)",
    "val_ntl_was": "validation NTL-WAS (ntl-pretrain eval)",
    "peak_mem_mib": "peak memory, MiB (CUDA allocated; CPU max RSS)",
}
EVAL_METRICS = {
    "exact_match": "exact match",
    "mae": "MAE (log scale)",
    "digit_accuracy": "digit accuracy",
}
VALIDATION_PANELS = {"val_ce", "val_ntl", "val_ntl_was"}
# Where a validation number came from: metrics.jsonl split -> (legend text, line style, marker).
VALIDATION_SOURCES = {
    "validation": ("trainer's periodic validation", "-", None),
    "eval": ("ntl-pretrain eval", "none", "D"),
}
SMOOTHED = {"loss", "ce", "ntl"}
ZERO_MEANS_ABSENT = {"ntl", "val_ntl"}  # the trainer logs 0 for a run without an NTL term
SMOOTHING = 0.9
SMOOTHED_NOTE = f"smoothed: EMA {SMOOTHING:g}; faint: as logged"  # a logged 2.34 may read 3.07 on the curve
COLUMNS = 3
IMAGE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # matplotlib picks the writer from the suffix


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The run's records in file order, without those a resume superseded (`current_records`); from
    `metrics.jsonl.gz` in a folder that has only that (a study's archived copy of a run, study/archive.py). A record
    cut short (a kill or a full disk while it was written) is skipped with a warning naming its line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file() and path.with_name("metrics.jsonl.gz").is_file():
        path = path.with_name("metrics.jsonl.gz")
    if not path.is_file():
        raise InputError(f"{run_dir}: no metrics.jsonl; name a run directory")
    records = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                records += _record(line, path, number, last=not line.endswith("\n"))
    return current_records(records)


def _record(line: str, path: Path, number: int, last: bool = False) -> list[dict]:
    """[the line's record], or [] for a record cut short: the file's unfinished last line (a kill or a full disk
    while it was written; cut anywhere, inside a string or a number too), or an earlier line of JSON that ran out of
    text (`metrics.open_for_append` ends such a line before the next record is appended)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        ran_out = error.pos >= len(line.rstrip())
        if line.lstrip().startswith("{") and (last or ran_out):
            print(f"ntl-pretrain: {path}: line {number}: skipped a record cut short ({line.strip()[:60]!r})",
                  file=sys.stderr)  # fmt: skip
            return []
        raise InputError(f"{path}: line {number}: not a JSON record ({error.msg})") from error
    if not isinstance(record, dict):
        raise InputError(f"{path}: line {number}: not a JSON record (a {type(record).__name__})")
    return [record]


def current_records(records: list[dict]) -> list[dict]:
    """Drop the records a resumed run replaced: a `split: resume` record at step S (the checkpoint it continued
    from), or `split: restart` at step 0 (an attempt killed before its first checkpoint, started again), supersedes
    every earlier record of a later step, which the run logs again (or, when it stops sooner, never reached). Of the
    records left, readers take the last one of a step."""
    kept: list[dict] = []
    for record in records:
        if record.get("split") in ("resume", "restart"):
            kept = [old for old in kept if old.get("step") is None or old["step"] <= record["step"]]
        kept.append(record)
    return kept


def series(records: list[dict], key: str, split: str | None = None) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding a finite number under `key` (only those whose `split` is `split`,
    when given), in step order; the last record of a step wins (a resumed run repeats steps)."""
    by_step = {
        record["step"]: float(record[key])
        for record in records
        if plottable(record, key) and (split is None or record.get("split") == split)
    }
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def plottable(record: dict, key: str) -> bool:
    """The record holds a finite number under `key` at a whole-number step (hand-edited or foreign records may
    hold text in either)."""
    value, step = record.get(key), record.get("step")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return is_number and isinstance(step, int) and not isinstance(step, bool)


def smooth(values: list[float], factor: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased like Adam's so that the first points are not pulled to 0."""
    average, out = 0.0, []
    for index, value in enumerate(values, start=1):
        average = factor * average + (1 - factor) * value
        out.append(average / (1 - factor**index))
    return out


def panel_keys(runs: Sequence[list[dict]]) -> list[tuple[str, str]]:
    """(metrics key, title) of every panel some run has data for."""
    present = dict.fromkeys(
        key for records in runs for record in records for key in record if plottable(record, key)
    )  # first-seen order
    panels = [(key, title) for key, title in TRAIN_PANELS.items() if key in present]
    eval_sets = dict.fromkeys(key.split("/")[1] for key in present if key.startswith("eval/") and key.count("/") == 2)
    for eval_set in eval_sets:
        for metric, title in EVAL_METRICS.items():
            key = f"eval/{eval_set}/{metric}"
            if key in present:
                panels.append((key, f"{eval_set}: {title}"))
    return panels


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    labels: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
) -> Path:
    """Draw every panel for every run into one PNG; `groups` (one per run) picks the colours and legend."""
    runs = [read_metrics(run_dir) for run_dir in run_dirs]  # a missing or damaged run is refused before matplotlib
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(run_dir).name for run_dir in run_dirs]
    figure = draw_figure(runs, list(groups) if groups else labels, [str(d) for d in run_dirs])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_format = out.suffix.lstrip(".").lower() or "png"
    metadata = IMAGE_METADATA if image_format == "png" else None  # PNG's text chunk: `plot` knows its own images
    write_file(out, lambda partial: figure.savefig(partial, dpi=110, format=image_format, metadata=metadata))
    plt.close(figure)
    return out


def draw_figure(runs: list[list[dict]], groups: list[str], names: list[str]):
    """The matplotlib figure of every panel; `groups` (one per run) picks the colours and legend, `names` say
    which runs an error is about."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panel_keys(runs)
    if not panels:
        raise InputError(f"no plottable metrics in {names}")
    rows = -(-len(panels) // COLUMNS)
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(5 * COLUMNS, 3.4 * rows), squeeze=False)
    colours = {group: f"C{index % 10}" for index, group in enumerate(dict.fromkeys(groups))}
    for axis, (key, title) in zip(axes.flat, panels, strict=False):
        _draw_panel(axis, key, title, runs, groups, colours)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    handles = [plt.Line2D([], [], color=colour, label=group) for group, colour in colours.items()]
    columns = legend_columns(list(colours), figure.get_figwidth())
    figure.legend(handles=handles, loc="upper center", ncol=columns, frameon=False)
    legend_rows = -(-len(handles) // columns)
    figure.tight_layout(rect=(0, 0, 1, 1 - (0.3 * legend_rows + 0.15) / figure.get_figheight()))
    return figure


def legend_columns(labels: list[str], width_inches: float) -> int:
    """Entries per row of the figure's legend: as many as fit its width, so that long variant names (a study's
    `regression-exact-1digit/ntl-was-answer`) wrap to another row instead of running off both edges."""
    inches_per_entry = 0.6 + 0.085 * max(len(label) for label in labels)  # the line sample, then ~10 pt text
    return max(1, min(len(labels), 6, int(width_inches // inches_per_entry)))


def _drawn_series(key: str, runs: list[list[dict]], groups: list[str], split: str | None) -> list:
    """((steps, values), group) of every run that has data for `key` in `split`."""
    drawn = [(series(records, key, split), group) for records, group in zip(runs, groups, strict=True)]
    drawn = [((steps, values), group) for (steps, values), group in drawn if values]
    if key in ZERO_MEANS_ABSENT:
        drawn = [((steps, values), group) for (steps, values), group in drawn if any(values)]
    return drawn


def _draw_panel(axis, key: str, title: str, runs: list[list[dict]], groups: list[str], colours: dict) -> None:
    splits = VALIDATION_SOURCES if key in VALIDATION_PANELS else {None: (None, "-", None)}
    drawn = {split: _drawn_series(key, runs, groups, split) for split in splits}
    measured = [items for items in drawn.values() if items]
    if len(measured) == 1 and all(len(values) == 1 for (_, values), _ in measured[0]):
        _draw_once_measured(axis, measured[0], colours)
    else:
        for split, (source, linestyle, marker) in splits.items():
            for (steps, values), group in drawn[split]:
                if key in SMOOTHED:  # the values as logged, faint, under their moving average
                    axis.plot(steps, values, color=colours[group], alpha=0.2, linewidth=0.8, label=f"{group}: logged")
                    values = smooth(values)
                shown = marker or ("o" if len(values) <= 3 else None)
                axis.plot(steps, values, color=colours[group], alpha=0.75, linewidth=1.2, linestyle=linestyle,
                          marker=shown, markerfacecolor="none" if marker else colours[group],
                          label=group if source is None else f"{group}: {source}")  # fmt: skip
        if len(measured) > 1:
            _source_legend(axis, splits)
        axis.set_xlabel("step")
    if key.endswith("/mae"):
        axis.set_yscale("log")
    axis.set_title(f"{title}\n{SMOOTHED_NOTE}" if key in SMOOTHED else title, fontsize=10)
    axis.grid(alpha=0.3)


def _source_legend(axis, splits: dict) -> None:
    import matplotlib.pyplot as plt

    handles = [plt.Line2D([], [], color="grey", linestyle=linestyle, marker=marker, markerfacecolor="none",
                          label=source) for source, linestyle, marker in splits.values()]  # fmt: skip
    axis.legend(handles=handles, fontsize=7, frameon=False)


def _draw_once_measured(axis, drawn: list, colours: dict) -> None:
    """One dot per run at its group's position, spread sideways so that seeds do not hide each other."""
    names = list(colours)
    for index, ((_, values), group) in enumerate(drawn):
        offset = 0.08 * (index % 5 - 2)
        axis.scatter([names.index(group) + offset], values, color=colours[group], alpha=0.8, s=24)
    if sum(len(name) for name in names) > 60:  # side by side they would overlap: the legend's colours name them
        axis.set_xticks(range(len(names)), [""] * len(names))
        axis.set_xlabel("variant (colours as in the legend)")
    else:
        axis.set_xticks(range(len(names)), names, fontsize=8)
    axis.set_xlim(-0.5, len(names) - 0.5)


def register(subparsers: argparse._SubParsersAction, summary: str | None = None) -> None:
    parser = subparsers.add_parser("plot", help=summary)
    parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--labels", nargs="+", default=None, help="legend label per run (default: folder name)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing -o file that `plot` did not write (its own it replaces)")  # fmt: skip
    parser.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        raise InputError(f"--labels: {len(args.labels)} labels for {len(args.run_dirs)} runs")
    if args.out.is_dir():
        raise InputError(f"-o: {args.out} is a folder; name the image to write, e.g. {args.out / 'metrics.png'}")
    check_output("-o", args.out, args.run_dirs, args.overwrite, ours=starts_with(SIGNATURE.encode()))
    if args.out.suffix.lower().lstrip(".") not in IMAGE_FORMATS:
        raise InputError(f"-o: {args.out}: name an image file ending in one of .{', .'.join(IMAGE_FORMATS)}")
    print(plot_runs(args.run_dirs, args.out, labels=args.labels))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ntl_pretrain.plot")
    register(parser.add_subparsers(dest="command", required=True))
    add_verbose(parser)
    args = parser.parse_args(["plot", *(sys.argv[1:] if argv is None else argv)])
    return run_reporting("plot", lambda: args.func(args), getattr(args, "verbose", False))


if __name__ == "__main__":
    raise SystemExit(main())
