"""`python -m ntl_pretrain.train RECIPE [key.path=value ...]`: one training rank (`train.main`)."""

from ntl_pretrain.runtime.process_group import exit_without_finalising
from ntl_pretrain.train.main import main

exit_without_finalising(main())
