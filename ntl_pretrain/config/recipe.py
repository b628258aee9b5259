"""The recipe: one typed schema for a training run (read from YAML by `config.loading`).

Every section is a dataclass whose fields carry their documentation (a string under each field); `check()`
refuses contradictions within a section, naming the key. Imports no torch: a recipe is checked in a fraction of
a second, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ntl_pretrain.data.config import DataConfig
from ntl_pretrain.errors import InputError
from ntl_pretrain.evaluation.config import EvalConfig

HfScalarOrList = int | float | str | bool | list[int] | list[float] | list[str] | None
# A mapping one level deep holds transformers 5's `rope_parameters` ({rope_type: yarn, factor: 4.0, ...}).
HfConfigValue = HfScalarOrList | dict[str, HfScalarOrList]


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
    in the last digit of `157` costs 1/3, as on a single-digit token; study v4 found it lowers exact match at
    weight 0.3 on a 1-3-digit tokenizer, docs/evaluation.md); "number" judges whole numbers: one relative
    error per number across its tokens (docs/loss.md)."""
    weight: float = 0.3
    """λ in `CE + λ·NTL`."""
    reweigh: bool = False
    """Weight NTL by the probability mass on the label's number class (off in the paper; token kinds only)."""
    float_level: bool = False
    """kind number: one decimal point between two runs of digits joins them into one number (12.34 is 1234)."""

    def check(self, none: str = "null") -> None:
        """`none`: how the caller writes a missing kind (a recipe `null`, `apply_ntl` Python's `None`)."""
        if self.weight < 0:
            raise ValueError("weight: must be >= 0")
        if self.kind is None and self.reweigh:
            raise ValueError(f"reweigh: weighs the NTL term, and kind {none} trains without one")
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
    """Positions per chunk of the chunked head; null = 2^26 / V with backend torch (a 256 MiB fp32 chunk of logits),
    2^28 / V with triton (the chunk in the logits' dtype, its gradient written over it: 512 MiB in bf16)."""
    backend: Literal["auto", "torch", "triton"] = "auto"
    """What computes CE + NTL: triton (Triton kernels, fp32 math from bf16 logits, on CUDA GPUs), torch (the
    reference, on any device), or auto (triton on CUDA where the triton package imports, else torch). triton where it
    cannot run is refused before launch."""
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
    """Run directory: resolved recipe, metrics.jsonl, checkpoints/. A relative path is relative to the recipe file
    that sets it (in an override, to the working directory); unset, `runs/default` beside the recipe."""
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
    reduce_dtype: Literal["fp32", "bf16"] | None = None
    """bf16 runs: the dtype of ZeRO-3's gradient reduce-scatter over ranks (DeepSpeed's `communication_data_type`);
    null = the DeepSpeed JSON's choice, else fp32. bf16 halves the bytes (Llama-3-8B at 64 GPUs: ~15.8 GB per rank
    per micro-batch instead of ~31.5, estimated ~1.4 s of fp32 communication against ~0.8 s of compute over
    InfiniBand) but keeps 8 significant bits per add: summed over 64 ranks, a small gradient loses most of its bits.
    The doctor's `reduce-scatter fp32 / bf16` row times both on a node (docs/recipes.md, "DeepSpeed configs")."""
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
    """Cap on validation micro-batches per rank and evaluation: the first eval_max_batches × micro_batch_size × ranks
    packed sequences of the split, its sources in order (`ntl-pretrain eval --max-validation-batches` counts the
    same); null = the whole split."""
    max_nonfinite_steps: int = 5
    """Skip steps whose loss is NaN/inf; stop the run after this many in a row."""
    dist_timeout_seconds: int = 300
    """How long ranks wait for each other: for all nodes to join the process group at start, and in any
    collective; a rank that gives up names the master address and port."""
    compile: bool = False
    """Compile the model: at ZeRO stages 1 and 2 each decoder layer with torch.compile (in place, one graph shared by
    the layers, as torchtitan does); at ZeRO-3 the whole model with DeepSpeed's DeepCompile, which moves the gathers,
    releases and gradient reduce-scatters into the graph (CUDA GPUs only: refused on CPU ranks). Fewer kernel
    launches and Python calls a step, after a first step that compiles (tens of seconds). Off until a GPU run shows
    it faster (docs/benchmarks.md, "Step overhead")."""

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
        if self.reduce_dtype is not None and self.precision != "bf16":
            raise ValueError(f"reduce_dtype: only for precision bf16 (an fp32 run reduces in fp32), got "
                             f"{self.reduce_dtype} with precision {self.precision}")  # fmt: skip
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
    console_every_seconds: float = 4.0
    """The longest rank 0's console stays silent, whatever a step takes: the last step's line if it was not printed,
    else what is under way and for how long (`step 41/300 under way (8 s)`); on a terminal the bar is redrawn. 0 =
    steps alone decide."""
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
    profile_steps: list[int] | None = None
    """[first, count]: torch.profiler over optimizer steps first .. first + count - 1 (after the warm-up: [20, 5]);
    rank 0 writes <output_dir>/profile/steps-A-B.txt (ops by self time) and .json (per step: CPU op time, device
    kernel time, ops, kernel launches); null = off."""

    def check(self) -> None:
        if self.profile_steps is not None and (len(self.profile_steps) != 2 or min(self.profile_steps) < 1):
            raise ValueError(f"profile_steps: [first step, number of steps], both >= 1, or null; got "
                             f"{self.profile_steps}")  # fmt: skip
        if self.console_every_steps < 0:
            raise ValueError(f"console_every_steps: must be >= 0, got {self.console_every_steps}")
        if self.console_every_seconds < 0:
            raise ValueError(f"console_every_seconds: must be >= 0, got {self.console_every_seconds}")
        if self.peak_flops_per_device is not None and self.peak_flops_per_device <= 0:
            raise ValueError(f"peak_flops_per_device: must be > 0 or null, got {self.peak_flops_per_device}")


