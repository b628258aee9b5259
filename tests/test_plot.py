"""`ntl-pretrain plot`: which series it reads from metrics.jsonl, and that it writes a PNG of the panels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ntl_pretrain.plot import draw_figure, main, panel_keys, read_metrics, series, smooth


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def training_records(steps: int, ntl: float) -> list[dict]:
    return [{"step": s, "loss": 3.0 / s + 0.3 * ntl, "ce": 3.0 / s, "ntl": ntl} for s in range(1, steps + 1)]


def test_series_keeps_finite_values_in_step_order_and_the_last_record_of_a_step() -> None:
    records = [
        {"step": 3, "val_ce": 1.0},
        {"step": 1, "val_ce": 2.0},
        {"step": 2, "val_ce": "nan"},  # how metrics.jsonl stores a non-finite float
        {"step": 3, "val_ce": 0.5},  # a later record for step 3 (a resumed run repeats steps) wins
        {"step": 4, "loss": 1.0},
        {"step": None, "val_ce": 9.0},
    ]
    assert series(records, "val_ce") == ([1, 3], [2.0, 0.5])


def test_smooth_is_a_debiased_moving_average() -> None:
    values = [4.0, 2.0, 6.0]
    expected, average = [], 0.0
    for index, value in enumerate(values, start=1):
        average = 0.5 * average + 0.5 * value
        expected.append(average / (1 - 0.5**index))
    assert smooth(values, 0.5) == pytest.approx(expected)
    assert smooth([7.0, 7.0, 7.0]) == pytest.approx([7.0, 7.0, 7.0])  # a constant stays put


def test_panels_follow_the_metrics_present() -> None:
    runs = [
        training_records(3, 0.0) + [{"step": 3, "val_ce": 1.0, "eval/interp/exact_match": 0.5, "eval/interp/mae": 2.0}],
        training_records(3, 1.0) + [{"step": 3, "eval/extrap/digit_accuracy": 0.1, "peak_mem_mib": 812.0}],
    ]
    keys = [key for key, _ in panel_keys(runs)]
    assert keys == ["loss", "ce", "ntl", "val_ce", "peak_mem_mib", "eval/interp/exact_match", "eval/interp/mae",
                    "eval/extrap/digit_accuracy"]  # fmt: skip


def test_plot_command_writes_a_png(tmp_path: Path) -> None:
    ce = write_run(tmp_path / "ce", training_records(30, 0.0) + [{"step": 30, "eval/a/exact_match": 0.2}])
    ntl = write_run(tmp_path / "ntl", training_records(30, 1.5) + [{"step": 30, "eval/a/exact_match": 0.3}])
    out = tmp_path / "plots" / "runs.png"
    assert main([str(ce), str(ntl), "-o", str(out), "--labels", "CE", "CE+NTL"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(read_metrics(ce)) == 31


def panel_lines(figure, title: str) -> dict[str, tuple[list, list]]:
    """label -> (x, y) of every line drawn in the panel titled `title`."""
    (axis,) = [axis for axis in figure.axes if axis.get_title() == title]
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()}


def test_smoothed_panels_say_so_and_show_the_logged_values() -> None:
    """Issue 71: the training panels are smoothed (EMA 0.9) and did not say so: a loss logged as 2.337 at step 8 read
    3.07 on the curve. Their titles now name the smoothing, and the logged values are drawn faintly beside it."""
    import matplotlib.pyplot as plt

    run = training_records(8, 1.0)
    figure = draw_figure([run], ["ntl"], ["ntl"])
    try:
        steps, logged = series(run, "loss")
        lines = panel_lines(figure, "train loss (CE + λ·NTL)\nsmoothed: EMA 0.9; faint: as logged")
        assert lines == {"ntl: logged": (steps, logged), "ntl": (steps, smooth(logged, 0.9))}
        titles = [axis.get_title() for axis in figure.axes if axis.get_visible()]
        assert titles == [f"{name}\nsmoothed: EMA 0.9; faint: as logged" for name in
                          ("train loss (CE + λ·NTL)", "train CE", "train NTL (each run's own kind)")]  # fmt: skip
    finally:
        plt.close(figure)


def test_eval_records_and_the_trainers_validation_stay_apart() -> None:
    """`ntl-pretrain eval --log-metrics` at step 20 (whole split) beside the trainer's validation at steps 10 and 20
    (first batches): two series, labelled, and the trainer's point at step 20 is kept, not replaced."""
    import matplotlib.pyplot as plt

    run = training_records(20, 1.0) + [
        {"step": 10, "split": "validation", "val_ce": 3.0, "val_ntl": 0.9},
        {"step": 20, "split": "validation", "val_ce": 2.5, "val_ntl": 0.8},
        {"step": 20, "split": "eval", "val_ce": 2.7, "val_ntl_was": 0.85, "eval/a/exact_match": 0.4},
    ]
    other = training_records(20, 1.0) + [{"step": 20, "split": "validation", "val_ce": 2.4}]
    figure = draw_figure([run, other], ["ntl", "ce"], ["ntl", "ce"])
    try:
        val_ce = panel_lines(figure, "validation CE")
        assert val_ce == {
            "ntl: trainer's periodic validation": ([10, 20], [3.0, 2.5]),
            "ntl: ntl-pretrain eval": ([20], [2.7]),
            "ce: trainer's periodic validation": ([20], [2.4]),
        }
        (axis,) = [axis for axis in figure.axes if axis.get_title() == "validation CE"]
        eval_line = next(line for line in axis.get_lines() if line.get_label() == "ntl: ntl-pretrain eval")
        assert (eval_line.get_linestyle(), eval_line.get_marker()) == ("None", "D")  # points, not a line
        legend = [text.get_text() for text in axis.get_legend().get_texts()]
        assert legend == ["trainer's periodic validation", "ntl-pretrain eval"]
        assert panel_lines(figure, "validation NTL (each run's own kind)") == {
            "ntl: trainer's periodic validation": ([10, 20], [0.9, 0.8])
        }
    finally:
        plt.close(figure)


