"""`python -m ntl_pretrain.study`: the same as `ntl-pretrain study`."""

import sys

from ntl_pretrain.cli import module_main

sys.exit(module_main("study"))
