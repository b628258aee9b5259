"""The DeepSpeed JSON for a run: ZeRO settings from the recipe's JSON file, batch/precision/clipping from the recipe.

The recipe is the single source of truth for batch sizes, precision and clipping, so the JSON must leave those
keys out (or set them to "auto", the transformers convention); the optimizer and scheduler are built here too.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from ntl_pretrain.config.deepcompile import set_deepcompile
from ntl_pretrain.config.loading import load_recipe_with_origins
from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.tokenizer import resolve_path

RECIPE_OWNED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
)

# DeepSpeed's documented top-level keys (deepspeed.ai/docs/config-json, DeepSpeed 0.19) and the JSON type each takes
# (None: not checked here). DeepSpeed ignores a key it does not know, so a misspelt section would silently fall back
# to its defaults: a key close to one of these is refused with "did you mean"; a key close to none passes (a comment
# key, a section of a newer DeepSpeed). A section of the wrong type fails deep inside DeepSpeed without its name.
SECTION, FLAG, COUNT, NAME = dict, bool, int, str
DEEPSPEED_TOP_LEVEL_KEYS: dict[str, type | None] = {
    **dict.fromkeys(RECIPE_OWNED_KEYS),
    **dict.fromkeys(("zero_optimization", "data_types", "amp", "torch_autocast", "activation_checkpointing",
                     "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "aio",
                     "autotuning", "elasticity", "checkpoint", "data_efficiency", "curriculum_learning",
                     "compression_training", "sparse_attention", "pipeline", "hybrid_engine", "nebula", "eigenvalue",
                     "progressive_layer_drop", "quantize_training", "weight_quantization", "compile", "timers",
                     "tensor_parallel"), SECTION),
    **dict.fromkeys(("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "wall_clock_breakdown",
                     "dump_state", "memory_breakdown", "prescale_gradients", "sparse_gradients",
                     "dataloader_drop_last", "disable_allgather", "graph_harvesting"), FLAG),
    **dict.fromkeys(("steps_per_print", "vocabulary_size"), COUNT),
    **dict.fromkeys(("communication_data_type", "seq_parallel_communication_data_type"), NAME),
    **dict.fromkeys(("gradient_predivide_factor", "gradient_allreduce_op", "expert_parallel",
                     "use_node_local_storage", "load_universal_checkpoint")),
}  # fmt: skip
JSON_TYPE_NAMES = {SECTION: "an object", FLAG: "true or false", COUNT: "a whole number", NAME: "a string"}
ZERO_STAGES = (1, 2, 3)
AUTO_SIZES = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def grad_accum_steps(recipe: Recipe, world_size: int) -> int:
    """Micro-batches per rank per optimizer step, derived from the global batch."""
    train = recipe.train
    global_sequences = train.global_batch_size
    if train.global_batch_tokens is not None:
        global_sequences = train.global_batch_tokens // recipe.data.seq_len
    if global_sequences is None:
        return 1
    per_pass = train.micro_batch_size * world_size
    if global_sequences % per_pass:
        raise RecipeError(
            f"train.global_batch_size: {global_sequences} sequences per step is not a multiple of "
            f"train.micro_batch_size ({train.micro_batch_size}) x world size ({world_size} ranks: --nproc per node "
            f"x nodes)"
        )
    return global_sequences // per_pass


def check_vocab_parallel_size(recipe: Recipe, world_size: int) -> None:
    """Vocabulary groups are k consecutive data-parallel ranks, so k must divide the world size."""
    k = recipe.loss.vocab_parallel_size
    if world_size % k:
        raise RecipeError(
            f"loss.vocab_parallel_size: {k} does not divide the world size ({world_size} ranks); vocabulary groups "
            f"are {k} consecutive ranks"
        )


def check_zero_section(section: object, path: Path) -> None:
    """`zero_optimization` against DeepSpeed's own schema (unknown keys, types, offload devices) and the stages the
    trainer runs: refused before launch, not in every rank's `deepspeed.initialize`."""
    if not isinstance(section, dict):
        raise RecipeError(f"{path}: zero_optimization: expected an object with a stage, got {section!r}")
    stage = section.get("stage")
    if type(stage) is not int or stage not in ZERO_STAGES:  # `true` equals 1 and `2.0` equals 2: both refused
        raise RecipeError(f"{path}: zero_optimization.stage: the trainer runs ZeRO stage 1, 2 or 3 (or set "
                          f"deepspeed.zero_stage in the recipe), got {stage!r}")  # fmt: skip
    if stage != 3 and (section.get("offload_param") or {}).get("device", "none") != "none":
        raise RecipeError(f"{path}: zero_optimization.offload_param: only ZeRO-3 partitions (and so offloads) "
                          f"the weights; this run is at stage {stage}: remove offload_param or train at "
                          "stage 3")  # fmt: skip
    import pydantic

    try:
        _zero_schema()(**section)
    except pydantic.ValidationError as error:
        raise _schema_refusal(error, path, "zero_optimization.") from error


