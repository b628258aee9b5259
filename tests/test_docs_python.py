"""The Python blocks the docs promise run as pasted: README's and docs/loss.md's "NTL in your own loop" and
docs/loss.md's "NTL in your own trainer", each executed whole in a fresh namespace, its result and what it printed
checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
OWN_LOOP_SAYS = r"step loss (\S+) = ce (\S+) \+ 0\.3 \* ntl (\S+) over (\d+) label tokens, (\d+) of them numbers\n"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def section_code(doc: str, heading: str) -> str:
    """The one Python block under `heading` (up to the next heading of any level)."""
    text = (REPO / doc).read_text()
    start = text.index(f"\n{heading}\n")
    end = re.compile(r"^#", re.M).search(text, start + len(heading) + 2)
    blocks = PYTHON_BLOCK.findall(text[start : end.start() if end else len(text)])
    assert len(blocks) == 1, f"{doc}: {heading} holds {len(blocks)} Python blocks"
    return blocks[0]


def run(doc: str, heading: str) -> dict:
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(section_code(doc, heading), f"{doc}: {heading}", "exec"), namespace)  # the docs' own code
    return namespace


def test_the_readme_loss_snippet_runs_computes_ntl_and_says_what_it_computed(capsys):
    done = run("README.md", "### NTL in your own loop")
    out, model = done["out"], done["model"]
    assert out.num_number_tokens > 0 and out.ntl > 0
    assert out.loss.item() == pytest.approx((out.ce + 0.3 * out.ntl).item())
    assert model.lm_head.weight.grad.abs().sum() > 0
    said = f"loss {out.loss:.4f} = ce {out.ce:.4f} + 0.3 * ntl {out.ntl:.4f} over {out.num_number_tokens} number tokens"
    assert capsys.readouterr().out == said + "\n"  # a newcomer sees that it worked (issue 71: it printed nothing)


def test_the_own_loop_snippet_takes_a_step_normalised_over_both_micro_batches(capsys):
    done = run("docs/loss.md", "## NTL in your own loop")
    tokenizer = done["tokenizer"]
    labels = [ids[1:] for ids in tokenizer(done["texts"]).input_ids]  # every text's next tokens, no padding
    assert done["num_tokens"] == sum(map(len, labels))
    digits = [token for text_labels in labels for token in text_labels if tokenizer.decode([token]).isdigit()]
    assert done["num_numbers"] == len(digits) > 0
    assert all(param.grad is None for param in done["model"].parameters())  # stepped, then zeroed
    said = re.fullmatch(OWN_LOOP_SAYS, capsys.readouterr().out)
    assert said, "the snippet says what its step computed"
    loss, ce, ntl = map(float, said.groups()[:3])
    assert ce > 0 and ntl > 0 and loss == pytest.approx(ce + 0.3 * ntl, abs=2e-4)
    assert (int(said[4]), int(said[5])) == (done["num_tokens"], done["num_numbers"])


def test_the_trainer_snippet_logs_ce_and_ntl_and_undoes_its_patch():
    done = run("docs/loss.md", "## NTL in your own trainer")
    logs = [entry for entry in done["trainer"].state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["ntl"] > 0 and entry["loss"] == pytest.approx(entry["ce"] + 0.3 * entry["ntl"], rel=1e-6)
    assert "forward" not in vars(done["model"])
