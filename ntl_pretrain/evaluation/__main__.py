"""`python -m ntl_pretrain.evaluation TARGET ...` is `ntl-pretrain eval TARGET ...`."""

import sys

from ntl_pretrain.evaluation.commands import main

sys.exit(main())
