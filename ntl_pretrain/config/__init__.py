"""The recipe: its schema (`recipe`, imports no torch), reading it from YAML with overrides (`loading`), and the
DeepSpeed JSON it is combined with (`deepspeed`)."""

from ntl_pretrain.config.loading import dump_recipe, load_recipe
from ntl_pretrain.config.recipe import Recipe, RecipeError

__all__ = ["Recipe", "RecipeError", "dump_recipe", "load_recipe"]
