"""Whether flash-attention imports, found out once and without risking the process that asks.

A flash-attn wheel built for another torch or CUDA is found by `importlib.util.find_spec` and fails at import
(`ImportError: ... undefined symbol`), or kills the importing process outright. Choosing it because it is *found*
crashed every rank at model build. So:

- before launch (`preflight.world.check_attention`), the launching process imports it in a child process (a crash there
  is a message here); `model.attention: flash_attention_2` is refused with the import's error, and `auto` falls back
  to SDPA with one line saying why, and tells its ranks through `UNAVAILABLE` in their environment;
- in every process, `import_error()` imports it in-process, guarded, once (cached), unless `UNAVAILABLE` already
  says it does not import: what `model.build.attention_backend` asks before it picks flash_attention_2.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys

UNAVAILABLE = "NTL_FLASH_ATTENTION_UNAVAILABLE"
# What transformers' flash_attention_2 path imports from the package (the varlen kernel for packed documents).
IMPORT = "from flash_attn import flash_attn_func, flash_attn_varlen_func"
IMPORT_TIMEOUT_S = 300  # a first import may compile or load large CUDA libraries from a slow file system


def installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def import_error() -> str | None:
    """None when flash-attn imports in this process, else why not (the launcher's finding when it made one)."""
    if os.environ.get(UNAVAILABLE):
        return os.environ[UNAVAILABLE]
    if not installed():
        return "flash-attn is not installed"
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401 - as IMPORT
    except Exception as error:  # noqa: BLE001 - a broken wheel raises anything from ImportError to OSError
        return f"{type(error).__name__}: {error}"
    return None


def import_error_in_child() -> str | None:
    """`import_error`, found in a child process with this process's module path, so that an import that kills its
    process (a mismatched CUDA library) is reported rather than suffered. None when it imports."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    env.pop(UNAVAILABLE, None)
    try:
        done = subprocess.run([sys.executable, "-c", IMPORT], env=env, capture_output=True, text=True,
                              timeout=IMPORT_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the import did not finish in {IMPORT_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"the import killed its process ({signal.Signals(-done.returncode).name})"
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"the import exited with {done.returncode}"
