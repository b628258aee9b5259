"""Checkpoints: saving and loading step folders (`store`), the checksummed list of their files (`manifest`), and
turning per-rank ZeRO-3 shards into another world size's (`reshard`)."""
