"""Pre-flight: what `ntl-pretrain train` and `--dry-run` check before any process starts, beyond the recipe's own
types and ranges: the world (installed model types, files, folders, ports: `world`) and the model the run will
build (its HF config and `init_from`'s weights: `model`)."""
