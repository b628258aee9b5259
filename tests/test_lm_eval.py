"""lm-evaluation-harness runs docs/evaluation.md's local task, with the docs' own YAML and command line, on an
export of a tiny run (issues 31 and 42: the docs' YAML had drifted from the one tested). The dev extra installs
lm-eval; skipped where it is not installed (the package itself does not need it)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest
from helpers.launches import REPO, as_a_user_runs_it, unattended_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval (pip install lm-eval)"),
]

DOC = REPO / "docs" / "evaluation.md"
QA = REPO / "ntl_pretrain" / "corpus" / "arithmetic" / "interpolation.jsonl"
DOC_EXPORT = "runs/tiny-cpu/export"  # the export folder the docs' commands name


def documented_blocks() -> tuple[str, str]:
    """The section's YAML task file and its `lm_eval` command, as a user would paste them."""
    section = DOC.read_text().split("## lm-evaluation-harness on an export", 1)[1].split("\n## ", 1)[0]
    yaml_block = re.search(r"```yaml\n(.*?)```", section, re.S)[1]
    bash_block = re.search(r"```bash\n(.*?)```", section, re.S)[1].replace("\\\n", " ")
    command = next(line for line in bash_block.splitlines() if "lm_eval " in line)
    return yaml_block, command


def test_the_documented_task_and_command_run_on_an_export(tmp_path_factory, tmp_path):
    yaml_block, command = documented_blocks()
    run_dir = unattended_run(tmp_path_factory)[0]
    export = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "export", str(run_dir / "checkpoints" / "step_4"),
                    str(export)], cwd=REPO, env=as_a_user_runs_it(), check=True, capture_output=True)  # fmt: skip
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arithmetic_local.yaml").write_text(yaml_block.replace("/abs/path/to/ntl_pretrain", str(
        REPO / "ntl_pretrain")))  # fmt: skip
    words = shlex.split(command.replace(DOC_EXPORT, str(export)).replace("--limit 32", "--limit 4"))
    assert words[0] == "HF_DATASETS_OFFLINE=1" and words[1] == "lm_eval"
    argv = [sys.executable, "-m", "lm_eval", *words[2:], "--output_path", str(tmp_path / "results"), "--log_samples"]
    done = subprocess.run(argv, cwd=tmp_path, env={**as_a_user_runs_it(), "HF_DATASETS_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next((tmp_path / "results").rglob("samples_*.jsonl")).open()]
    references = [json.loads(line)["answer"] for line in QA.read_text().splitlines()[:4]]
    assert [sample["doc"]["answer"] for sample in samples] == references
    # The harness's exact match is a string match of the generated text against " <answer>" (the space too),
    # recomputed here from the samples it logged.
    assert [sample["target"] for sample in samples] == [f" {answer}" for answer in references]
    matches = [sample["filtered_resps"][0] == sample["target"] for sample in samples]
    assert results["results"]["arithmetic_local"]["exact_match,none"] == pytest.approx(sum(matches) / 4)