@dataclass
class DeepSpeedSection:
    config: str = "pkg:ntl_pretrain/config/zero3.json"
    """DeepSpeed JSON (ZeRO settings): the package's ZeRO-3 one by default (`pkg:ntl_pretrain/config/zero3_offload.json`
    offloads the optimizer and weights to the CPU); a relative path is relative to the recipe file that sets it.
    Batch sizes, precision and clipping come from the recipe: the JSON must leave them out or `auto`."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """ZeRO stage, in place of the JSON's `zero_optimization.stage`; null = the JSON's (3 in the package's zero3.json).
    3 partitions the weights, gradients and Adam states over the ranks: the only stage for a model whose weights,
    gradients and Adam states (16 bytes a parameter in bf16) do not fit on one device. 2 keeps the weights whole
    on every rank and partitions gradients and Adam states: no gathering in forward and backward, the faster step
    for a model that fits; 1 partitions the Adam states only (docs/recipes.md, "ZeRO stage"). 0 is refused: a
    stage-0 checkpoint holds no optimizer shards, which resume on another world size and export read."""
    gather: Literal["layer", "module"] = "layer"
    """ZeRO-3: all-gather a decoder layer's parameters at once on entering it (DeepSpeed's `leaf_module`, the
    layer classes of the model's `_no_split_modules`), or each submodule's in turn (`module`, DeepSpeed's
    default: ~10 gathers, hooks and releases a layer instead of one, and the least memory: docs/recipes.md,
    "ZeRO stage", works out both for Llama-3-8B on 8 GPUs)."""

    def check(self) -> None:
        if self.zero_stage == 0:
            raise ValueError("zero_stage: 0 is not supported: a stage-0 checkpoint holds no optimizer shards, which "
                             "resume on another world size and export read; use 1 (only the Adam states are "
                             "partitioned) or 2")  # fmt: skip


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