def _schema_refusal(error, path: Path, section: str = "") -> RecipeError:
    """A DeepSpeed pydantic schema's first complaint as one line naming the key."""
    problem = error.errors()[0]
    key = section + ".".join(str(part) for part in problem["loc"])
    return RecipeError(f"{path}: {key}: {problem['msg']}, got {problem['input']!r}")


def _zero_schema():
    """DeepSpeed's pydantic model of the section."""
    with deepspeed_on_this_machine():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig


@contextlib.contextmanager
def deepspeed_on_this_machine():
    """Importing DeepSpeed picks an accelerator; where DeepSpeed would pick the CPU (no GPU, DS_ACCELERATOR unset)
    it is named, so that DeepSpeed does not print a warning that it guessed."""
    import torch

    name_cpu = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    if name_cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        if name_cpu:
            del os.environ["DS_ACCELERATOR"]


def check_top_level_key(key: str, value: object, path: Path) -> None:
    """A misspelt key ("did you mean"), or a known key whose value has the wrong JSON type, named."""
    if key not in DEEPSPEED_TOP_LEVEL_KEYS:
        close = difflib.get_close_matches(key, DEEPSPEED_TOP_LEVEL_KEYS, n=1, cutoff=0.8)
        if close:
            raise RecipeError(f"{path}: {key}: not a DeepSpeed key (DeepSpeed ignores it); did you mean {close[0]}?")
        return
    expected = DEEPSPEED_TOP_LEVEL_KEYS[key]
    if expected is None or (expected is NAME and value is None):
        return
    if not isinstance(value, expected) or (expected is COUNT and isinstance(value, bool)):
        raise RecipeError(f"{path}: {key}: expected {JSON_TYPE_NAMES[expected]}, got {value!r}")


def check_with_deepspeed(config: dict, path: Path) -> None:
    """The whole JSON parsed by DeepSpeed's own `DeepSpeedConfig`, as every rank's `deepspeed.initialize` will:
    what it rejects there (a section that is not an object, a bad dtype, an unknown key in a section with a schema)
    is one line here, before any process starts."""
    with deepspeed_on_this_machine():
        import pydantic
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    for key, value in config.items():
        check_top_level_key(key, value, path)
    # Without train_batch_size DeepSpeed derives it from the other two and whatever world size it sees here (1 in
    # the launcher, the real one inside a rank), so its batch check cannot fail on a size the recipe guarantees.
    parsed = {key: value for key, value in config.items() if key != "train_batch_size"}
    try:
        DeepSpeedConfig(parsed)
    except pydantic.ValidationError as error:
        raise _schema_refusal(error, path) from error
    except (DeepSpeedConfigError, TypeError, ValueError, KeyError, AssertionError) as error:
        raise RecipeError(f"{path}: DeepSpeed refuses the config: {error}") from error


def build_deepspeed_config(recipe: Recipe, world_size: int) -> dict:
    try:
        path = resolve_path(recipe.deepspeed.config)
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, ImportError) as error:  # bad JSON, not UTF-8, a pkg: path to a missing package
        raise RecipeError(f"deepspeed.config: cannot read {recipe.deepspeed.config}: {error}") from error
    if not isinstance(config, dict):
        raise RecipeError(f"{path}: the DeepSpeed JSON must be an object (mapping), got {type(config).__name__}")
    for key in RECIPE_OWNED_KEYS:
        if config.get(key, "auto") != "auto":
            raise RecipeError(f'{path}: {key}: set by the recipe; remove it from the DeepSpeed JSON or use "auto"')
    choose_zero_stage(config, recipe)
    leave_auto_sizes_to_the_trainer(config.get("zero_optimization"))
    check_zero_section(config.get("zero_optimization", {}), path)
    check_vocab_parallel_size(recipe, world_size)
    check_vocab_parallel_stage(recipe, config["zero_optimization"]["stage"])
    set_deepcompile(config, recipe, path)
    gas = grad_accum_steps(recipe, world_size)
    config.update(
        train_micro_batch_size_per_gpu=recipe.train.micro_batch_size,
        gradient_accumulation_steps=gas,
        train_batch_size=recipe.train.micro_batch_size * gas * world_size,
        gradient_clipping=recipe.optimizer.grad_clip,
        bf16={"enabled": recipe.train.precision == "bf16"},
    )
    if recipe.train.precision == "bf16":
        choose_reduce_dtype(config, recipe.train.reduce_dtype, path)
        set_bf16_gradient_dtypes(config)
    config.pop("fp16", None)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config.setdefault("steps_per_print", 2**31 - 1)
    # DeepSpeed's throughput timer synchronizes the device when each micro-batch's forward starts and its step ends,
    # for a samples/s line printed every steps_per_print steps (never, above); the trainer times its own steps.
    config.setdefault("timers", {"throughput": {"enabled": False}})
    check_with_deepspeed(config, path)
    return config


