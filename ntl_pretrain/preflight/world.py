"""Pre-flight: the checks of a recipe that need the world (installed model types, files, folders, ports), run by
`ntl-pretrain train` and `--dry-run` alike before any process starts. Each failure is one `RecipeError` naming the
key; `load_recipe` (config/loading.py) has already checked types, ranges and contradictions."""

from __future__ import annotations

import difflib
import importlib.util
import netrc
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.evaluation.model_folder import WEIGHT_FILES, has_weights
from ntl_pretrain.model import flash_attention
from ntl_pretrain.model.document_attention import transformers_takes_varlen_arguments
from ntl_pretrain.preflight.config_keys import check_config_keys
from ntl_pretrain.preflight.model import check_given_sizes, check_model, position_limits
from ntl_pretrain.runtime import run_lock
from ntl_pretrain.tokenizer import resolve_path

WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need neither key nor network
WANDB_CONNECT_TIMEOUT_S = 5.0


def check_world(recipe: Recipe, master_port: int | None, stage: Callable[[str], None] = lambda _: None):
    """Every check below, in the order a user would fix them; `stage(what)` is told what is checked next. Returns
    the tokenizer the ranks will load (None: the checkpoint's, `check_tokenizer`)."""
    stage("the output folder's earlier run")
    starts_fresh = recipe.init_from is None and existing_checkpoint(recipe) is None
    check_no_earlier_run(recipe)
    stage("the model type and init_from")
    check_model_type(recipe.model.model_type, starts_fresh)
    check_init_from(recipe.init_from)
    stage("the tokenizer")
    tokenizer = check_tokenizer(recipe, starts_fresh)
    stage("the model config")
    config = model_config(recipe)
    check_config_keys(recipe, config)
    check_positions(recipe)
    stage("the model, built on the meta device" + (", and init_from's weights" if recipe.init_from else ""))
    check_model(recipe, config, tokenizer)
    stage("the attention backend, optional packages, the device, the output folder, the port")
    check_attention(recipe)
    check_optional_packages(recipe)
    check_device(recipe.train.device)
    check_loss_backend(recipe)
    check_output_dir(recipe.train.output_dir)
    run_lock.check_free(recipe.train.output_dir)
    check_master_port(master_port)
    return tokenizer


def existing_checkpoint(recipe: Recipe) -> Path | None:
    """The checkpoint a resume would start from (None on a fresh run); a `train.resume` that is not one is refused."""
    resume = recipe.train.resume
    if resume not in (None, "auto") and not Path(resume).expanduser().is_dir():
        raise RecipeError(f"train.resume: {resume} is a file; name a checkpoint step folder or a run's output_dir")
    try:
        return checkpoint.resolve_resume(resume, recipe.train.output_dir)
    except FileNotFoundError as error:
        raise RecipeError(str(error)) from error


def check_no_earlier_run(recipe: Recipe) -> None:
    """`train.resume: null` starts afresh: refused where output_dir holds an earlier run, unless `overwrite`."""
    if recipe.train.resume is not None or recipe.train.overwrite:
        return
    folder = Path(recipe.train.output_dir).expanduser()
    found = [str(p) for p in checkpoint.published_steps(checkpoint.checkpoints_root(folder))]
    if (folder / "metrics.jsonl").is_file():
        found.append(str(folder / "metrics.jsonl"))
    if found:
        raise RecipeError(
            f"train.resume: null would start afresh over the run in {folder} ({', '.join(found[:3])}); continue it "
            f"with train.resume=auto, or give this run another train.output_dir (train.overwrite=true deletes the "
            f"earlier run)"
        )


def check_model_type(model_type: str | None, starts_fresh: bool = False) -> None:
    if model_type is None:
        if starts_fresh:
            raise RecipeError(
                "model.model_type: required: this run starts from scratch (no init_from, no checkpoint to resume)"
            )
        return
    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see transformers' CONFIG_MAPPING for the names"
        raise RecipeError(f"model.model_type: unknown model type {model_type!r}; {hint}")


def check_init_from(init_from: str | None) -> None:
    if init_from is None:
        return
    folder = Path(init_from).expanduser()
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise RecipeError(f"init_from: {folder} {what}; name an HF model folder (config.json + weights)")
    if not (folder / "config.json").is_file():
        raise RecipeError(f"init_from: {folder} has no config.json; name an HF model folder")
    if not has_weights(folder):
        raise RecipeError(f"init_from: {folder} has no weights (none of {', '.join(WEIGHT_FILES)})")


