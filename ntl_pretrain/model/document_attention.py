"""Per-document attention with flash-attention 2: the sequence boundaries of packed rows, handed to the kernel.

transformers keeps attention inside each document from restarting `position_ids` with sdpa and eager in any batch,
but with flash-attention 2 only in a batch of one row (`modeling_flash_attention_utils._is_packed_sequence`);
with more rows it runs plain causal attention over each whole row. Given the varlen arguments (`cu_seq_lens_q/k`,
`max_length_q/k`) it runs the varlen kernel for any batch size, over the rows flattened into one sequence. They are
built here from the CPU batch, so the step needs no host sync for them: `max_length` must be a Python int (flash-
attn's varlen function takes it as one), which on the device would cost an `.item()` per micro-batch.

Shapes: B rows, T positions, N = B·T flattened positions, D documents (pieces) in the micro-batch.
"""

from __future__ import annotations

import inspect

import torch

FLASH_ATTENTION = "flash_attention_2"
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def needs_varlen_arguments(attention: str, per_document_attention: bool) -> bool:
    return attention == FLASH_ATTENTION and per_document_attention


def varlen_arguments(position_ids_BT: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The varlen keyword arguments of a packed micro-batch (on the CPU, as the loader made it): a document starts
    where its position is 0 and at every row's start, so no document continues from one row into the next."""
    B, T = position_ids_BT.shape
    starts_N = (position_ids_BT == 0).reshape(-1)
    starts_N[::T] = True
    cu_seq_lens_D1 = torch.cat([starts_N.nonzero().reshape(-1), torch.tensor([B * T])]).to(torch.int32)
    max_length = int(cu_seq_lens_D1.diff().max())
    return dict(zip(VARLEN_KEYS, (cu_seq_lens_D1, cu_seq_lens_D1, max_length, max_length), strict=True))


def transformers_takes_varlen_arguments() -> bool:
    """Whether the installed transformers routes `cu_seq_lens_q/k` and `max_length_q/k` to the kernel."""
    from transformers import modeling_flash_attention_utils

    parameters = inspect.signature(modeling_flash_attention_utils._flash_attention_forward).parameters
    return all(key in parameters for key in VARLEN_KEYS)
