"""The bits a packed token carries above its id (docs/data.md, "Which labels carry which loss").

The encoder marks the tokens of a Q/A record's answer with `ANSWER` and, where a source restricts CE or NTL to its
answers, the tokens outside them with `NO_CE` / `NO_NTL`. The bits sit above every token id, so the shuffle buffer,
the packer, their checkpointed state and the resharding carry them unchanged and without extra memory;
`packing.make_batch` takes them off again. No imports: the sources read them while a recipe is validated."""

ANSWER, NO_CE, NO_NTL = 1 << 28, 1 << 29, 1 << 30
TOKEN_BITS = ANSWER - 1
"""Token ids are below 2^28 (vocabularies have at most a few hundred thousand tokens)."""
