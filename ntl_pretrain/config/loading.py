"""Reading a recipe: YAML files, `base:` chains, dot-list overrides, and the typed, checked `Recipe`.

A recipe file may extend another with `base: <path>`; mappings merge key by key, everything else replaces.
Dot-list overrides (`loss.ntl.weight=0.5`, values parsed as YAML) apply last. A relative path in a recipe file,
`base:` included, is relative to that file's folder (a piped recipe's and an override's to the working directory),
and comes out of `load_recipe` absolute. Unknown keys, wrong types and contradictions raise `RecipeError` naming
the key and the file (or command-line override) that set it, before any process group starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import select
import stat
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic
import yaml

from ntl_pretrain.config.recipe import Recipe, RecipeError, TrainConfig

OVERRIDE_ORIGIN = "command-line override"
# Every count in a recipe (steps, sizes, seeds) is exact in float64 (JSON readers of metrics.jsonl) and fits int64
# (torch's step counters): a larger one is a typo, and refused before it overflows mid-run.
MAX_RECIPE_INT = 2**53
MAX_YAML_BYTES = 1 << 20  # recipes are a few KB; the bound keeps a mistaken or hostile file from exhausting memory
PIPE_WAIT_S = 5.0  # a recipe pipe whose writer has not written by then never will, or is not a recipe's
# A pipe can be read once: its recipe, kept for the later loads in this process (the CLI reads it before torch is
# imported, and again with the DeepSpeed config).
_PIPED: dict[str, bytes] = {}


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Load, merge (`base:` chain, then overrides), type-check and validate a recipe. Every local path in it comes
    out absolute: a relative one is relative to the folder of the file that wrote it (the working directory for an
    override or a piped recipe; `_anchor_relative_paths`)."""
    return load_recipe_with_origins(path, overrides)[0]


def load_recipe_with_origins(path: str | Path, overrides: Iterable[str] = ()) -> tuple[Recipe, Origins]:
    """`load_recipe`, and where each key's value came from, for the checks made after it (the DeepSpeed JSON's)."""
    relative_output_dirs: dict[str, str] = {}
    raw, by_key = _load_yaml_chain(Path(path), (), relative_output_dirs)
    for item in overrides:
        key, value = _parse_override(item)
        _apply_override(raw, key, value, by_key)
    written_in = by_key.get("train.output_dir")
    if written_in in relative_output_dirs and isinstance(raw.get("train"), Mapping):  # else `_build` says why
        _check_output_dir_reading(raw["train"]["output_dir"], relative_output_dirs[written_in], written_in)
    _anchor_relative_paths(raw, Path.cwd())  # the overrides' paths (the files' are absolute by now)
    _anchor_default_output_dir(raw, _anchor_folder(Path(path).expanduser()))
    origins = Origins(by_key, str(path))
    return _build(Recipe, raw, (), origins), origins


def dump_recipe(recipe: Recipe) -> str:
    """YAML text that `load_recipe` turns back into an equal recipe."""
    return yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False)


def _load_yaml_chain(path: Path, seen: tuple[Path, ...], relative_output_dirs: dict[str, str]
                     ) -> tuple[dict, dict[str, str]]:  # fmt: skip
    """The merged recipe of `path` and its `base:` chain, and which file set each key; `relative_output_dirs` is
    given the `train.output_dir` each file wrote as a relative path (`_check_output_dir_reading`)."""
    path = path.expanduser()
    # A pipe's /dev/fd/N resolves to a name that does not exist.
    path, folder = (path.absolute() if is_pipe(path) else path.resolve()), _anchor_folder(path)
    if path in seen:
        raise RecipeError(f"{path}: base: inheritance cycle through {[str(p) for p in seen]}")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping, got {type(raw).__name__}")
    if not raw:
        raise RecipeError(f"{path}: empty recipe; start from one in recipes/ (e.g. base: tiny-cpu.yaml, then the keys "
                          f"to change)")  # fmt: skip
    output_dir = raw["train"].get("output_dir") if isinstance(raw.get("train"), dict) else None
    if _is_relative_local(output_dir):
        relative_output_dirs[str(path)] = output_dir
    _anchor_relative_paths(raw, folder)
    base = raw.pop("base", None)
    merged, origins = ({}, {}) if base is None else _load_yaml_chain(_base_path(path, folder, base), seen + (path,),
                                                                     relative_output_dirs)  # fmt: skip
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
    data = _recipe_bytes(path)
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
        raise RecipeError(f"{path}: invalid YAML {_yaml_problem(error)}") from error


