"""`python -m ntl_pretrain.study`: the same as `ntl-pretrain study`."""

import sys

from ntl_pretrain.study.commands import main

sys.exit(main())
