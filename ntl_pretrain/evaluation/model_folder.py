"""Find the HF model folder to evaluate: an HF folder as is, or a run's checkpoint exported to one."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.loading import read_yaml_file
from ntl_pretrain.config.recipe import TrainConfig
from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.data.source_config import SourceConfig
from ntl_pretrain.errors import InputError
from ntl_pretrain.evaluation.config import EvalConfig, QaSetConfig
from ntl_pretrain.preflight.model import position_limits, safetensors_shapes

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# What transformers builds a tokenizer from (fast, sentencepiece, BPE and WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class Target:
    hf_folder: Path | None
    """The folder to load with `from_pretrained`; None until a checkpoint is exported."""
    checkpoint: Path | None
    """The checkpoint step folder (`<run>/checkpoints/step_<N>`), when the target was a run or checkpoint."""

    @property
    def step(self) -> int | None:
        """The step the checkpoint holds (`checkpoint.step_held`: its manifest's, whatever the folder is named);
        None for an HF folder, or a copy of an older checkpoint in a folder of another name."""
        return None if self.checkpoint is None else checkpoint.step_held(self.checkpoint)

    @property
    def run_dir(self) -> Path | None:
        """The run the checkpoint is part of (`<run>/checkpoints/step_<N>`); None for an HF folder or a copy."""
        run = None if self.step is None else self.checkpoint.parent.parent
        return run if run is not None and checkpoint.checkpoints_root(run) == self.checkpoint.parent else None


def resolve_target(path: str | Path) -> Target:
    """An HF folder (has config.json), a checkpoint step folder, a checkpoints/ folder or a run directory
    (its latest checkpoint)."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        if not has_weights(folder):
            raise FileNotFoundError(f"{folder}: an HF folder without weights (none of {', '.join(WEIGHT_FILES)})")
        return Target(folder, None)
    if checkpoint.holds_checkpoint(folder):
        return Target(None, folder)
    step = checkpoint.latest(folder) or checkpoint.latest(checkpoint.checkpoints_root(folder))
    if step is None:
        raise FileNotFoundError(f"{folder}: neither an HF model folder (config.json) nor a run with checkpoints")
    return Target(None, step)


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def check_hf_folder(folder: Path) -> dict:
    """What loading the folder would fail on, refused naming the file before any model is loaded (an evaluation
    must not fail minutes in): config.json is a JSON object, the safetensors headers read, a tokenizer is there.
    Returns the config."""
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise InputError(f"{config_file}: not a JSON model config ({error})") from error
    if not isinstance(config, dict):
        raise InputError(f"{config_file}: not a JSON model config (a {type(config).__name__}, not an object)")
    safetensors_shapes(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"{folder}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's "
                         f"tokenizer into the folder (`tokenizer.save_pretrained`)")  # fmt: skip
    return config


def model_config(target: Target) -> dict | None:
    """The model's config.json as a dict (an HF folder's, checked; a checkpoint's saved one); None without one."""
    if target.hf_folder is not None:
        return check_hf_folder(target.hf_folder)
    saved = target.checkpoint / checkpoint.HF_CONFIG / "config.json"
    return json.loads(saved.read_text()) if saved.is_file() else None


def check_seq_len(config: dict | None, seq_len: int | None, max_new_tokens: int = 1) -> None:
    """`--seq-len` fits the model's positions, as `data.seq_len` must for training
    (preflight.world.check_positions), and `--max-new-tokens` leaves room for a prompt."""
    if config is None:
        return
    for key, limit in position_limits(config).items():
        if seq_len is not None and seq_len > limit:
            raise InputError(f"--seq-len: {seq_len} tokens exceed the model's {key} ({limit})")
        if max_new_tokens >= limit:
            raise InputError(f"--max-new-tokens: {max_new_tokens} new tokens leave no room for a prompt in the "
                             f"model's {key} ({limit})")  # fmt: skip


def export_for_eval(target: Target, out_dir: Path, stage: Callable[[str], None] = lambda _: None) -> Target:
    """Write the checkpoint's fp32 master weights as an HF folder (evaluation never rounds to bf16); the eval
    command verified the checkpoint already. `stage` is told each step of the export."""
    from ntl_pretrain.export.hf_folder import export_checkpoint

    folder = export_checkpoint(target.checkpoint, out_dir, dtype="float32", verify=False, stage=stage)
    return Target(folder, target.checkpoint)


def saved_recipe(target: Target) -> dict:
    """The resolved recipe saved with the checkpoint, as plain data; {} for a bare HF folder."""
    if target.checkpoint is None:
        return {}
    return read_yaml_file(target.checkpoint / "recipe.yaml")


def recipe_eval(target: Target) -> EvalConfig | None:
    """The run's `eval:` section (its question/answer sets and prompt), when the recipe saved one."""
    section = saved_recipe(target).get("eval")
    if not section:
        return None
    qa_sets = [QaSetConfig(**qa) for qa in section.get("qa_sets") or []]
    validation = [SourceConfig(**source) for source in section.get("validation") or []]
    return EvalConfig(**{**section, "qa_sets": qa_sets, "validation": validation})


def validation_layout(target: Target, eval_micro_batch: int) -> tuple[int, int]:
    """(micro-batch size, ranks) that `--max-validation-batches` counts in, so that it means what
    `train.eval_max_batches` meant in the run: the run's `train.micro_batch_size` and its ranks (one `rank_state/`
    file each; 1 for a checkpoint saved before them); for an HF folder, eval's own micro-batch on one rank."""
    if target.checkpoint is None:
        return eval_micro_batch, 1
    micro_batch_size = int(saved_recipe(target).get("train", {}).get("micro_batch_size", TrainConfig.micro_batch_size))
    ranks = len(list((target.checkpoint / checkpoint.RANK_STATE).glob("rank_*.pt")))
    return micro_batch_size, max(ranks, 1)


def recipe_validation(target: Target) -> DataConfig | None:
    """How the run validated, read from the recipe saved with the checkpoint: its held-out sources, packed length
    and `per_document_attention` (the training sources are left out)."""
    data = saved_recipe(target).get("data", {})
    sources = [SourceConfig(**source) for source in data.get("validation") or []]
    if not sources:
        return None
    defaults = DataConfig()
    return DataConfig(
        validation=sources,
        seq_len=int(data.get("seq_len", defaults.seq_len)),
        per_document_attention=bool(data.get("per_document_attention", defaults.per_document_attention)),
    )
