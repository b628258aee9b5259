"""The Triton backend's kernels keep within their registers: every kernel a loss call launches, for every NTL kind,
compiled offline for sm_80 (A100) and sm_90 (H100/H200) with Triton's own ptxas (no GPU needed), spills nothing.
A spill costs every row local-memory traffic (before issue 57 the WAS gradient kernel spilled 480 B a thread on
sm_90: ~5x the useful traffic at Llama-3's vocabulary; before issue 70 widths that 16 does not divide spilled
28-136 B in the row loop, and fp32 logits 4-24 B). Llama-3-like vocabularies of Llama-3's width and of the ragged
widths of BERT, GPT-2 and o200k, in bf16 and fp32 (the kernels' blocks and specialisations depend on them); the
calls are recorded, not run, and compiled in a child process (loss/triton_resources.py)."""

from __future__ import annotations

import pytest
import torch

from ntl_pretrain.loss import KINDS
from ntl_pretrain.loss.triton_resources import (
    ARCHS,
    LLAMA3_VOCAB,
    RAGGED_VOCABS,
    distinct_launches,
    llama3_like_vocab,
    loss_kernel_resources,
    offline_compile_unavailable,
    recorded_launches,
)


@pytest.fixture(scope="module")
def resources():
    reason = offline_compile_unavailable()
    if reason is not None:
        pytest.skip(f"no offline compile for CUDA targets here: {reason}")
    kinds = (None, *KINDS)
    return [
        *loss_kernel_resources(kinds, (LLAMA3_VOCAB, *RAGGED_VOCABS)),
        *loss_kernel_resources(kinds, RAGGED_VOCABS, dtypes=("fp32",)),
    ]


WIDTHS = {"bf16": {LLAMA3_VOCAB, *RAGGED_VOCABS}, "fp32": set(RAGGED_VOCABS)}
"""What is compiled: fp32 at the ragged widths only, whose kernels differ from Llama-3's width only in alignment
facts that the ragged kernels prove for themselves (one more compile of every kernel costs CI a minute)."""


def test_no_kernel_of_any_kind_width_or_dtype_spills_on_sm80_or_sm90(resources):
    spilling = [f"{r.arch} {r.dtype} {r.vocab_sizes} {r.kernel} ({', '.join(r.kinds)}): {r.spill_bytes} B"
                for r in resources if r.spill_bytes]  # fmt: skip
    assert not spilling, "\n".join(spilling)
    assert {r.arch for r in resources} == set(ARCHS)
    assert all(0 < r.registers <= 64 for r in resources)  # 32 warps of 32 threads: at most 64 registers each
    for dtype, want in WIDTHS.items():  # the chunked head's class pass reads fp32 number logits at every width too
        assert want <= {width for r in resources if r.dtype == dtype for width in r.vocab_sizes}, dtype


def test_the_ragged_widths_compile_to_the_same_kernels():
    """Triton specialises an integer argument only by whether 16 divides it (and whether it is 1), and the row block
    is the same from 32,768 columns up: so 30,522, 50,257 and 199,999 launch the same kernels, and the compiled
    entries above list all three on one kernel rather than compiling each."""
    from ntl_pretrain.loss.triton_resources import _launch_key

    for kind in (None, "digits"):
        keys = [{_launch_key(launch) for launch in distinct_launches(kind, width, torch.bfloat16)}
                for width in RAGGED_VOCABS]  # fmt: skip
        assert keys[0] == keys[1] == keys[2], kind


def test_every_kind_has_its_gradient_kernels_checked(resources):
    """Each kind's dense backward, fused chunk and (with reweighing) unfused chunk gradient kernels are among the
    compiled ones, so a kind whose kernels were left out cannot pass the spill check unseen."""
    gradient_kinds = {kind for r in resources if r.kernel.startswith("logits_grad_kernel") for kind in r.kinds}
    assert gradient_kinds == {str(kind) for kind in (None, *KINDS)}
    assert any("ROW_LSE=True" in r.kernel and "SOFTCAPPED=True" in r.kernel for r in resources)
    dense_forward = [r for r in resources if "ROW_LSE=True" in r.kernel and "IN_PLACE" not in r.kernel]
    assert {kind for r in dense_forward for kind in r.kinds} == {str(kind) for kind in (None, *KINDS)}
    assert any(r.kernel.startswith("scale_unless_one_kernel") for r in resources)


def test_the_training_loss_forms_the_gradient_in_one_read_of_the_logits():
    """`ce_ntl_training_loss` (the dense head's): its forward launches the class pass (the members' columns alone)
    and one kernel that reads each row for its log-sum-exp and writes its gradient; its backward only scales that."""
    from ntl_pretrain.loss.ce_ntl import ce_ntl_training_loss

    nv = llama3_like_vocab(4096)
    logits = torch.zeros(3, nv.vocab_size, requires_grad=True)
    forward = recorded_launches(lambda: ce_ntl_training_loss(logits, nv.number_ids[:3], nv, backend="triton"))
    assert [launch.kernel for launch in forward] == ["row_partials_kernel", "logits_grad_kernel"]
    assert not forward[0].kwargs["CE"] and forward[0].kwargs["CLASSES"]
    assert forward[1].kwargs["ROW_LSE"] and not forward[1].kwargs["IN_PLACE"]
    launches = recorded_launches(lambda: ce_ntl_training_loss(logits, nv.number_ids[:3], nv, backend="triton")
                                 .loss.backward())  # fmt: skip
    assert [launch.kernel for launch in launches[2:]] == ["scale_unless_one_kernel"]


def test_recording_captures_the_launches_without_running_them():
    """Each launch of the call is recorded in order, with the arguments it was given (here the logits)."""
    from ntl_pretrain.loss import ce_ntl_loss

    nv = llama3_like_vocab(4096)
    labels = nv.number_ids[:3]
    logits = torch.zeros(3, nv.vocab_size, requires_grad=True)
    launches = recorded_launches(lambda: ce_ntl_loss(logits, labels, nv, kind="was", backend="triton").loss.backward())
    assert [launch.kernel for launch in launches] == ["row_partials_kernel", "logits_grad_kernel"]
    assert launches[1].kwargs["NUMBERS"] and launches[1].args[0].data_ptr() == logits.data_ptr()
