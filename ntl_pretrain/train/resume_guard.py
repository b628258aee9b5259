"""Refuse, before anything is loaded, a run that cannot do what its recipe says.

- **One recipe across nodes** (`check_same_recipe`): every rank hashes its resolved recipe and one all-gather of
  the hashes compares them; a difference names each differing key and the node ranks holding each value.
- **Resume fingerprint** (`check_resume`): the checkpoint must have been trained with the model, tokenizer,
  vocabulary-parallel layout, ZeRO stage, number vocabulary and data sources this recipe describes. The model is
  compared as the HF config this recipe builds against the checkpoint's `hf_config/` (so `model.*` and
  `init_from`'s config are both covered), the tokenizer by its content (not its path), data sources by name →
  files (size and a digest of each file's first and last MiB), template and text field; and what the data stream
  continues from: `seed`, `data.seq_len` and the sequences per optimizer step.
- **Learning rate on resume** (`apply_recipe_learning_rate`): the checkpoint's scheduler state carries the old peak
  rate; the recipe's is applied from the resumed step on, and the change is logged.

A refusal is a `RunRefused` (a `RecipeError`: exit code 2), the same on every rank, in one line of at most
`MAX_LINE_CHARS`. `ntl-pretrain train` runs the same comparisons before launch (`preflight/start.py`), so that a
refusal costs no start-up and `--dry-run` sees it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from ntl_pretrain import heads
from ntl_pretrain.checkpoint import store as checkpoint
from ntl_pretrain.config.loading import dump_recipe, read_yaml_file
from ntl_pretrain.config.recipe import Recipe, RecipeError
from ntl_pretrain.data.files import is_remote, resolve_files
from ntl_pretrain.data.source_config import SourceConfig

DATA_FINGERPRINT = "data_sources.json"  # inside a checkpoint step folder
EDGE_BYTES = 1 << 20  # a source file's identity: its size and a digest of its first and last MiB
# HF config keys that say how a model runs or was saved, not what it is.
RUNTIME_CONFIG_KEYS = {"use_cache", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "architectures",
                       "_attn_implementation", "_attn_implementation_autoset", "attn_implementation"}  # fmt: skip
WAYS_OUT = "keep that recipe or use another train.output_dir"
# A refusal is one line a terminal shows whole, 300 characters with what `ntl-pretrain train` prints before it.
MAX_LINE_CHARS = 300 - len("ntl-pretrain train: recipe error: ")
MAX_FOLDER_CHARS = 60
logger = logging.getLogger(__name__)


class RunRefused(RecipeError):
    """The run cannot do what its recipe says; raised alike on every rank."""


@dataclass(frozen=True)
class Difference:
    key: str
    saved: object
    wanted: object

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.saved)} → {_show(self.wanted)}"


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, (str, list, dict)) or value is None else str(value)


# ---- one recipe across nodes -----------------------------------------------------------------------------------


def check_same_recipe(recipe: Recipe) -> None:
    """One all-gather of every rank's recipe hash; on a difference a second one of the recipes names the keys."""
    text = dump_recipe(recipe)
    mine = (xxhash.xxh3_64_hexdigest(text.encode()), _node_start())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if len({digest for digest, _ in gathered}) == 1:
        return
    recipes = [None] * dist.get_world_size()
    dist.all_gather_object(recipes, flatten(dataclasses.asdict(recipe)))
    nodes = sorted({start for _, start in gathered})
    node_of = [nodes.index(start) for _, start in gathered]
    keys = _differing_keys(recipes)
    lines = [_holders(key, recipes, node_of) for key in keys]
    head = "the ranks were started with different recipes (every node must run the same recipe and overrides): "
    raise RunRefused(fitted_line(head, lines, keys, ""))


def _node_start() -> int:
    """The global rank of this node's first process: it tells nodes apart (also several on one host)."""
    return int(os.environ.get("RANK", dist.get_rank())) - int(os.environ.get("LOCAL_RANK", 0))


def _differing_keys(recipes: list[dict]) -> list[str]:
    keys = sorted({key for flat in recipes for key in flat})
    return [key for key in keys if len({_show(flat.get(key)) for flat in recipes}) > 1]


def _holders(key: str, recipes: list[dict], node_of: list[int]) -> str:
    by_value: dict[str, list[int]] = {}
    for rank, flat in enumerate(recipes):
        nodes = by_value.setdefault(_show(flat.get(key)), [])
        if node_of[rank] not in nodes:
            nodes.append(node_of[rank])
    held = [f"{value} on node rank{'s' if len(n) > 1 else ''} {','.join(map(str, n))}" for value, n in by_value.items()]
    return f"{key}: " + " | ".join(held)


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """Dotted keys of nested mappings and lists of mappings (`data.sources.0.path`) → leaf values."""
    if isinstance(tree, dict) and tree:
        children = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(item, dict) for item in tree):
        children = enumerate(tree)
    else:
        return {prefix: tree}
    flat: dict[str, object] = {}
    for key, value in children:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


