"""`python -m ntl_pretrain.doctor` (every rank of `deepspeed --module ntl_pretrain.doctor`) is `ntl-pretrain doctor`."""

import sys

from ntl_pretrain.cli import module_main

code = module_main("doctor")
if "torch" not in sys.modules:  # `--help` or refused arguments: no process group was made, nothing to tear down
    sys.exit(code)

from ntl_pretrain.runtime.process_group import exit_without_finalising  # noqa: E402

exit_without_finalising(code)