STUDY_V6_VARIANTS = [  # the longest names a shipped study gives its variants (docs/study-v6.md)
    f"{folder}/{arm}"
    for folder in ("regression", "regression-1digit", "regression-exact", "regression-exact-1digit")
    for arm in ("ce", "ntl-was-answer")
]


def test_eight_long_variant_names_stay_inside_the_figure_and_their_tick_labels_apart() -> None:
    """Study v6's figure: its legend once ran off both edges (six entries a row) and the names under the once-measured
    panel overlapped. Every legend entry must lie inside the figure, and no two tick labels may overlap."""
    import matplotlib.pyplot as plt

    runs = [training_records(20, 1.0) + [{"step": 20, "split": "eval", "val_ntl_was": 1.0 + i}] for i in range(8)]
    figure = draw_figure(runs, STUDY_V6_VARIANTS, STUDY_V6_VARIANTS)
    try:
        renderer = figure.canvas.get_renderer()
        page = figure.bbox
        (legend,) = figure.legends
        assert [text.get_text() for text in legend.get_texts()] == STUDY_V6_VARIANTS
        drawn = legend.get_window_extent(renderer)  # the line samples and the names
        assert page.x0 <= drawn.x0 and drawn.x1 <= page.x1
        for axis in figure.axes:
            labels = [label.get_window_extent(renderer) for label in axis.get_xticklabels() if label.get_text()]
            assert not any(a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1 :]), axis.get_title()
        (scatter,) = [axis for axis in figure.axes if axis.get_title() == "validation NTL-WAS (ntl-pretrain eval)"]
        assert scatter.get_xlabel() == "variant (colours as in the legend)"
    finally:
        plt.close(figure)


