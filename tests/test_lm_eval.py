"""lm-evaluation-harness runs a local `generate_until` task on an export of a tiny run, as docs/evaluation.md shows
(issue 31). Skipped where `lm_eval` is not installed (it is not a dependency: `pip install lm-eval`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from helpers.launches import REPO, as_a_user_runs_it, unattended_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval (pip install lm-eval)"),
]

QA = REPO / "ntl_pretrain" / "corpus" / "arithmetic" / "interpolation.jsonl"
TASK = """task: arithmetic_local
dataset_path: json
dataset_kwargs:
  data_files: {{test: {qa}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: " {{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 16, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""


def test_lm_eval_runs_a_local_task_on_an_export(tmp_path_factory, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run_dir = unattended_run(tmp_path_factory)[0]
    export = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "ntl_pretrain.cli", "export", str(run_dir / "checkpoints" / "step_4"),
                    str(export)], cwd=REPO, env=as_a_user_runs_it(), check=True, capture_output=True)  # fmt: skip
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arithmetic_local.yaml").write_text(TASK.format(qa=QA))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    results = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=["arithmetic_local"],
                              task_manager=TaskManager(include_path=str(tmp_path / "tasks")), limit=4, device="cpu",
                              log_samples=True)  # fmt: skip
    samples = results["samples"]["arithmetic_local"]
    assert [sample["doc"]["answer"] for sample in samples] == [
        line.split('"answer": "')[1].split('"')[0] for line in QA.read_text().splitlines()[:4]
    ]
    matches = [sample["filtered_resps"][0] == sample["target"] for sample in samples]  # " 289": the space too
    assert results["results"]["arithmetic_local"]["exact_match,none"] == sum(matches) / 4
