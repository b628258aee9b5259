"""The recipe: one typed schema for a training run, loaded from YAML.

A recipe file may extend another with `base: <path>` (relative to the file); mappings merge key by
key, everything else replaces. Dot-list overrides (`loss.ntl.weight=0.5`, values parsed as YAML)
apply last. Unknown keys, wrong types and contradictions raise `RecipeError` naming the key and the
file (or command-line override) that set it, before any process group starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pydantic
import yaml

from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.errors import InputError
from ntl_pretrain.evaluation.config import EvalConfig

HfScalarOrList = int | float | str | bool | list[int] | list[float] | list[str] | None
# A mapping one level deep holds transformers 5's `rope_parameters` ({rope_type: yarn, factor: 4.0, ...}).
HfConfigValue = HfScalarOrList | dict[str, HfScalarOrList]
OVERRIDE_ORIGIN = "command-line override"
# Every count in a recipe (steps, sizes, seeds) is exact in float64 (JSON readers of metrics.jsonl) and fits int64
# (torch's step counters): a larger one is a typo, and refused before it overflows mid-run.
MAX_RECIPE_INT = 2**53
MAX_YAML_BYTES = 1 << 20  # recipes are a few KB; the bound keeps a mistaken or hostile file from exhausting memory


class RecipeError(InputError):
    """A recipe that cannot run; the message names the file and the key."""

    kind = "recipe error"


@dataclass
class ModelConfig:
    model_type: str | None = None
    """HF `model_type` to build from scratch (e.g. `llama`, `gpt2`, `qwen2`); null with `init_from`, and may be
    null when resuming (the checkpoint's `hf_config/` is used)."""
    config: dict[str, HfConfigValue] = field(default_factory=dict)
    """HF config keys: the architecture from scratch, or overrides on top of `init_from`'s config."""
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention backend; `auto` picks flash_attention_2 when importable and on CUDA, else sdpa."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    pad_vocab_to_multiple_of: int = 1
    """From scratch: embedding rows = tokenizer length rounded up to this multiple (64 helps GPUs)."""

    def check(self) -> None:
        if self.pad_vocab_to_multiple_of < 1:
            raise ValueError("pad_vocab_to_multiple_of: must be >= 1")

    def padded_vocab_size(self, tokenizer_size: int) -> int:
        """Embedding rows from scratch: the tokenizer's length rounded up to `pad_vocab_to_multiple_of`."""
        multiple = self.pad_vocab_to_multiple_of
        return -(-tokenizer_size // multiple) * multiple


@dataclass
class TokenizerConfig:
    path: str | None = None
    """Tokenizer spec for `ntl_pretrain.tokenizer.load_tokenizer` (`pkg:` paths allowed); null = the one in
    `init_from`, or in the resumed checkpoint's `tokenizer/`."""
    trust_remote_code: bool = False
    """Allow tokenizer code shipped with an HF folder to run."""

    def check(self) -> None:
        if self.path is not None and not self.path.strip():
            raise ValueError("path: empty; name a tokenizer file or folder, or write null for init_from's")


@dataclass
class NtlConfig:
    kind: Literal["was", "mse", "mae", "huber", "digits", "number"] | None = "was"
    """NTL variant; null trains with plain cross-entropy through the same code path. was|mse|mae|huber judge each
    number token by its value (scaled by its class: 10^(digits-1)); "digits" judges it digit by digit (a near miss
    in the last digit of `157` costs 1/3, as on a single-digit token); "number" judges whole numbers: one relative
    error per number across its tokens (docs/loss.md)."""
    weight: float = 0.3
    """λ in `CE + λ·NTL`."""
    reweigh: bool = False
    """Weight NTL by the probability mass on the label's number class (off in the paper; token kinds only)."""
    float_level: bool = False
    """kind number: one decimal point between two runs of digits joins them into one number (12.34 is 1234)."""

    def check(self) -> None:
        if self.weight < 0:
            raise ValueError("weight: must be >= 0")
        if self.kind is None and self.reweigh:
            raise ValueError("reweigh: weighs the NTL term, and kind null trains without one")
        if self.kind == "number" and self.reweigh:
            raise ValueError("reweigh: not defined for kind number (it weighs single tokens)")
        if self.kind == "digits" and self.reweigh:
            raise ValueError("reweigh: not defined for kind digits (its distance has no class value range)")
        if self.float_level and self.kind != "number":
            raise ValueError(f"float_level: only kind number reads whole numbers, got kind {self.kind!r}")


@dataclass
class LossConfig:
    ntl: NtlConfig = field(default_factory=NtlConfig)
    """The Number Token Loss term."""
    head: Literal["chunked", "dense"] = "chunked"
    """chunked: output layer + loss a chunk of positions at a time, the [B, T, V] logits never exist (one [R, V]
    fp32 chunk does); dense: the output layer materialises the logits and their gradient (tiny vocabularies,
    debugging)."""
    chunk_size: int | None = None
    """Positions per chunk of the chunked head; null = 2^26 / V (a 256 MiB fp32 chunk of logits)."""
    vocab_parallel_size: int = 1
    """k > 1: groups of k consecutive data-parallel ranks share the output layer by vocabulary rows
    (`VocabParallelHead`), so no rank gathers the whole [V, H] matrix; must divide the world size; needs an untied
    output layer. 1 = the output layer under ZeRO-3."""
    router_aux_weight: float | None = None
    """Mixture of experts: the weight of the routers' load-balancing loss in `CE + λ·NTL + w·aux` (transformers'
    `load_balancing_loss_func`, as the model's forward computes it); null = the model's own coefficient
    (`router_aux_loss_coef`); 0 trains without it (still logged). Refused above 0 for a model without one."""

    def check(self) -> None:
        if self.vocab_parallel_size < 1:
            raise ValueError("vocab_parallel_size: must be >= 1")
        if self.router_aux_weight is not None and not 0 <= self.router_aux_weight < float("inf"):
            raise ValueError(f"router_aux_weight: must be a number >= 0, or null for the model's own coefficient, got "
                             f"{self.router_aux_weight}")  # fmt: skip
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size: must be a positive number of positions or null, got {self.chunk_size}")


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norms, biases or embeddings."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def check(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: need two values in [0, 1), got {self.betas}")
        if self.lr <= 0:
            raise ValueError("lr: must be > 0")
        if self.eps <= 0:
            raise ValueError(f"eps: must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError("grad_clip: must be >= 0")


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate shape after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: int = 0
    """Linear warmup from `warmup_start_ratio * lr` to lr (re-warms a pretrained model)."""
    warmup_start_ratio: float = 0.0
    """Warmup starts from this fraction of the peak, in [0, 1]; update k (0-based) of the warmup uses
    `start + (1 - start) * (k + 1) / warmup_steps`, so no update is spent at the start value."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and wsd)."""
    decay_fraction: float = 0.2
    """wsd: fraction of `train.max_steps` spent in the final linear decay."""

    def check(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps: must be >= 0")
        if not 0 <= self.warmup_start_ratio <= 1:
            raise ValueError(f"warmup_start_ratio: must be in [0, 1] (a fraction of optimizer.lr), got "
                             f"{self.warmup_start_ratio}")  # fmt: skip
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio: must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError("decay_fraction: must be in (0, 1]")


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    """Run directory: resolved recipe, metrics.jsonl, checkpoints/."""
    max_steps: int = 1000
    """Optimizer steps to train (also the length of the learning-rate schedule)."""
    micro_batch_size: int = 1
    """Sequences per rank per forward pass."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks; gradient accumulation is derived from it."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step (a multiple of `data.seq_len`); alternative to global_batch_size."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the ranks run: cuda (a GPU per rank; refused before launch when no GPU is visible, so a GPU recipe never
    trains on CPU ranks by accident, unless DS_ACCELERATOR=cpu is set), cpu (gloo ranks, GPUs hidden from them), or
    auto (cuda where a GPU is visible, else cpu)."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Parameter/activation dtype under DeepSpeed; the loss is always computed in fp32."""
    resume: str | None = "auto"
    """`auto`: continue from the newest intact checkpoint in output_dir when there is one (weights, optimizer,
    schedule, data position, RNG; `init_from` is then ignored), else start (from `init_from` or from scratch), so
    the command that started a run also continues it after a crash or preemption; a checkpoint folder; or null:
    start afresh, refused where output_dir already holds checkpoints or metrics unless `overwrite`."""
    overwrite: bool = False
    """With `resume: null`, start afresh in an output_dir that holds an earlier run: its checkpoints and
    metrics.jsonl are deleted once the recipe has passed every check."""
    stop_grace_seconds: int = 300
    """After SIGTERM, SIGINT or SIGUSR1 the ranks finish the current step, save a checkpoint and exit with code 75;
    a rank still not done this many seconds after the signal exits at once (the previous checkpoint stays
    intact), and so does any rank on a second signal."""
    eval_every_steps: int | None = None
    """Evaluate on the data validation split every N steps (and at the end); null = never."""
    eval_max_batches: int | None = None
    """Cap on validation micro-batches per rank and evaluation; null = the whole split."""
    max_nonfinite_steps: int = 5
    """Skip steps whose loss is NaN/inf; stop the run after this many in a row."""
    dist_timeout_seconds: int = 300
    """How long ranks wait for each other: for all nodes to join the process group at start, and in any
    collective; a rank that gives up names the master address and port."""

    def check(self) -> None:
        if self.max_steps < 1:
            raise ValueError("max_steps: must be >= 1")
        if self.micro_batch_size < 1:
            raise ValueError("micro_batch_size: must be >= 1")
        if self.dist_timeout_seconds < 1:
            raise ValueError("dist_timeout_seconds: must be >= 1")
        if self.stop_grace_seconds < 1:
            raise ValueError("stop_grace_seconds: must be >= 1")
        if self.overwrite and self.resume is not None:
            raise ValueError(f"overwrite: only with resume: null (a resume keeps the run), got resume {self.resume!r}")
        for name in ("global_batch_size", "global_batch_tokens", "eval_every_steps", "eval_max_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 or null, got {getattr(self, name)}")
        if self.max_nonfinite_steps < 1:
            raise ValueError("max_nonfinite_steps: must be >= 1")
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("global_batch_tokens: set either global_batch_size or global_batch_tokens")
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).exists():
            raise ValueError(f"resume: checkpoint {self.resume} does not exist")


@dataclass
class CheckpointConfig:
    every_steps: int | None = None
    """Save every N steps (and after the last step); null = only after the last step."""
    keep_last: int = 2
    """Keep this many most recent checkpoints; older ones are deleted after a successful save."""
    verify: Literal["checksum", "size"] = "checksum"
    """Before a resume, check every file of the checkpoint against its manifest: sizes and checksums, or sizes
    only (`size`: no file is read, for very large checkpoints on slow storage)."""

    def check(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last: must be >= 1")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError("every_steps: must be >= 1")


@dataclass
class LoggingConfig:
    progress_bar: bool = True
    """On a terminal, a rank-0 tqdm bar with loss, CE, NTL, learning rate, tokens/s and peak memory; off a terminal
    (Slurm logs, nohup, a pipe) plain lines instead (`console_every_steps`)."""
    console_every_steps: int = 10
    """Off a terminal, or with `progress_bar: false`: one line with the bar's fields every this many steps, plus the
    run's first and last step (every step is in metrics.jsonl); 0 = those two only."""
    verbose: bool = False
    """Console: false shows the progress bar, rank 0's lines and warnings, and errors from every rank; true also
    shows the launcher's INFO lines, the other ranks' warnings and DeepSpeed's use of deprecated torch collectives."""
    wandb: bool | Literal["offline"] = False
    """Also log to Weights & Biases (needs the `wandb` extra). true: online, which the pre-flight checks before launch
    (an API key, the server reachable; or WANDB_MODE offline/disabled); offline: into <output_dir>/wandb without a
    key or network (`wandb sync` later)."""
    wandb_project: str = "ntl_pretrain"
    """W&B project name."""
    wandb_run_name: str | None = None
    """W&B run name; null = W&B's default."""
    peak_flops_per_device: float | None = None
    """Peak FLOP/s of one device for MFU; null = the device's dense bf16 peak from `metrics.BF16_PEAK_FLOPS` for a
    bf16 run on a GPU it lists, else no MFU (null: CPU, unknown GPUs, fp32)."""

    def check(self) -> None:
        if self.console_every_steps < 0:
            raise ValueError(f"console_every_steps: must be >= 0, got {self.console_every_steps}")
        if self.peak_flops_per_device is not None and self.peak_flops_per_device <= 0:
            raise ValueError(f"peak_flops_per_device: must be > 0 or null, got {self.peak_flops_per_device}")


@dataclass
class DeepSpeedSection:
    config: str = "../configs/zero3.json"
    """DeepSpeed JSON (ZeRO settings); a relative path is relative to the recipe file that sets it.
    Batch sizes, precision and clipping come from the recipe: the JSON must leave them out or `auto`."""


@dataclass
class Recipe:
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length, batch sizes, precision, resume."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus sources, packing and validation split (see ntl_pretrain.data)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture or init_from overrides, attention backend."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer to train with."""
    loss: LossConfig = field(default_factory=LossConfig)
    """CE + λ·NTL."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Progress bar, W&B, MFU."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Generation metrics on question/answer sets during training (see ntl_pretrain.evaluation)."""
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    """DeepSpeed JSON config."""
    seed: int = 0
    """Seeds model init, data order and dropout."""
    init_from: str | None = None
    """HF model folder to load weights from (continued pretraining) when the run starts; a resumed run restores
    its own weights instead."""

    def check(self) -> None:
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed: must be in [0, 2^32), got {self.seed}")
        saved_architecture = self.init_from is not None or self.train.resume is not None
        if not saved_architecture and self.model.model_type is None:
            raise ValueError("model.model_type: required when training from scratch (no init_from, no resume)")
        if self.init_from is not None and self.model.model_type is not None:
            raise ValueError("model.model_type: must be null with init_from (the folder's config is used)")
        if not saved_architecture and self.tokenizer.path is None:
            raise ValueError("tokenizer.path: required without init_from or train.resume")
        if self.train.global_batch_tokens is not None and self.train.global_batch_tokens % self.data.seq_len:
            raise ValueError(
                f"train.global_batch_tokens: {self.train.global_batch_tokens} is not a multiple of "
                f"data.seq_len={self.data.seq_len}"
            )
        if self.train.eval_every_steps is not None and not self.data.validation:
            raise ValueError("train.eval_every_steps: validation needs data.validation sources; add some, or set "
                             "train.eval_every_steps=null")  # fmt: skip
        if self.eval.every_steps is not None and not self.eval.qa_sets:
            raise ValueError("eval.every_steps: generation metrics need eval.qa_sets; add some, or set "
                             "eval.every_steps=null")  # fmt: skip
        if self.loss.vocab_parallel_size > 1 and self.model.config.get("tie_word_embeddings") is True:
            raise ValueError(
                "loss.vocab_parallel_size: needs an output layer of its own; model.config.tie_word_embeddings: true "
                "ties it to the input embedding (docs/vocab-parallel.md explains why that is refused)"
            )


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Load, merge (`base:` chain, then overrides), type-check and validate a recipe."""
    raw, origins = _load_yaml_chain(Path(path), seen=())
    for item in overrides:
        key, value = _parse_override(item)
        _apply_override(raw, key, value, origins)
    return _build(Recipe, raw, (), _Origins(origins, str(path)))


def dump_recipe(recipe: Recipe) -> str:
    """YAML text that `load_recipe` turns back into an equal recipe."""
    return yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False)


def _load_yaml_chain(path: Path, seen: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    path = path.expanduser().resolve()
    if path in seen:
        raise RecipeError(f"{path}: base: inheritance cycle through {[str(p) for p in seen]}")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping, got {type(raw).__name__}")
    if not raw:
        raise RecipeError(f"{path}: empty recipe; start from one in recipes/ (e.g. base: tiny-cpu.yaml, then the keys "
                          f"to change)")  # fmt: skip
    _anchor_relative_paths(raw, path.parent)
    base = raw.pop("base", None)
    merged, origins = ({}, {}) if base is None else _load_yaml_chain(_base_path(path, base), seen + (path,))
    _deep_merge(merged, raw)
    origins.update({key: str(path) for key in _dotted_keys(raw)})
    return merged, origins


YAML11_BOOL_WORDS = ("yes", "no", "on", "off")
"""Words YAML 1.1 reads as booleans; a recipe spells booleans `true`/`false`, so these are refused, not guessed."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last one silently) and every
    alias: a few hundred bytes of nested aliases expand to gigabytes, and a recipe has no need to repeat a value
    by reference."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise RecipeError(f"line {event.start_mark.line + 1}: alias *{event.anchor}: YAML aliases are not "
                              f"allowed; write the value out")  # fmt: skip
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):
        return self._not_base_60(node, super().construct_yaml_int(node))

    def construct_yaml_float(self, node):
        return self._not_base_60(node, super().construct_yaml_float(node))

    def construct_yaml_bool(self, node):
        value = super().construct_yaml_bool(node)
        if node.value.lower() in YAML11_BOOL_WORDS:
            raise RecipeError(f"line {node.start_mark.line + 1}: {node.value!r} reads as {value} in YAML 1.1; write "
                              f"{str(value).lower()}, or quote it for the text")  # fmt: skip
        return value

    @staticmethod
    def _not_base_60(node, value):
        """YAML 1.1 reads `1:30` as 90 (base 60): a typo'd duration or ratio would train for a surprising length."""
        if ":" in node.value:
            raise RecipeError(f"line {node.start_mark.line + 1}: {node.value!r} reads as the base-60 number {value} "
                              f"in YAML 1.1; write the number, or quote it for the text")  # fmt: skip
        return value

    def construct_mapping(self, node, deep=False):
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                raise RecipeError(f"line {line}: a key must be a plain name, got {key!r}")
            if key in seen:
                raise RecipeError(f"line {line}: duplicate key {key!r} (first at line {seen[key]})")
            seen[key] = line
        return super().construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:bool", _UniqueKeyLoader.construct_yaml_bool)


def read_yaml_file(path: Path) -> object:
    """The parsed YAML file (a recipe, or the recipe.yaml saved in a run); every failure, also a file over
    `MAX_YAML_BYTES` or one with aliases, is one RecipeError naming the file."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_YAML_BYTES + 1)
    except OSError as error:
        raise RecipeError(f"{path}: cannot read recipe: {error.strerror or error}") from error
    if len(data) > MAX_YAML_BYTES:
        raise RecipeError(f"{path}: over {MAX_YAML_BYTES >> 20} MiB, too large for a recipe")
    if b"\0" in data:
        raise RecipeError(f"{path}: not a recipe: binary file (NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RecipeError(f"{path}: not UTF-8 text (byte {error.start}); save the recipe as UTF-8") from error
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except RecipeError as error:
        raise RecipeError(f"{path}: {error}") from error
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: invalid YAML: {_one_line(error)}") from error


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _base_path(path: Path, base: object) -> Path:
    """`base:` is a non-empty path string, relative to the file that names it; `~` is expanded."""
    if not isinstance(base, str) or not base.strip():
        raise RecipeError(f"{path}: base: expected a path to one recipe file, got {base!r}")
    target = (path.parent / Path(base).expanduser()).resolve()
    if not target.is_file():
        what = "is a folder, not a recipe file" if target.is_dir() else "does not exist"
        raise RecipeError(f"{path}: base: {target} {what}")
    return target


def _anchor_relative_paths(raw: dict, directory: Path) -> None:
    """Recipe-relative paths become absolute so that recipes extending others from elsewhere work."""
    section = raw.get("deepspeed")
    if isinstance(section, dict) and isinstance(section.get("config"), str):
        config = section["config"]
        if not config.startswith("pkg:") and not Path(config).expanduser().is_absolute():
            section["config"] = str((directory / config).resolve())


def _deep_merge(into: dict, update: Mapping) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _dotted_keys(raw: Mapping, prefix: str = "") -> list[str]:
    keys = []
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, Mapping):
            keys.extend(_dotted_keys(value, dotted + "."))
    return keys


def _parse_override(item: str) -> tuple[str, object]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"{OVERRIDE_ORIGIN} {item!r}: expected key.path=value")
    if not text.strip():
        # `loss.ntl.kind=` would parse as null and silently switch a feature off.
        raise RecipeError(f"{OVERRIDE_ORIGIN}: {key}: empty value; write {key}=null to mean null")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, RecipeError) as error:
        raise RecipeError(f"{OVERRIDE_ORIGIN}: {key}: value {text!r} is not valid YAML ({_one_line(error)})") from error
    return key, value


def _apply_override(raw: dict, key: str, value: object, origins: dict[str, str]) -> None:
    """Like one more child file: a mapping merges into the mapping it replaces; `a.b.0.c` addresses list item 0.
    Every key the override touches is blamed on it, so a typo in its path is reported as the override's."""
    *parents, leaf = key.split(".")
    node: dict | list = raw
    for depth, name in enumerate(parents):
        node = _child_for_override(node, name, key, ".".join(parents[: depth + 1]), origins)
    if isinstance(node, list):
        node[_list_index(node, leaf, key)] = value
    elif isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
        _deep_merge(node[leaf], value)
    else:
        node[leaf] = dict(value) if isinstance(value, Mapping) else value
    origins[key] = OVERRIDE_ORIGIN
    if isinstance(value, Mapping):
        origins.update({f"{key}.{dotted}": OVERRIDE_ORIGIN for dotted in _dotted_keys(value)})


def _child_for_override(node: dict | list, name: str, key: str, dotted: str, origins: dict[str, str]):
    if isinstance(node, list):
        child = node[_list_index(node, name, key)]
    else:
        if name not in node:
            node[name] = {}
            origins[dotted] = OVERRIDE_ORIGIN
        child = node[name]
    if not isinstance(child, (dict, list)):
        raise RecipeError(f"{OVERRIDE_ORIGIN}: {key}: {dotted} is {child!r}, not a section or a list")
    return child


def _list_index(items: list, name: str, key: str) -> int:
    if not name.isdigit() or int(name) >= len(items):
        raise RecipeError(
            f"{OVERRIDE_ORIGIN}: {key}: {name!r} is not an item of this list (items 0..{len(items) - 1}); "
            "address one as key.N.field=value, or give the whole list as key=[...]"
        )
    return int(name)


@dataclass
class _Origins:
    by_key: dict[str, str]
    default: str

    def of(self, key_path: tuple[str, ...]) -> str:
        inside = ".".join(key_path) + "."
        if key_path and any(key.startswith(inside) and by == OVERRIDE_ORIGIN for key, by in self.by_key.items()):
            return OVERRIDE_ORIGIN  # an override changed an item inside it (`optimizer.betas.0=1.5`)
        for end in range(len(key_path), 0, -1):
            origin = self.by_key.get(".".join(key_path[:end]))
            if origin is not None:
                return origin
        return self.default


def _build(cls: type, raw: object, key_path: tuple[str, ...], origins: _Origins):
    where = ".".join(key_path) or "<recipe>"
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{origins.of(key_path)}: {where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            dotted = ".".join(key_path + (str(key),))
            close = _closest(str(key), names) or _section_holding(str(key))
            hint = f"did you mean {close!r}? " if close else ""
            raise RecipeError(
                f"{origins.of(key_path + (str(key),))}: {dotted}: unknown key ({hint}known: {sorted(names)})"
            )
    values = {key: _coerce(hints[key], value, key_path + (key,), origins) for key, value in raw.items()}
    for name in names - set(raw):  # a section the recipe omits still gets its checks (`data:` needs sources)
        if dataclasses.is_dataclass(hints[name]):
            values[name] = _build(hints[name], {}, key_path + (name,), origins)
    obj = cls(**values)
    _run_check(obj, key_path, origins)
    return obj


def _run_check(obj: object, key_path: tuple[str, ...], origins: _Origins) -> None:
    check = getattr(obj, "check", None)
    if check is None:
        return
    try:
        check()
    except ValueError as error:
        message = str(error)
        named = message.split(":", 1)[0].strip()
        named_path = key_path + tuple(named.split(".")) if " " not in named else key_path
        dotted = ".".join(named_path) or "<recipe>"
        detail = message.split(":", 1)[1].strip() if named_path != key_path else message
        raise RecipeError(f"{origins.of(named_path)}: {dotted}: {detail}") from error


def _coerce(hint: object, value: object, key_path: tuple[str, ...], origins: _Origins) -> object:
    """Sections recurse through `_build` (origins, unknown keys, checks); containers recurse so that an error names
    the item (`data.sources.1.weight`, `model.config.hidden_size`); every leaf is validated by pydantic."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key_path, origins)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            return _type_error(hint, value, key_path, origins)
        return [_coerce(args[0], item, key_path + (str(i),), origins) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            return _type_error(hint, value, key_path, origins)
        return {str(k): _coerce(args[1], v, key_path + (str(k),), origins) for k, v in value.items()}
    if float in (args or (hint,)) and isinstance(value, str):
        # YAML 1.1 reads `3e-4` (no dot) as a string; accept the number it obviously means.
        with contextlib.suppress(ValueError):
            value = float(value)
    try:
        coerced = _adapter(hint).validate_python(value)
    except pydantic.ValidationError as error:
        kinds = {detail["type"] for detail in error.errors()}
        return _type_error(hint, value, key_path, origins, "a finite number" if "finite_number" in kinds else None)
    if isinstance(coerced, int) and not isinstance(coerced, bool) and abs(coerced) > MAX_RECIPE_INT:
        return _type_error(hint, value, key_path, origins, f"a whole number of at most {MAX_RECIPE_INT:,} in size")
    return coerced


@functools.cache
def _adapter(hint: object) -> pydantic.TypeAdapter:
    # strict: no "5" -> 5 or 1 -> True guessing; allow_inf_nan off: nan/inf (and 1e999) are refused.
    return pydantic.TypeAdapter(hint, config=pydantic.ConfigDict(strict=True, allow_inf_nan=False))


def _type_error(hint, value, key_path, origins, expected: str | None = None) -> typing.NoReturn:
    expected = expected or _type_name(hint)
    raise RecipeError(
        f"{origins.of(key_path)}: {'.'.join(key_path)}: expected {expected}, got {value!r}{_value_hint(hint, value)}"
    )


def _value_hint(hint: object, value: object) -> str:
    """What the writer of a refused string most likely meant: null for `None` (where null is allowed), else a choice
    it misspells."""
    if not isinstance(value, str):
        return ""
    if value.strip().lower() == "none" and type(None) in typing.get_args(hint):
        return " (write null, not None)"
    # Stricter than for keys: a short value is close to unrelated words (at 0.6, `gpu` would suggest `cpu`).
    close = _closest(value, _choices(hint), cutoff=0.75)
    return f" (did you mean {close!r}?)" if close else ""


def _section_holding(key: str) -> str | None:
    """Where in the recipe `key` is a field (`precision` -> `train.precision`), for a key put in the wrong section;
    None unless exactly one section has it."""
    paths, sections = [], [((), Recipe)]
    while sections:
        prefix, cls = sections.pop()
        for name, hint in typing.get_type_hints(cls).items():
            if name == key and prefix:
                paths.append(".".join(prefix + (key,)))
            if dataclasses.is_dataclass(hint):
                sections.append((prefix + (name,), hint))
    return paths[0] if len(paths) == 1 else None


def _closest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The candidate that `word` most likely misspells, case aside; None when none is close enough."""
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(word.lower(), by_lower, n=1, cutoff=cutoff)
    return by_lower[close[0]] if close else None


def _choices(hint: object) -> list[str]:
    """The string values a Literal field (also inside `... | None`) allows; empty for any other type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return [arg for arg in args if isinstance(arg, str)]
    if origin in (typing.Union, types.UnionType):
        return [choice for arg in args for choice in _choices(arg)]
    return []


def _type_name(hint: object) -> str:
    """Readable expected type: `one of 'was', 'mse' (or null)`, `int or null`, `list of float`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        names = " or ".join(_type_name(arg) for arg in args if arg is not type(None))
        if type(None) not in args:
            return names
        # After a list of values, in parentheses: null is not one more value to write in quotes.
        return f"{names} (or null)" if _choices(hint) else f"{names} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