def _recipe_bytes(path: Path) -> bytes:
    """A recipe file's bytes (at most one more than `MAX_YAML_BYTES`), or a pipe's (process substitution,
    `<(...)`): read once, and kept for the later reads of the same path in this process. A pipe no program writes
    to is refused after `PIPE_WAIT_S`, anything else that is not a file at once: a plain open would wait forever."""
    if str(path) in _PIPED:
        return _PIPED[str(path)]
    try:
        mode = path.stat().st_mode
        if stat.S_ISFIFO(mode):
            _PIPED[str(path)] = _read_pipe(path)
            return _PIPED[str(path)]
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise RecipeError(f"{path}: {what}; name a recipe file (or a pipe that a program writes one into)")
        with path.open("rb") as file:
            return file.read(MAX_YAML_BYTES + 1)
    except OSError as error:
        raise RecipeError(f"{path}: cannot read recipe: {error.strerror or error}") from error


def _read_pipe(path: Path) -> bytes:
    handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no writer yet: the open returns, a read finds nothing
    try:
        waiting = select.poll()
        waiting.register(handle, select.POLLIN)
        if not waiting.poll(PIPE_WAIT_S * 1000):
            raise RecipeError(f"{path}: a pipe that no program writes to (waited {PIPE_WAIT_S:g} s); name a recipe "
                              f"file, or start the program that writes it")  # fmt: skip
        os.set_blocking(handle, True)  # a writer is there: read to its end
        chunks, size = [], 0
        while size <= MAX_YAML_BYTES and (chunk := os.read(handle, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(handle)


STDIN = "/dev/stdin"


def read_stdin_recipe() -> str:
    """`train -`: the recipe on stdin (a pipe, a here-document, a redirected file), read once and from then on a
    piped recipe like `<(...)`, whatever stdin is: its relative paths are the working directory's and the ranks get
    it resolved, from a file. Its name in messages and its key among the piped recipes is `/dev/stdin`."""
    if sys.stdin is None or sys.stdin.isatty():
        raise RecipeError("-: stdin is a terminal, not a recipe; pipe one in (cat my.yaml | ntl-pretrain train -) "
                          "or name the recipe file")  # fmt: skip
    _PIPED[STDIN] = sys.stdin.buffer.read(MAX_YAML_BYTES + 1)
    return STDIN


def is_pipe(path: str | Path) -> bool:
    """A named pipe, a process substitution's `/dev/fd/N`, or stdin once read as a recipe (`read_stdin_recipe`)."""
    if str(path) in _PIPED:
        return True
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _yaml_problem(error: yaml.YAMLError) -> str:
    """`at line L, column C: <problem> (<context> at line ...)` from PyYAML's error, whose own text names the input
    `"<unicode string>"` (it was given text, not the file)."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"({_one_line(error)})"
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    where = f" at line {context_mark.line + 1}, column {context_mark.column + 1}" if context_mark else ""
    return f"at line {mark.line + 1}, column {mark.column + 1}: {error.problem}" + (
        f" ({context}{where})" if context else "")  # fmt: skip


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _base_path(path: Path, folder: Path, base: object) -> Path:
    """`base:` is a non-empty path string, relative to `folder` (the recipe's; `_anchor_folder`); `~` is expanded."""
    if not isinstance(base, str) or not base.strip():
        raise RecipeError(f"{path}: base: expected a path to one recipe file, got {base!r}")
    target = (folder / Path(base).expanduser()).resolve()
    if not target.is_file():
        what = "is a folder, not a recipe file" if target.is_dir() else "does not exist"
        raise RecipeError(f"{path}: base: {target} {what}")
    return target


def _anchor_folder(path: Path) -> Path:
    """What a recipe file's relative paths are relative to: its folder; for a pipe (`<(...)`, a FIFO), which is no
    file of a folder, the working directory, as for the paths on the command line that names it."""
    return Path.cwd() if is_pipe(path) else path.resolve().parent


def _anchor_relative_paths(raw: dict, directory: Path) -> None:
    """Every path a recipe file names by a relative path is relative to `directory`, the file's folder, wherever
    the command runs and whichever recipe extends it (docs/recipes.md, "Paths"): what the run reads (the DeepSpeed
    JSON, the tokenizer, `init_from`, the files of the data and eval sources; not a hub dataset's name) and what it
    writes and resumes (`train.output_dir`, a `train.resume` folder). `base:` is anchored alike (`_base_path`)."""
    for section, key in (("deepspeed", "config"), ("tokenizer", "path"), ("train", "output_dir")):
        if isinstance(raw.get(section), dict):
            _anchor(raw[section], key, directory)
    if isinstance(raw.get("train"), dict) and raw["train"].get("resume") != "auto":
        _anchor(raw["train"], "resume", directory)
    _anchor(raw, "init_from", directory)
    for section, lists in (("data", ("sources", "validation")), ("eval", ("qa_sets", "validation"))):
        for name in lists:
            items = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
            for item in items if isinstance(items, list) else ():
                if isinstance(item, dict) and item.get("format") != "hub":
                    _anchor(item, "path", directory)


def _anchor(mapping: dict, key: str, directory: Path) -> None:
    """`mapping[key]`, a relative local path, made absolute against `directory`; `pkg:`, `~`, absolute paths and
    URLs (`s3://`) are left as they are."""
    if _is_relative_local(mapping.get(key)):
        mapping[key] = str((directory / mapping[key]).resolve())


def _is_relative_local(value: object) -> bool:
    """A relative path on this machine (not `pkg:`, `~`, absolute or a URL such as `s3://`)."""
    if not isinstance(value, str) or not value or value.startswith(("pkg:", "~")) or "://" in value:
        return False
    return not Path(value).is_absolute()


def _anchor_default_output_dir(raw: dict, directory: Path) -> None:
    """A recipe that names no `train.output_dir` writes into the default folder beside its top file."""
    train = raw.setdefault("train", {})
    if isinstance(train, dict) and "output_dir" not in train:
        train["output_dir"] = str(directory / TrainConfig.output_dir)


def _check_output_dir_reading(anchored: str, written: str, path: str) -> None:
    """`train.output_dir: <written>` (relative) in the recipe file `path` was the working directory's until issue
    59; now it is `anchored`, beside the file. Where the old reading holds a run and the new one does not, the run
    would silently start afresh elsewhere: refused, naming both folders, so that the writer says which is meant."""
    mine, before = Path(anchored), (Path.cwd() / written).resolve()
    if mine != before and _holds_a_run(before) and not _holds_a_run(mine):
        raise RecipeError(f"{path}: train.output_dir: {written} is {mine} (paths in a recipe are relative to its "
                          f"folder), not the run in {before}; write {before} to continue that run, or {mine} to "
                          f"start this one there")  # fmt: skip


def _holds_a_run(folder: Path) -> bool:
    return (folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()


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
        problem = _yaml_problem(error) if isinstance(error, yaml.YAMLError) else f"({_one_line(error)})"
        raise RecipeError(f"{OVERRIDE_ORIGIN}: {key}: value {text!r} is not valid YAML {problem}") from error
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
class Origins:
    """Where each key of a recipe came from: the file that set it, or the command-line override."""

    by_key: dict[str, str]
    default: str
    """The recipe file named on the command line: where a key no file set (a default) is looked for."""

    def blamed(self, error: RecipeError, file_key: str = "deepspeed.config") -> RecipeError:
        """A refusal made after loading, with where its value came from first. Like a section's `check()`, it names
        the recipe key it is about first (`train.compile: ...`); one that names a file instead is about a value in
        the file that `file_key` names (the DeepSpeed JSON's own keys), so that key and its origin come first."""
        message = str(error)
        named = message.split(":", 1)[0].strip()
        if not _is_recipe_key(named):
            named, message = file_key, f"{file_key}: {message}"
        return RecipeError(f"{self.of(tuple(named.split('.')))}: {message}")

    def overridden(self, error: RecipeError) -> RecipeError:
        """A refusal made after loading (the checks before launch) about a key a command-line override set, with
        that origin first as the loader's own refusals have it (`command-line override: train.output_dir: ...`);
        any other refusal as it is."""
        named = str(error).split(":", 1)[0].strip()
        if not _is_recipe_key(named) or self.of(tuple(named.split("."))) != OVERRIDE_ORIGIN:
            return error
        return type(error)(f"{OVERRIDE_ORIGIN}: {error}")

    def of(self, key_path: tuple[str, ...]) -> str:
        inside = ".".join(key_path) + "."
        if key_path and any(key.startswith(inside) and by == OVERRIDE_ORIGIN for key, by in self.by_key.items()):
            return OVERRIDE_ORIGIN  # an override changed an item inside it (`optimizer.betas.0=1.5`)
        for end in range(len(key_path), 0, -1):
            origin = self.by_key.get(".".join(key_path[:end]))
            if origin is not None:
                return origin
        return self.default


def _build(cls: type, raw: object, key_path: tuple[str, ...], origins: Origins):
    where = ".".join(key_path) or "<recipe>"
    if raw is None:  # `train:` with nothing under it, or the override `train=null`
        raise RecipeError(f"{origins.of(key_path)}: {where}: an empty section; give its keys, or leave it out for "
                          f"its defaults")  # fmt: skip
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


def _run_check(obj: object, key_path: tuple[str, ...], origins: Origins) -> None:
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


def _coerce(hint: object, value: object, key_path: tuple[str, ...], origins: Origins) -> object:
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
    if _near_choice(hint, value):
        return _type_error(hint, value, key_path, origins)
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


def _is_recipe_key(dotted: str) -> bool:
    """Whether `dotted` names a key of the recipe's schema (`train.compile`, `data.sources.0.path`,
    `model.config.hidden_size`)."""
    hint: object = Recipe
    for part in dotted.split("."):
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `list[int] | None`: the list
            hint = next((arg for arg in typing.get_args(hint) if typing.get_origin(arg) in (list, dict)), None)
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
            if hint is None:
                return False
        elif origin is list and part.isdigit():
            hint = typing.get_args(hint)[0]
        elif origin is dict:
            hint = typing.get_args(hint)[1]
        else:
            return False
    return True


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


def _near_choice(hint: object, value: object) -> bool:
    """`true` or `2.0` for a key whose choices are the numbers 1, 2, 3: equal to a choice (True == 1, 2.0 == 2) but
    not of its type, which pydantic's Literal check lets through even in strict mode (so `zero_stage: true` would
    train at stage 1)."""
    equal = [choice for choice in _literal_values(hint) if choice == value]
    return bool(equal) and all(type(choice) is not type(value) for choice in equal)


def _choices(hint: object) -> list[str]:
    """The string values a Literal field (also inside `... | None`) allows; empty for any other type."""
    return [value for value in _literal_values(hint) if isinstance(value, str)]


def _literal_values(hint: object) -> list[object]:
    """Every value a Literal field (also inside `... | None`) allows; empty for any other type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType):
        return [value for arg in args for value in _literal_values(arg)]
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
        listed = any(typing.get_origin(arg) is Literal for arg in args)
        return f"{names} (or null)" if listed else f"{names} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
