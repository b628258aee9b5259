"""The regression pilot's recipes (recipes/study/regression/, issue 38): the arms differ only in the NTL term and where
it acts, and the task differs from the 3-digit addition study only in its data and question sets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.data.encoding import DocumentEncoder
from ntl_pretrain.evaluation.answers import read_qa_file
from ntl_pretrain.tokenizer import load_tokenizer, resolve_path

STUDY = Path(__file__).resolve().parent.parent / "recipes" / "study"
CORPUS = "pkg:ntl_pretrain/corpus/"
ARMS = {"ce": (None, "all"), "ntl-was-answer": ("was", "answer"), "ntl-digits-answer": ("digits", "answer")}


def written_output_dir(recipe_file: Path) -> str:
    """`train.output_dir` as the recipe file writes it: relative to its folder (docs/recipes.md, "Paths"). The study
    passes each run's folder on the command line; this one names the arm's runs outside a study."""
    return Path(load_recipe(recipe_file).train.output_dir).relative_to(recipe_file.parent.resolve()).as_posix()


def without(recipe, *paths: str) -> dict:
    fields = dataclasses.asdict(recipe)
    for path in paths:
        *parents, key = path.split(".")
        holder = fields
        for parent in parents:
            holder = holder[parent]
        del holder[key]
    return fields


def test_regression_arms_differ_only_in_the_ntl_term_and_its_labels() -> None:
    recipes = {arm: load_recipe(STUDY / "regression" / f"{arm}.yaml") for arm in ARMS}
    for arm, (kind, labels) in ARMS.items():
        recipe = recipes[arm]
        assert (recipe.loss.ntl.kind, recipe.loss.ntl.weight) == (kind, 0.3), arm
        assert [(s.ce_labels, s.ntl_labels) for s in recipe.data.sources] == [("all", labels)], arm
        assert written_output_dir(STUDY / "regression" / f"{arm}.yaml") == f"runs/study/regression/{arm}"
    shared = [without(recipe, "loss", "train.output_dir") for recipe in recipes.values()]
    for fields in shared:
        fields["data"]["sources"][0].pop("ntl_labels")
    assert shared[0] == shared[1] == shared[2]


def test_regression_task_differs_from_the_three_digit_study_only_in_its_data() -> None:
    regression, addition = load_recipe(STUDY / "regression" / "ce.yaml"), load_recipe(STUDY / "3digit" / "ce.yaml")
    assert regression.tokenizer.path == addition.tokenizer.path == "pkg:ntl_pretrain/corpus/tiny-tokenizer-3digit"
    differing = ("data.sources", "data.validation", "eval.qa_sets", "eval.max_new_tokens", "train.output_dir")
    assert without(regression, *differing) == without(addition, *differing)
    corpus = "pkg:ntl_pretrain/corpus/regression/"
    assert [s.path for s in regression.data.sources] == [corpus + "train.jsonl"]
    assert [s.path for s in regression.data.validation] == [corpus + "validation.jsonl"]
    assert [s.path for s in regression.eval.qa_sets] == [corpus + "interpolation.jsonl"]
    records = read_qa_file(resolve_path(regression.eval.qa_sets[0].path))
    assert len(records) == 1000 and max(len(answer) for _, answer in records) == 3  # one token, then EOS
    assert regression.eval.max_new_tokens >= 2


def test_study_v5_single_digit_arms_differ_from_the_pilots_only_in_the_tokenizer() -> None:
    """docs/study-v5-protocol.md: regression-1digit/<arm> is regression/<arm> under the single-digit tokenizer, and
    every held-out answer, spelled digit by digit, fits the evaluation's new tokens with its EOS."""
    for arm in ("ce", "ntl-was-answer"):
        single = load_recipe(STUDY / "regression-1digit" / f"{arm}.yaml")
        chunked = load_recipe(STUDY / "regression" / f"{arm}.yaml")
        assert single.tokenizer.path == "pkg:ntl_pretrain/corpus/tiny-tokenizer"
        assert written_output_dir(STUDY / "regression-1digit" / f"{arm}.yaml") == f"runs/study/regression-1digit/{arm}"
        assert without(single, "tokenizer.path", "train.output_dir") == without(chunked, "tokenizer.path",
                                                                                 "train.output_dir")  # fmt: skip
    tokenizer = load_tokenizer(single.tokenizer.path)
    records = read_qa_file(resolve_path(single.eval.qa_sets[0].path))
    longest = max(len(tokenizer(answer, add_special_tokens=False)["input_ids"]) for _, answer in records)
    assert longest == 3 and longest + 1 <= single.eval.max_new_tokens


