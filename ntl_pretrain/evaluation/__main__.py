"""`python -m ntl_pretrain.evaluation TARGET ...` is `ntl-pretrain eval TARGET ...` (each rank of a launched
evaluation runs it)."""

import sys

from ntl_pretrain.cli import module_main

sys.exit(module_main("eval"))