def test_plot_refuses_runs_without_metrics(tmp_path: Path, capsys) -> None:
    empty = write_run(tmp_path / "empty", [{"step": 1, "note": "nothing numeric"}])
    assert main([str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert "ntl-pretrain plot: no plottable metrics" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_watcher_of_a_live_run_reads_only_whole_records(tmp_path: Path) -> None:
    """What `study --status` and the tests that poll a training run read: a torn record that a resume ended, and the
    record the run is half-way through writing, are not records yet (the CI failure of a JSON decode mid-write)."""
    from ntl_pretrain.reporting.metrics import MetricsLogger, written_records

    run = write_run(tmp_path / "run", training_records(2, 1.0))
    path = run / "metrics.jsonl"
    with path.open("a") as metrics:
        metrics.write('{"step": 3, "loss": 1.2, "c')
    resumed = MetricsLogger(str(run), enabled=True, wandb_settings=None)
    resumed.log({"step": 3, "loss": 0.9})
    resumed.close()
    with path.open("a") as metrics:
        metrics.write('{"step": 4, "loss": 0.8, "tokens_per_s": 3317.')
    assert [record["step"] for record in written_records(path)] == [1, 2, 3]
    assert written_records(tmp_path / "no-such-run" / "metrics.jsonl") == []


def test_a_torn_last_record_survives_the_next_resume_and_plot(tmp_path: Path, capsys) -> None:
    """A full disk cut the last record short; the resumed run appends after it and `plot` skips it, naming it."""
    from ntl_pretrain.reporting.metrics import MetricsLogger

    run = write_run(tmp_path / "run", training_records(3, 1.0))
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 4, "loss": 1.2, "c')
    resumed = MetricsLogger(str(run), enabled=True, wandb_settings=None)
    resumed.log({"step": 3, "split": "resume", "resumed_from": "step_3"})
    for record in training_records(5, 1.0)[3:]:
        resumed.log(record)
    resumed.close()
    assert [record["step"] for record in read_metrics(run) if "split" not in record] == [1, 2, 3, 4, 5]
    assert f"{run / 'metrics.jsonl'}: line 4: skipped a record cut short" in capsys.readouterr().err
    out = tmp_path / "run.png"
    assert main([str(run), "-o", str(out)]) == 0 and out.is_file()


def test_a_last_record_cut_at_any_position_is_skipped_not_refused(tmp_path: Path, capsys) -> None:
    """Issue 42: a kill may cut the last line anywhere (inside a string, inside a number); `plot` keeps the run."""
    run = write_run(tmp_path / "run", training_records(2, 1.0))
    whole = (run / "metrics.jsonl").read_text()
    last = json.dumps({"step": 3, "loss": 0.7512, "split": "train", "lr": 1.5e-4, "data/source/addition/weight": 1.0})
    for cut in range(1, len(last)):
        (run / "metrics.jsonl").write_text(whole + last[:cut])
        assert [record["step"] for record in read_metrics(run)] == [1, 2], last[:cut]
    assert "line 3: skipped a record cut short" in capsys.readouterr().err


def test_a_restart_before_the_first_checkpoint_supersedes_the_attempt_before_it(tmp_path: Path) -> None:
    """Issue 42: an attempt killed at step 3 before any checkpoint, then started again: no step is counted twice."""
    from ntl_pretrain.reporting.metrics import logged_steps

    run = write_run(tmp_path / "run", training_records(3, 1.0))
    assert logged_steps(run / "metrics.jsonl") and not logged_steps(tmp_path / "none" / "metrics.jsonl")
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 0, "split": "restart"}) + "\n")
        for record in training_records(2, 0.5):
            metrics.write(json.dumps(record) + "\n")
    kept = [record for record in read_metrics(run) if record.get("split") != "restart"]
    assert [record["step"] for record in kept] == [1, 2]
    assert [record["ntl"] for record in kept] == [record["ntl"] for record in training_records(2, 0.5)]
