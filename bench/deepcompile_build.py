"""Build DeepSpeed's DeepCompile op on this machine, as `engine.compile()` would at ZeRO-3 with `train.compile`, and say
how long it took or why it failed (bench/gpu_first_run.py's deepcompile_build stage; docs/compatibility.md,
"DeepCompile"). Always exits 0: the JSON is the answer.

    python bench/deepcompile_build.py --out build.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ntl_pretrain.train.engine import first_error_line


def build() -> dict:
    """{"built": bool, "seconds": float, "error": the failure's first informative line or None}."""
    started = time.perf_counter()
    try:
        from deepspeed.ops.op_builder.dc import DeepCompileBuilder

        DeepCompileBuilder().load()
    except Exception as error:  # noqa: BLE001 - the failure is the answer
        return {"built": False, "seconds": time.perf_counter() - started, "error": first_error_line(error)}
    return {"built": True, "seconds": time.perf_counter() - started, "error": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(build(), indent=1) + "\n")


if __name__ == "__main__":
    main()