def test_study_v5_lambda_pilot_changes_only_the_weight() -> None:
    base = load_recipe(STUDY / "regression" / "ntl-was-answer.yaml")
    for weight in (1, 3):
        recipe = load_recipe(STUDY / "regression" / f"ntl-was-answer-lambda{weight}.yaml")
        assert (recipe.loss.ntl.kind, recipe.loss.ntl.weight) == ("was", float(weight))
        written = written_output_dir(STUDY / "regression" / f"ntl-was-answer-lambda{weight}.yaml")
        assert written == f"runs/study/regression/ntl-was-answer-lambda{weight}"
        assert without(recipe, "loss.ntl.weight", "train.output_dir") == without(base, "loss.ntl.weight",
                                                                                  "train.output_dir")  # fmt: skip


def test_study_v6_noise_free_arms_differ_from_the_noisy_ones_only_in_the_training_and_validation_answers() -> None:
    """Study v6 (issue 58): regression-exact[-1digit]/<arm> is regression[-1digit]/<arm> with the noise-free set's
    training and validation files; the held-out questions (and so the metric keys) are the noisy task's."""
    for tokenizer_axis in ("", "-1digit"):
        for arm in ("ce", "ntl-was-answer"):
            exact = load_recipe(STUDY / f"regression-exact{tokenizer_axis}" / f"{arm}.yaml")
            noisy = load_recipe(STUDY / f"regression{tokenizer_axis}" / f"{arm}.yaml")
            written = written_output_dir(STUDY / f"regression-exact{tokenizer_axis}" / f"{arm}.yaml")
            assert written == f"runs/study/regression-exact{tokenizer_axis}/{arm}"
            assert [s.path for s in exact.data.sources] == [s.path.replace("/regression/", "/regression-exact/")
                                                            for s in noisy.data.sources]  # fmt: skip
            assert [s.path for s in exact.data.validation] == [f"{CORPUS}regression-exact/validation.jsonl"]
            assert [s.path for s in exact.eval.qa_sets] == [f"{CORPUS}regression/interpolation.jsonl"]
            differing = ("data.sources", "data.validation", "train.output_dir")
            assert without(exact, *differing) == without(noisy, *differing)
            sources = [dataclasses.asdict(recipe.data.sources[0]) for recipe in (exact, noisy)]
            assert sources[0] | {"path": sources[1]["path"]} == sources[1]  # only the file differs


V6 = STUDY / "v6"
V6_FOLDERS = ("regression", "regression-1digit", "regression-exact", "regression-exact-1digit")
STEPS_PER_EXAMPLE = 1.616  # docs/study-v6-pilot-plan.md, "Lengths"
SCHEDULE = ("train.max_steps", "train.eval_every_steps", "eval.every_steps", "train.output_dir")


def test_study_v6_arms_are_the_pilots_at_one_length_of_equal_examples() -> None:
    """docs/study-v6-protocol.md: recipes/study/v6/<folder>/<arm> is recipes/study/<folder>/<arm> with only its length
    and evaluation interval changed; every arm is evaluated at each twentieth of its length, and a single-digit arm
    trains for the steps that show it the examples a 1–3-digit arm sees (docs/study-v6-pilot-plan.md, 1.616×)."""
    lengths = {}
    for folder in V6_FOLDERS:
        for arm in ("ce", "ntl-was-answer"):
            main, pilot = (load_recipe(root / folder / f"{arm}.yaml") for root in (V6, STUDY))
            assert without(main, *SCHEDULE) == without(pilot, *SCHEDULE), (folder, arm)
            assert written_output_dir(V6 / folder / f"{arm}.yaml") == f"runs/study-v6/{folder}/{arm}"
            every = round(main.train.max_steps / 20)
            assert main.train.eval_every_steps == main.eval.every_steps == every, (folder, arm)
            lengths.setdefault(folder.endswith("1digit"), set()).add(main.train.max_steps)
    (chunked,), (single,) = lengths[False], lengths[True]
    assert single == round(STEPS_PER_EXAMPLE * chunked)