def choose_zero_stage(config: dict, recipe: Recipe) -> None:
    """`deepspeed.zero_stage` in place of the JSON's stage, when the recipe sets one."""
    stage = recipe.deepspeed.zero_stage
    if stage is not None and isinstance(config.setdefault("zero_optimization", {}), dict):
        config["zero_optimization"]["stage"] = stage


def leave_auto_sizes_to_the_trainer(zero: object) -> None:
    """A ZeRO-3 size set to "auto" (transformers' convention) is dropped, as if the JSON did not set it:
    `stage3_prefetch_bucket_size` is then sized from the model (a whole decoder layer, `train/engine.py`),
    `stage3_param_persistence_threshold` is DeepSpeed's 1e5, which at every size from 135M to 70B keeps the norms and
    biases whole and partitions every matrix (docs/recipes.md, "ZeRO stage, gathering and compiled layers")."""
    if isinstance(zero, dict):
        for key in AUTO_SIZES:
            if zero.get(key) == "auto":
                del zero[key]


def check_vocab_parallel_stage(recipe: Recipe, stage: int) -> None:
    """The output-layer slices join the gradient norm of DeepSpeed's ZeRO-3 optimizer (`heads/vocab_parallel.py`)."""
    if recipe.loss.vocab_parallel_size > 1 and stage != 3:
        raise RecipeError(f"loss.vocab_parallel_size: {recipe.loss.vocab_parallel_size} keeps the output layer's "
                          f"slices outside the engine, which only ZeRO-3's optimizer lets into its gradient norm; "
                          f"this run is at ZeRO stage {stage}: set deepspeed.zero_stage: 3 or vocab_parallel_size: "
                          "1")  # fmt: skip


def choose_reduce_dtype(config: dict, reduce_dtype: str | None, path: Path) -> None:
    """`train.reduce_dtype` into the DeepSpeed config, where the JSON did not choose otherwise."""
    if reduce_dtype is None:
        return
    chosen = config.get("communication_data_type")
    if chosen is not None and chosen != reduce_dtype:
        raise RecipeError(f"train.reduce_dtype: {reduce_dtype}, but {path} sets communication_data_type: {chosen}; "
                          f"choose in one place")  # fmt: skip
    config["communication_data_type"] = reduce_dtype


def set_bf16_gradient_dtypes(config: dict) -> None:
    """fp32 for adding micro-batch gradients and for reducing them over ranks, unless the DeepSpeed JSON chose.

    DeepSpeed defaults both to the model dtype. In bf16 (8 significant bits) each add of a micro-batch's gradient
    into the accumulated one, and each add of a rank's share in the reduce-scatter, rounds away what is smaller than
    1/256 of the sum: 16 micro-batches or 64 ranks lose most of a small gradient's bits. fp32 accumulation costs
    4 bytes per parameter on each rank's gradient partition; fp32 reduction doubles the bytes of ZeRO-3's
    gradient reduce-scatter (a third more traffic than bf16 with the parameter all-gathers counted), which
    the doctor's `reduce-scatter fp32 / bf16` row measures on a node (docs/recipes.md, "DeepSpeed configs")."""
    data_types = config.setdefault("data_types", {})
    data_types.setdefault("grad_accum_dtype", "fp32")
    config.setdefault("communication_data_type", "fp32")


def load_run(recipe_path: str | Path, overrides: Iterable[str], world_size: int) -> tuple[Recipe, dict]:
    """Everything that can fail before a process group exists: the recipe and its DeepSpeed config. A refusal of
    the config names where the key it is about came from: the recipe file, its `base:` file or the command line."""
    recipe, origins = load_recipe_with_origins(recipe_path, overrides)
    try:
        config = build_deepspeed_config(recipe, world_size)
    except RecipeError as error:
        raise origins.blamed(error) from error
    # The recipe a run records names the stage it trains at, so that a resume at another stage can be refused.
    recipe.deepspeed.zero_stage = config["zero_optimization"]["stage"]
    return recipe, config
