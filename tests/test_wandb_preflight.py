"""W&B is checked before launch: `logging.wandb: true` without an API key, or with a server that cannot be reached,
is refused naming the key (it failed minutes in, after the model loaded); WANDB_MODE offline/disabled or
`logging.wandb: offline` need neither. A stand-in `wandb` package on the module path makes it "installed"."""

from __future__ import annotations

import importlib
import socket
from types import SimpleNamespace

import pytest
from helpers.launches import TINY

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.config.recipe import RecipeError
from ntl_pretrain.preflight import world as preflight
from ntl_pretrain.train.trainer import Trainer


@pytest.fixture
def wandb_installed(tmp_path, monkeypatch):
    (tmp_path / "site" / "wandb").mkdir(parents=True)
    (tmp_path / "site" / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` unless a test writes one
    return tmp_path / "netrc"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check(setting: str) -> None:
    preflight.check_optional_packages(load_recipe(TINY, [f"logging.wandb={setting}"]))


def test_wandb_without_a_key_or_a_server_is_refused_before_launch(wandb_installed, monkeypatch):
    with pytest.raises(RecipeError, match=r"logging.wandb: true, but W&B has no API key here \(WANDB_API_KEY"):
        check("true")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(RecipeError, match=r"logging.wandb: true, but the W&B server http://127.0.0.1:\d+ cannot be "
                       r"reached from here .*set logging.wandb: offline"):  # fmt: skip
        check("true")


def test_a_key_in_netrc_and_a_server_that_answers_pass(wandb_installed, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        wandb_installed.write_text(f"machine 127.0.0.1\n  login user\n  password {'0' * 40}\n")
        wandb_installed.chmod(0o600)
        check("true")


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_mode_offline_or_disabled_needs_no_key(wandb_installed, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    check("true")


def test_the_recipe_can_ask_for_offline_logging(wandb_installed, tmp_path):
    check("offline")  # no key, no WANDB_MODE
    recipe = load_recipe(TINY, ["logging.wandb=offline"])
    settings = Trainer._wandb_settings(SimpleNamespace(recipe=recipe, output_dir=tmp_path))
    assert settings["mode"] == "offline" and settings["dir"] == str(tmp_path)
    online = Trainer._wandb_settings(
        SimpleNamespace(recipe=load_recipe(TINY, ["logging.wandb=true"]), output_dir=tmp_path)
    )
    assert "mode" not in online


def test_without_the_package_the_refusal_names_the_setting(monkeypatch):
    monkeypatch.setattr(preflight, "installed", lambda package: False)
    with pytest.raises(RecipeError, match="logging.wandb: offline needs the wandb package"):
        check("offline")
    with pytest.raises(RecipeError, match="logging.wandb: true needs the wandb package"):
        check("true")
    with pytest.raises(RecipeError, match="logging.wandb: expected bool or one of 'offline', got 'online'"):
        check("online")