def check_tokenizer(recipe: Recipe, starts_fresh: bool):
    """The tokenizer the ranks will load (`tokenizer.path`, else init_from's); None when it comes from the
    checkpoint a resume loads."""
    key, spec = ("tokenizer.path", recipe.tokenizer.path) if recipe.tokenizer.path else ("init_from", recipe.init_from)
    if spec is None:
        if starts_fresh:
            raise RecipeError(
                "tokenizer.path: required: this run starts from scratch (no init_from, no checkpoint to resume)"
            )
        return None
    try:
        path = resolve_path(spec)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise RecipeError(f"{key}: {error}") from error
    if not path.exists():
        raise RecipeError(f"{key}: {path} does not exist")
    from ntl_pretrain.tokenizer import load_tokenizer

    try:  # every rank loads it again after launch; a file that is not a tokenizer fails here, once, in one line
        return load_tokenizer(spec, trust_remote_code=recipe.tokenizer.trust_remote_code)
    except Exception as error:  # tokenizers, sentencepiece, tiktoken and transformers raise their own types
        raise RecipeError(f"{key}: cannot load the tokenizer {spec}: {' '.join(str(error).split())[:300]}") from error


def check_attention(recipe: Recipe) -> None:
    """flash-attention-2 needs the flash_attn package and a GPU on the machine that launches (its ranks run there),
    and for per-document attention a transformers that takes the varlen arguments (document_attention.py); sdpa
    needs an architecture that transformers runs with it."""
    attention = recipe.model.attention
    if attention == "sdpa":
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        config = model_config(recipe)
        model_class = None if config is None else MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
        if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
            raise RecipeError(f"model.attention: sdpa: transformers runs {model_class.__name__} without SDPA; use "
                              f"auto (which picks eager for it) or eager")  # fmt: skip
    if attention == "auto":
        check_auto_attention(recipe)
    if attention != "flash_attention_2":
        return
    import torch

    if not flash_attention.installed():
        raise RecipeError("model.attention: flash_attention_2 needs the flash-attn package (pip install "
                          "'ntl_pretrain[flash]' on a CUDA machine); use auto or sdpa")  # fmt: skip
    if not torch.cuda.is_available():
        raise RecipeError("model.attention: flash_attention_2 runs on CUDA GPUs and this machine has none visible; "
                          "use auto or sdpa")  # fmt: skip
    error = flash_attention.import_error_in_child()
    if error is not None:
        raise RecipeError(f"model.attention: flash_attention_2: flash-attn is installed but does not import: {error}; "
                          f"install a build for torch {torch.__version__} (CUDA {torch.version.cuda}), or use auto "
                          f"or sdpa")  # fmt: skip
    if recipe.data.per_document_attention and not transformers_takes_varlen_arguments():
        import transformers

        raise RecipeError(f"data.per_document_attention: flash_attention_2 keeps attention inside documents only "
                          f"through the varlen arguments, which transformers {transformers.__version__} does not "
                          f"take; use model.attention: sdpa, or a newer transformers")  # fmt: skip


def check_auto_attention(recipe: Recipe) -> None:
    """`auto` on a GPU with flash-attn installed would pick it: import it once here, in a child process, and when it
    does not import say why and tell the ranks to use SDPA (`flash_attention.UNAVAILABLE`), instead of every rank
    crashing at model build."""
    import torch

    bf16_on_gpu = recipe.train.device != "cpu" and recipe.train.precision == "bf16" and torch.cuda.is_available()
    if not bf16_on_gpu or not flash_attention.installed():
        return
    error = flash_attention.import_error_in_child()
    if error is not None:
        os.environ[flash_attention.UNAVAILABLE] = error  # the ranks' environment is copied from this one
        print(f"ntl-pretrain: model.attention: auto: flash-attn is installed but does not import ({error}); the "
              f"ranks use sdpa", file=sys.stderr, flush=True)  # fmt: skip


def check_optional_packages(recipe: Recipe) -> None:
    """The extras a recipe asks for, found before launch: without wandb every rank failed at its first log, minutes
    in. (flash-attn: `check_attention`; zstandard and datasets, for `.zst` and parquet/arrow/hub sources, are
    dependencies of the package itself.)"""
    setting = recipe.logging.wandb
    if setting is not False and not installed("wandb"):
        raise RecipeError(f"logging.wandb: {str(setting).lower()} needs the wandb package, which is not installed: pip "
                          f"install 'ntl_pretrain[wandb]' (or set logging.wandb=false)")  # fmt: skip
    if setting is True:
        check_wandb_can_log()


