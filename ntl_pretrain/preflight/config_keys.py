"""Which `model.config` keys the model takes, so that a key it would ignore is refused before launch.

transformers keeps an unknown config key as a stray attribute that no layer reads (`n_embd` on a Llama): a typo
would silently train another model than the recipe says. A key counts as taken when any of these holds:
- the config class knows it: a default, an `__init__` parameter or an `attribute_map` alias;
- building the config with it changes another key (an older name transformers maps: `rope_scaling`);
- the family's modeling code reads it from the config (`getattr(config, "head_dim", hidden // heads)` in Qwen2,
  Qwen3-MoE and Llama: no default in the config class, yet it sizes the attention), found in the source of the
  causal-LM class's module and of the modeling modules it imports (another family's, the shared RoPE code);
- the model built on the meta device with it has other parameter shapes than without it (a read the source scan
  cannot see: one through `**kwargs`, or in a module the scan does not open).
A key none of these sees is refused with the closest keys the model does take.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import json
import re
import types
import typing
from pathlib import Path

from ntl_pretrain.config.recipe import Recipe, RecipeError

# `config.head_dim`, `self.config.head_dim`, `text_config.head_dim`; `getattr(config, "head_dim", ...)`, `hasattr`.
CONFIG_READ = re.compile(r"""config\.(\w+)|(?:getattr|hasattr)\(\s*[\w.]*config\s*,\s*["'](\w+)["']""")
# A family's module imports another's as `from ..llama.modeling_llama import`, the shared RoPE code as
# `from ...modeling_rope_utils import` (the rest of the shared modeling code reads every config's common keys only).
MODELING_IMPORT = re.compile(r"^from (\.\.\w+\.|\.\.\.)(modeling_\w+) import", re.MULTILINE)
SHARED_SHAPE_CODE = "modeling_rope_utils"


def check_whole_number_keys(recipe: Recipe) -> None:
    """A `model.config` key that the config class declares a whole number (`hidden_size: int`, `head_dim: int |
    None`) refuses `true` and `2.0`, as the recipe's own integer keys do, before the config is built: transformers
    refuses them too, but in a message of Python type names, and our size checks would first read `true` as 1."""
    config_class = _config_class(recipe)
    if config_class is None:
        return
    for key, value in recipe.model.config.items():
        if type(value) in (bool, float) and _declares_whole_number(config_class, key):
            raise RecipeError(f"model.config.{key}: expected int ({config_class.__name__}'s {key} is a whole number), "
                              f"got {value!r}")  # fmt: skip


def _config_class(recipe: Recipe) -> type | None:
    """The HF config class the run builds: `model.model_type`'s, or that of `init_from`'s config.json (None where
    it cannot be told yet: the config's own checks report why)."""
    from transformers import CONFIG_MAPPING

    model_type = recipe.model.model_type
    if model_type is None and recipe.init_from is not None:
        try:
            model_type = json.loads((Path(recipe.init_from).expanduser() / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object: model_config says so
            return None
    return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None


def _declares_whole_number(config_class: type, key: str) -> bool:
    """Whether the nearest annotation of `key` in the config class's hierarchy is `int` or `int | None`."""
    for klass in config_class.__mro__:
        hint = inspect.get_annotations(klass).get(key)
        if isinstance(hint, str):
            return hint.replace(" ", "") in ("int", "int|None", "Optional[int]")
        if hint is not None:
            members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            return set(members) - {type(None)} == {int}
    return False


def check_config_keys(recipe: Recipe, config) -> None:
    """`config`: the HF config the run will build (None when it comes from the checkpoint a resume loads)."""
    if config is None:
        return
    for key, value in recipe.model.config.items():
        if (why := why_ignored(config, key, value)) is not None:
            raise RecipeError(f"model.config.{key}: {why}")


def why_ignored(config, key: str, value) -> str | None:
    """None when the model built from `config` takes `key` (set to `value`); else why not, with the closest keys
    it does take."""
    config_class = type(config)
    try:
        defaults = config_class().to_dict()
    except Exception:  # a config class that cannot be built without arguments: transformers checked the values
        return None
    declared = {*defaults, *inspect.signature(config_class.__init__).parameters, *config_class.attribute_map}
    read = keys_the_modeling_code_reads(config_class)
    if key in declared or key in read or _changes_other_keys(config_class, key, value, defaults):
        return None
    if _changes_the_parameters(config, key):
        return None
    close = difflib.get_close_matches(key, sorted(declared | read), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{config_class.__name__} has no such key and the model's code reads none, so the model ignores it{hint}"


@functools.cache
def keys_the_modeling_code_reads(config_class: type) -> frozenset[str]:
    """Attribute names the modeling code of `config_class`'s causal LM reads from a config; empty for a config
    transformers has no causal LM of."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    except KeyError:
        return frozenset()
    source = inspect.getsource(importlib.import_module(model_class.__module__))
    for where, module in MODELING_IMPORT.findall(source):
        if where != "...":
            source += inspect.getsource(importlib.import_module(f"transformers.models.{where.strip('.')}.{module}"))
        elif module == SHARED_SHAPE_CODE:
            source += inspect.getsource(importlib.import_module(f"transformers.{module}"))
    return frozenset(attribute or named for attribute, named in CONFIG_READ.findall(source))


def _changes_other_keys(config_class, key: str, value, defaults: dict) -> bool:
    """Whether a key transformers still accepts under an older name (`rope_scaling` -> `rope_parameters`) takes
    effect: building the config with it changes some other key."""
    try:
        built = config_class(**{key: value}).to_dict()
    except Exception:
        return True  # the full config was built with it (model_config): let transformers be the judge
    return any(built.get(name) != default for name, default in defaults.items() if name != key)


def _changes_the_parameters(config, key: str) -> bool:
    """Whether the model built on the meta device (no memory) with `key` has other parameter shapes than without."""
    without = copy.deepcopy(config)
    try:
        delattr(without, key)
        return _parameter_shapes(config) != _parameter_shapes(without)
    except Exception:  # a build that fails either way is build_on_meta's to report; this check stays silent
        return True


def _parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
