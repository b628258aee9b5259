"""`ntl-pretrain study`'s arguments, apart from the study (`commands.py` imports the statistics and the report):
`ntl-pretrain study --help` and a mistyped flag answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path

VARIANTS = ("ce", "ntl-was", "ntl-mse")
SEEDS = (0, 1, 2)
EXIT_UNFINISHED = 3  # `--protocol` or `--decide` with a planned run unfinished (or none finished at all): no report


def register(subparsers: argparse._SubParsersAction, summary: str | None = None) -> None:
    parser = subparsers.add_parser("study", help=summary)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run, e.g. train.max_steps=50")
    parser.add_argument("--recipes", type=Path, default=Path("recipes/study"), help="folder of <variant>.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    # Taken as text: argparse's nargs="+" also swallows the overrides that follow (`--seeds 0 1 a.b=1`).
    parser.add_argument("--seeds", nargs="+", default=list(SEEDS))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/study"))
    parser.add_argument("--archive", type=Path, help="committed folder of each finished run's result files "
                        "(<run name>/); a run archived there is done, so a fresh clone resumes the study")  # fmt: skip
    parser.add_argument("--doc", type=Path, default=Path("docs/study.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/study.png"))
    parser.add_argument("--csv", type=Path, help="every metric of every run (default: <doc stem>-runs.csv)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (on CPU each gets cpu_count/jobs threads)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where the runs train: cuda puts all --jobs runs on the one visible GPU; auto = cuda "
                        "when a GPU is visible and no recipe has train.device: cpu")  # fmt: skip
    parser.add_argument("--stop-after", type=float, metavar="MINUTES", help="start no run after this long")
    parser.add_argument("--max-examples", type=int, default=1000, help="questions per evaluation set")
    parser.add_argument("--title", default="CE vs CE + NTL on two-digit addition, from scratch")
    parser.add_argument("--protocol", type=Path, help="Markdown written before the runs, quoted in the report; "
                        f"no report until every planned run is finished (exit code {EXIT_UNFINISHED})")  # fmt: skip
    parser.add_argument("--decide", nargs="?", const="v3", type=_rule, metavar="RULE",
                        help="state the verdicts of a protocol's decision rule (study_decision.RULES: v3, the "
                        "default, v3-gpu, v4 or v5) in the report, once every planned run is finished")  # fmt: skip
    parser.add_argument("--status", action="store_true", help="print how many planned runs are done, then exit")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --doc/--plot/--csv that is not this study's own report")  # fmt: skip


def _rule(name: str) -> str:
    """A decision rule's name (`--decide`), checked when given: naming them all for `--help` would import scipy."""
    from ntl_pretrain.study.decision import RULES

    if name not in RULES:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(map(repr, RULES))})")
    return name
