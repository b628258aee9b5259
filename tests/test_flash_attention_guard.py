"""flash-attention is chosen when it imports, not when it is found: `auto` falls back to SDPA with a line saying
why (and tells its ranks), an explicit `flash_attention_2` is refused before launch with the import's error. A
stand-in `flash_attn` package on the module path plays a broken wheel, a crashing one and a working one; the GPU
that `auto` needs to consider flash-attention at all is stood in for by `torch.cuda.is_available`."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from helpers.launches import TINY
from transformers import LlamaConfig

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.model import flash_attention
from ntl_pretrain.model.build import attention_backend
from ntl_pretrain.preflight import world as preflight

PACKAGES = {
    "broken": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n",
    "crashing": "import os\nos.abort()\n",
    "working": "def flash_attn_func(*args, **kwargs): pass\ndef flash_attn_varlen_func(*args, **kwargs): pass\n",
}


@pytest.fixture
def flash_attn(tmp_path, monkeypatch):
    """`flash_attn(kind)` puts that stand-in first on the module path, on a machine that seems to have a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(flash_attention.UNAVAILABLE, raising=False)
    flash_attention.import_error.cache_clear()

    def install(kind: str) -> None:
        package = tmp_path / kind / "flash_attn"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(PACKAGES[kind])
        monkeypatch.syspath_prepend(str(tmp_path / kind))
        importlib.invalidate_caches()

    yield install
    sys.modules.pop("flash_attn", None)
    flash_attention.import_error.cache_clear()


def recipe(attention: str):
    return load_recipe(TINY, [f"model.attention={attention}", "train.precision=bf16", "train.device=cuda"])


def test_an_explicit_flash_attention_that_does_not_import_is_refused_with_its_error(flash_attn):
    flash_attn("broken")
    with pytest.raises(RecipeError, match="model.attention: flash_attention_2: flash-attn is installed but does not "
                       "import: ImportError: flash_attn_2_cuda.so: undefined symbol"):  # fmt: skip
        preflight.check_attention(recipe("flash_attention_2"))


def test_an_import_that_kills_its_process_is_reported_not_suffered(flash_attn):
    flash_attn("crashing")
    with pytest.raises(RecipeError, match=r"does not import: the import killed its process \(SIGABRT\)"):
        preflight.check_attention(recipe("flash_attention_2"))


@pytest.mark.parametrize("kind", ["broken", "crashing"])
def test_auto_falls_back_to_sdpa_and_says_why(flash_attn, kind, capsys, monkeypatch):
    flash_attn(kind)
    monkeypatch.setattr(flash_attention.os, "environ", dict(flash_attention.os.environ))  # the launcher's, restored
    preflight.check_attention(recipe("auto"))
    line = capsys.readouterr().err
    assert line.startswith("ntl-pretrain: model.attention: auto: flash-attn is installed but does not import (")
    assert line.rstrip().endswith("); the ranks use sdpa")
    # A rank started from this environment never imports it (a crashing import would end this test's process).
    assert flash_attention.os.environ[flash_attention.UNAVAILABLE]
    assert attention_backend("auto", LlamaConfig(), torch.bfloat16) == "sdpa"


def test_auto_picks_flash_attention_where_it_imports(flash_attn, capsys):
    flash_attn("working")
    preflight.check_attention(recipe("auto"))
    preflight.check_attention(recipe("flash_attention_2"))
    assert capsys.readouterr().err == ""
    assert attention_backend("auto", LlamaConfig(), torch.bfloat16) == "flash_attention_2"
    assert attention_backend("auto", LlamaConfig(), torch.float32) == "sdpa"  # no flash kernels in fp32
