"""The table of every causal-LM model type in the installed transformers: trained by the heads (what its forward
does to the logits, which heads, how a MoE's routers are balanced) or refused and why. docs/compatibility.md holds
its output between the two marker lines; tests/test_architectures.py checks that they agree.

    python -m ntl_pretrain.heads.coverage          # print the table
    python -m ntl_pretrain.heads.coverage --write  # replace it in docs/compatibility.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from ntl_pretrain.heads.architectures import CHECKED, OUTPUT_BIAS
from ntl_pretrain.heads.forward_rules import ForwardRule, forward_rule
from ntl_pretrain.heads.router_aux import router_class

BEGIN = "<!-- coverage table: python -m ntl_pretrain.heads.coverage --write -->"
END = "<!-- end of coverage table -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def verdict(rule: ForwardRule) -> str:
    if rule.refused is not None:
        return f"refused: {rule.refused}"
    if rule.model_type not in CHECKED:
        summary = rule.transform_summary
        return f"refused: not checked (its forward reads as {summary}, but no tiny model of it is tested)"
    heads = "dense only (output bias)" if rule.model_type in OUTPUT_BIAS else "dense, chunked"
    return f"trained: {rule.transform_summary.replace('self.', '')}; {heads}{balancing(rule)}"


def balancing(rule: ForwardRule) -> str:
    """How a mixture of experts' routers are balanced in training (router_aux.py); nothing for a dense family."""
    import transformers

    if rule.aux_loss is not None:
        coefficient = rule.aux_loss.coefficient.removeprefix("self.")
        return f"; MoE: + `{coefficient}` × the routers' load-balancing loss (`loss.router_aux_weight`)"
    if rule.router_logits or router_class(getattr(transformers, rule.class_name)) is not None:
        return "; MoE without a balancing loss in its forward (trained so, as transformers does)"
    return ""


def table() -> str:
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rules = [forward_rule(model_type) for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    trained = sum(not verdict(rule).startswith("refused") for rule in rules)
    lines = [f"transformers {__version__}: {len(rules)} causal-LM model types, {trained} trained.", "",
             "| model type | class | verdict |", "|---|---|---|"]  # fmt: skip
    lines += [f"| `{r.model_type}` | {r.class_name} | {verdict(r).replace('|', '/')} |" for r in rules]
    return "\n".join(lines)


def documented_table() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main(argv: list[str]) -> int:
    generated = table()
    if argv == ["--write"]:
        text = DOC.read_text()
        DOC.write_text(text[: text.index(BEGIN) + len(BEGIN)] + f"\n\n{generated}\n\n" + text[text.index(END) :])
    else:
        print(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