# ---- resume fingerprint ----------------------------------------------------------------------------------------


def check_resume(folder: Path | None, recipe: Recipe, tokenizer, global_batch: int) -> None:
    """Refuse (every rank alike) to resume `folder` with a recipe that describes another model, tokenizer,
    vocabulary-parallel layout (`loss.vocab_parallel_size`, and for k > 1 the world size), ZeRO stage, number
    vocabulary, data, or data stream (`seed`, `data.seq_len`, `global_batch` sequences per step); reads only small
    files of the checkpoint."""
    if folder is None:
        return
    found = resume_differences(folder, recipe, tokenizer, global_batch)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(str(difference), difference.key) for difference in found])
    refuse_differences(folder, sorted({pair for rank_pairs in gathered for pair in rank_pairs}))
    check_head_layout(folder, recipe, dist.get_world_size())


def resume_differences(folder: Path, recipe: Recipe, tokenizer, global_batch: int) -> list[Difference]:
    """What `check_resume` compares, on this process alone (the pre-flight check of `ntl-pretrain train`)."""
    saved_recipe = read_yaml_file(folder / "recipe.yaml") if (folder / "recipe.yaml").is_file() else {}
    saved_recipe = saved_recipe or {}
    return [
        *model_differences(folder, recipe, tokenizer),
        *tokenizer_differences(folder, tokenizer, recipe.tokenizer.trust_remote_code),
        *layout_differences(saved_recipe, recipe),
        *data_differences(folder, saved_recipe, recipe),
        *stream_differences(folder, saved_recipe, recipe, global_batch),
    ]


def refuse_differences(folder: Path, found: list[tuple[str, str]]) -> None:
    """`RunRefused` naming the (difference, key) pairs `found`, as many as one line holds; nothing when empty. A
    long folder path is shortened to its last three parts: the differences are what the line is for."""
    if found:
        where = str(folder) if len(str(folder)) <= MAX_FOLDER_CHARS else "…/" + "/".join(folder.parts[-3:])
        head = f"train.resume: {where} holds a run of another recipe (saved → now): "
        raise RunRefused(fitted_line(head, [line for line, _ in found], [key for _, key in found], f"; {WAYS_OUT}"))


def check_head_layout(folder: Path, recipe: Recipe, world_size: int) -> None:
    """Output-layer slices also need the world size that wrote them."""
    try:
        heads.check_resume(folder, recipe, world_size)
    except ValueError as error:
        raise RunRefused(str(error)) from None


def fitted_line(head: str, items: list[str], keys: list[str], tail: str, limit: int = MAX_LINE_CHARS) -> str:
    """`head`, the `items` joined by "; ", `tail`, in at most `limit` characters where the rest allows: the items
    that fit whole, then the keys of the others, then how many more."""
    room = limit - len(head) - len(tail)
    shown = []
    for index, item in enumerate(items):
        rest = len(items) - index - 1
        more = f" (+{rest} more)" if rest else ""
        if len("; ".join([*shown, item]) + more) > room:
            if shown:
                return head + "; ".join(shown) + _more(keys[index:], room - len("; ".join(shown))) + tail
            item = _clipped(item, room - len(more))  # the first alone is too long: cut it, never the tail
        shown.append(item)
    return head + "; ".join(shown) + tail