def test_a_single_digit_example_is_1_616_times_the_tokens_of_a_1_3_digit_one() -> None:
    """The ratio the v6 lengths rest on, from the data pipeline's own documents (text and EOS) of the training set
    under each tokenizer: a step holds the same tokens, so this is the ratio of steps per example."""
    means = []
    for folder in ("regression", "regression-1digit"):
        recipe = load_recipe(STUDY / folder / "ce.yaml")
        records = [json.loads(line) for line in resolve_path(recipe.data.sources[0].path).read_text().splitlines()]
        documents = DocumentEncoder(load_tokenizer(recipe.tokenizer.path))(
            [r["question"] + r["answer"] for r in records]
        )
        means.append(sum(len(document) for document in documents) / len(documents))
    assert means[0] == 9.0  # every operand and answer one token: "f", "(", a, ",", b, ")", "=", answer, EOS
    assert abs(means[1] / means[0] - STEPS_PER_EXAMPLE) < 0.0005


V7 = STUDY / "v7"


def test_study_v7_arms_are_v6s_with_only_the_training_set_swapped() -> None:
    """docs/study-v7-pilot-plan.md: recipes/study/v7/<folder>/<arm> is recipes/study/v6/<folder>/<arm> with only the
    training file changed, to the all-questions set of the same noise (regression-all/, regression-all-exact/), so
    the arms differ from each other as v6's did; the number-level arms are the NTL-WAS arms with only the kind
    changed."""
    for folder in V6_FOLDERS:
        for arm in ("ce", "ntl-was-answer"):
            v7, v6 = (load_recipe(root / folder / f"{arm}.yaml") for root in (V7, V6))
            assert without(v7, "data.sources", "train.output_dir") == without(v6, "data.sources", "train.output_dir")
            assert written_output_dir(V7 / folder / f"{arm}.yaml") == f"runs/study-v7/{folder}/{arm}"
            (old,), (new,) = v6.data.sources, v7.data.sources
            noise = "regression-exact" if "exact" in folder else "regression"
            assert old.path == f"{CORPUS}{noise}/train.jsonl"
            assert new.path == f"{CORPUS}{noise.replace('regression', 'regression-all')}/train.jsonl.gz"
            assert dataclasses.asdict(new) == dataclasses.asdict(old) | {"path": new.path}
    for folder in ("regression", "regression-exact"):
        number, was = (load_recipe(V7 / folder / f"{arm}.yaml") for arm in ("ntl-number-answer", "ntl-was-answer"))
        assert (was.loss.ntl.kind, number.loss.ntl.kind) == ("was", "number")
        assert number.loss.ntl.weight == was.loss.ntl.weight == 0.3
        assert without(number, "loss.ntl.kind", "train.output_dir") == without(was, "loss.ntl.kind", "train.output_dir")


def test_study_v7_gpu_arms_are_v7s_with_a_ten_times_larger_model() -> None:
    """recipes/study/v7-gpu/<folder>/<arm> (bench/gpu_first_run.py, stage study_v7_gpu) is v7's recipe with only the
    model's width and depth changed: 10.4x the parameters (16.6M against 1.6M under 1–3-digit tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {}
    for folder in ("regression", "regression-exact"):
        for arm in ("ce", "ntl-was-answer"):
            gpu, cpu = (load_recipe(root / folder / f"{arm}.yaml") for root in (STUDY / "v7-gpu", V7))
            assert without(gpu, "model.config", "train.output_dir") == without(cpu, "model.config", "train.output_dir")
            assert written_output_dir(STUDY / "v7-gpu" / folder / f"{arm}.yaml") == f"runs/study-v7-gpu/{folder}/{arm}"
            for recipe in (gpu, cpu):
                config = LlamaConfig(vocab_size=3148, **recipe.model.config)  # tiny-tokenizer-3digit's 3,148 tokens
                with torch.device("meta"):
                    sizes[recipe is gpu] = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert 10 <= sizes[True] / sizes[False] < 11