def check_wandb_can_log() -> None:
    """`logging.wandb: true` logs online unless WANDB_MODE says otherwise: without an API key, or without a route
    to the server, `wandb.init` failed minutes in, after the model had loaded."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES:
        return
    server = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    address = urllib.parse.urlparse(server)
    host, port = address.hostname or server, address.port or (80 if address.scheme == "http" else 443)
    if not os.environ.get("WANDB_API_KEY") and not netrc_has(host):
        raise RecipeError(f"logging.wandb: true, but W&B has no API key here (WANDB_API_KEY, or `wandb login`'s "
                          f"entry for {host} in ~/.netrc) and WANDB_MODE is not offline or disabled; log in, or set "
                          f"logging.wandb: offline (logs in <output_dir>/wandb, `wandb sync` later) or "
                          f"false")  # fmt: skip
    try:
        socket.create_connection((host, port), timeout=WANDB_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise RecipeError(f"logging.wandb: true, but the W&B server {server} cannot be reached from here ({error}); "
                          f"set logging.wandb: offline (logs in <output_dir>/wandb, `wandb sync` later) or "
                          f"false") from error  # fmt: skip


def netrc_has(host: str) -> bool:
    """Whether the netrc file (NETRC, else ~/.netrc) holds a password for `host`: where `wandb login` keeps the key."""
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return entry is not None and bool(entry[2])


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_device(device: str) -> None:
    """A recipe that asks for GPUs gets them, or stops: never CPU ranks by accident (DS_ACCELERATOR=cpu is a choice)."""
    if device != "cuda" or os.environ.get("DS_ACCELERATOR") == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else f"torch {torch.__version__}"
        raise RecipeError(f"train.device: cuda, but no CUDA GPU is visible on this machine ({why}); run it on a GPU "
                          f"node, or set train.device=cpu (or DS_ACCELERATOR=cpu) to train on CPU ranks")  # fmt: skip


def check_loss_backend(recipe: Recipe) -> None:
    """`loss.backend: triton` runs Triton kernels on the ranks' GPUs: refused where the ranks run on CPU (unless
    TRITON_INTERPRET=1 asks for Triton's interpreter) or the triton package does not import."""
    if recipe.loss.backend != "triton":
        return
    import torch

    from ntl_pretrain.loss.backend import interpreter_asked, why_triton_cannot_run

    device = recipe.train.device
    on_cpu = device == "cpu" or os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    reason = why_triton_cannot_run("cpu" if on_cpu else "cuda", interpreted=interpreter_asked())
    if reason is not None:
        raise RecipeError(f"loss.backend: triton cannot run here: {reason} (train.device: {device}); use auto or "
                          f"torch")  # fmt: skip


def check_positions(recipe: Recipe) -> None:
    """`data.seq_len` fits the model's learned/rotary positions, unless rope scaling extends them, and so does a
    prompt plus `eval.max_new_tokens` when the run evaluates generation."""
    built = model_config(recipe)
    if built is None:
        return
    for key, limit in position_limits(built.to_dict()).items():
        if limit < 1:
            raise RecipeError(f"model.config.{key}: must be >= 1 positions, got {limit}")
        if recipe.data.seq_len > limit:
            raise RecipeError(
                f"data.seq_len: {recipe.data.seq_len} tokens exceed the model's {key} ({limit}); raise "
                f"model.config.{key} or shorten data.seq_len"
            )
        if recipe.eval.every_steps is not None and recipe.eval.max_new_tokens >= limit:
            raise RecipeError(f"eval.max_new_tokens: {recipe.eval.max_new_tokens} new tokens leave no room for a "
                              f"prompt in the model's {key} ({limit}); lower eval.max_new_tokens")  # fmt: skip


def model_config(recipe: Recipe):
    """The HF config the run will build (`init_from`'s with `model.config` on top, or `model_type`'s); None when it
    comes from the checkpoint a resume loads. transformers validates the values (`hidden_size: abc`)."""
    from transformers import AutoConfig

    check_given_sizes(recipe)
    try:
        if recipe.init_from is not None:
            key = "init_from"
            config = AutoConfig.from_pretrained(Path(recipe.init_from).expanduser(), **recipe.model.config)
        elif recipe.model.model_type is not None:
            key = "model.config"
            config = AutoConfig.for_model(recipe.model.model_type, **recipe.model.config)
        else:
            return None
    except Exception as error:  # transformers raises ValueError, TypeError, OSError and its own validation errors
        raise RecipeError(f"{key}: cannot build the model config: {' '.join(str(error).split())}") from error
    return config


def check_output_dir(output_dir: str) -> None:
    if not output_dir.strip():
        raise RecipeError("train.output_dir: empty; name the run's folder")
    folder = Path(output_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise RecipeError(f"train.output_dir: {folder} is a file, not a folder")
    existing = _nearest_existing(folder)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"train.output_dir: {folder} cannot be created or written ({existing} is not writable)")
    lock = run_lock.lock_path(folder)  # beside the folder: its parent must take a file too
    beside = _nearest_existing(lock.parent)
    if not os.access(beside, os.W_OK | os.X_OK):
        raise RecipeError(f"train.output_dir: the run's lock {lock} cannot be written ({beside} is not writable); "
                          f"choose a folder whose parent you can write to")  # fmt: skip


def _nearest_existing(path: Path) -> Path:
    return next(parent for parent in (path, *path.parents) if parent.exists())


def check_master_port(port: int | None) -> None:
    if port is None:
        return
    if not 1 <= port <= 65535:
        raise RecipeError(f"--master-port: {port} is not a port (1..65535)")
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError as error:
            raise RecipeError(f"--master-port: {port} is not free on this node ({error.strerror})") from error