def _clipped(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _more(keys: list[str], room: int) -> str:
    """` (+N more: key, key, ...)`, with the keys that fit in `room` characters."""
    named: list[str] = []
    for index, key in enumerate(keys):
        unnamed = ", ..." if index < len(keys) - 1 else ""
        if len(f" (+{len(keys)} more: {', '.join([*named, key])}{unnamed})") > room:
            break
        named.append(key)
    listed = ", ".join(named) + (", ..." if len(named) < len(keys) else "")
    return f" (+{len(keys)} more: {listed})" if named else f" (+{len(keys)} more)"


def model_differences(folder: Path, recipe: Recipe, tokenizer) -> list[Difference]:
    """The HF config this recipe builds against the checkpoint's, key by key (keys in both)."""
    from ntl_pretrain.model.build import hf_config

    saved_path = folder / checkpoint.HF_CONFIG / "config.json"
    if not saved_path.is_file():
        return []
    saved = json.loads(saved_path.read_text())
    wanted = hf_config(recipe, tokenizer, folder / checkpoint.HF_CONFIG).to_dict()
    shared = sorted((set(saved) & set(wanted)) - RUNTIME_CONFIG_KEYS)
    return [Difference(f"model.config.{key}", saved[key], wanted[key]) for key in shared if saved[key] != wanted[key]]


def tokenizer_identity(tokenizer) -> str:
    """Length and a digest of the tokenizer's content (for a fast tokenizer its whole canonical serialisation:
    vocabulary, merges, normaliser, special tokens), whatever files or path it came from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = json.dumps(json.loads(backend.to_str()), sort_keys=True)
    else:
        content = json.dumps(sorted(tokenizer.get_vocab().items()))
    return f"{len(tokenizer)} tokens, xxh3 {xxhash.xxh3_64_hexdigest(content.encode())}"


def tokenizer_differences(folder: Path, tokenizer, trust_remote_code: bool = False) -> list[Difference]:
    from ntl_pretrain.tokenizer import load_tokenizer

    saved_folder = folder / checkpoint.TOKENIZER
    if not saved_folder.is_dir():
        return []
    saved = tokenizer_identity(load_tokenizer(str(saved_folder), trust_remote_code=trust_remote_code))
    wanted = tokenizer_identity(tokenizer)
    return [] if saved == wanted else [Difference("tokenizer (content of its files)", saved, wanted)]


def layout_differences(saved_recipe: dict, recipe: Recipe) -> list[Difference]:
    """`loss.vocab_parallel_size`, the ZeRO stage (whose optimizer shards DeepSpeed loads only into the same stage)
    and what decides the number vocabulary: whether NTL (and so number classes) is on. The number tokens themselves
    follow from the tokenizer and `vocab_size`, compared above."""
    saved_loss = saved_recipe.get("loss", {})
    found = []
    saved_k = saved_loss.get("vocab_parallel_size", 1)
    if saved_k != recipe.loss.vocab_parallel_size:
        found.append(Difference("loss.vocab_parallel_size", saved_k, recipe.loss.vocab_parallel_size))
    saved_kind = (saved_loss.get("ntl") or {}).get("kind", "was")
    if (saved_kind is not None) != (recipe.loss.ntl.kind is not None):
        found.append(Difference("loss.ntl.kind (the number vocabulary)", saved_kind, recipe.loss.ntl.kind))
    # Checkpoints from before the stage was a recipe key were written at ZeRO-3, the only stage then.
    saved_stage = (saved_recipe.get("deepspeed") or {}).get("zero_stage") or 3
    if recipe.deepspeed.zero_stage is not None and saved_stage != recipe.deepspeed.zero_stage:
        found.append(Difference("deepspeed.zero_stage (the optimizer shards' layout)", saved_stage,
                                recipe.deepspeed.zero_stage))  # fmt: skip
    return found


# ---- data stream -----------------------------------------------------------------------------------------------


def stream_differences(folder: Path, saved_recipe: dict, recipe: Recipe, global_batch: int) -> list[Difference]:
    """What the run continues from the checkpoint and so cannot change: the shuffle and random states (`seed`),
    the packed blocks (`data.seq_len`) and the sequences per optimizer step (the global batch: each rank's stream
    would continue, but the steps would hold other data than the recipe says)."""
    saved = flatten(saved_recipe)
    found = [Difference(key, saved[key], wanted) for key, wanted in (("seed", recipe.seed),
             ("data.seq_len", recipe.data.seq_len)) if key in saved and saved[key] != wanted]  # fmt: skip
    saved_batch = saved_global_batch(folder)
    if saved_batch is not None and saved_batch != global_batch:
        found.append(Difference("train.global_batch_size (sequences per step)", saved_batch, global_batch))
    return found


def saved_global_batch(folder: Path) -> int | None:
    """Sequences per optimizer step of the run that saved `folder`, from rank 0's data-loader state (None for a
    checkpoint saved before per-rank state files)."""
    path = folder / checkpoint.RANK_STATE / "rank_00000.pt"
    if not path.is_file():
        return None
    data = torch.load(path, map_location="cpu", weights_only=True)["data"]
    return data.get("global_rows") or data["dp_world_size"] * data["micro_batch_size"] * data["grad_accum"]


# ---- data sources ----------------------------------------------------------------------------------------------


def data_fingerprint(recipe: Recipe) -> dict[str, dict]:
    """Training source name → what makes its documents: files (path, size, edge digest), template, text field, and
    which labels carry which loss where that is not every label for both (`label_roles`): the shuffle buffer and
    packer in the checkpoint hold tokens marked with the roles they were read with (data/packing.py)."""
    return {source.label: _source_fingerprint(source) for source in recipe.data.sources}


def _source_fingerprint(source: SourceConfig) -> dict:
    remote = source.format == "hub" or is_remote(source.path)
    files = [{"path": source.path}] if remote else [_file_identity(Path(file)) for file in resolve_files(source)]
    return {"files": files, "template": source.template, "text_field": source.text_field, **_label_roles(source)}


def _label_roles(source: SourceConfig) -> dict:
    """Absent for the default (all labels carry both losses), so checkpoints written before these keys compare."""
    if not source.answer_only:
        return {}
    return {"label_roles": {"answer": source.answer, "ce": source.ce_labels, "ntl": source.ntl_labels}}


def _file_identity(path: Path) -> dict:
    size = path.stat().st_size
    digest = xxhash.xxh3_64()
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            handle.seek(max(size - EDGE_BYTES, EDGE_BYTES))
            digest.update(handle.read())
    return {"path": str(path), "size": size, "edges_xxh3": digest.hexdigest()}


def write_data_fingerprint(folder: Path, recipe: Recipe) -> None:
    (folder / DATA_FINGERPRINT).write_text(json.dumps(data_fingerprint(recipe), indent=1))


def data_differences(folder: Path, saved_recipe: dict, recipe: Recipe) -> list[Difference]:
    """Against the checkpoint's `data_sources.json`; a checkpoint saved before it existed is compared by its
    recipe's source paths, templates and text fields."""
    path = folder / DATA_FINGERPRINT
    if path.is_file():
        saved, wanted = json.loads(path.read_text()), data_fingerprint(recipe)
    else:
        saved = {_label(raw): _recipe_source(raw) for raw in saved_recipe.get("data", {}).get("sources", [])}
        wanted = {source.label: _recipe_source(dataclasses.asdict(source)) for source in recipe.data.sources}
    found = []
    for name in sorted(set(saved) | set(wanted)):
        before, after = saved.get(name), wanted.get(name)
        if before is None or after is None:
            found.append(Difference(f"data.sources[{name}]", _present(before), _present(after)))
            continue
        for field in sorted(set(before) | set(after)):
            if _comparable(before.get(field)) != _comparable(after.get(field)):
                found.append(Difference(f"data.sources[{name}].{field}", before.get(field), after.get(field)))
    return found


def _label(raw: dict) -> str:
    known = {field.name for field in dataclasses.fields(SourceConfig)}
    return SourceConfig(**{key: value for key, value in raw.items() if key in known}).label


def _recipe_source(raw: dict) -> dict:
    known = {field.name for field in dataclasses.fields(SourceConfig)}
    roles = _label_roles(SourceConfig(**{key: value for key, value in raw.items() if key in known}))
    return {"files": [{"path": raw.get("path")}], "template": raw.get("template"), "text_field": raw.get("text_field"),
            **roles}  # fmt: skip


def _present(fingerprint: dict | None) -> str:
    return "absent" if fingerprint is None else "present"


def _comparable(value: object) -> object:
    """Files compare by size and content digest: the same corpus mounted elsewhere is the same source."""
    if isinstance(value, list):
        return [{key: item[key] for key in item if key != "path"} or item for item in value]
    return value


# ---- learning rate on resume -----------------------------------------------------------------------------------


def apply_recipe_learning_rate(schedulers: list, lr: float) -> float | None:
    """Make the recipe's `optimizer.lr` the peak of every resumed LambdaLR (its state carries the checkpoint's),
    from the resumed step on; `schedule.*` and `train.max_steps` need nothing: the multiplier is rebuilt from the
    recipe. Returns the checkpoint's peak when it differed, else None."""
    previous = None
    for scheduler in schedulers:
        if any(base != lr for base in scheduler.base_lrs):
            previous = scheduler.base_lrs[0]
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        rates = [lr * rule(scheduler.last_epoch) for rule in scheduler.lr_lambdas]
        for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"], group["initial_lr"] = rate, lr
        scheduler._last_lr = rates
    return previous


def schedule_changes(folder: Path, recipe: Recipe) -> list[Difference]:
    """`optimizer.lr`, `schedule.*` and `train.max_steps` of the recipe against the checkpoint's (for the log)."""
    path = folder / "recipe.yaml"
    if not path.is_file():
        return []
    saved = flatten(read_yaml_file(path) or {})
    wanted = flatten(dataclasses.asdict(recipe))
    keys = ["optimizer.lr", "train.max_steps", *sorted(key for key in wanted if key.startswith("schedule."))]
    return [Difference(key, saved[key], wanted[key]) for key in keys if key in saved and saved[key] != wanted[key]]
