"""The Triton backend's kernels keep within their registers: every kernel a loss call launches, for every NTL kind,
compiled offline for sm_80 (A100) and sm_90 (H100/H200) with Triton's own ptxas (no GPU needed), spills nothing.
A spill costs every row local-memory traffic (before issue 57 the WAS gradient kernel spilled 480 B a thread on
sm_90: ~5x the useful traffic at Llama-3's vocabulary). Shapes as a Llama-3 vocabulary in bf16 (the kernels' blocks
depend on them); the calls are recorded, not run, and compiled in a child process (loss/triton_resources.py)."""

from __future__ import annotations

import pytest
import torch

from ntl_pretrain.loss import KINDS
from ntl_pretrain.loss.triton_resources import (
    ARCHS,
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
    return loss_kernel_resources((None, *KINDS))


def test_no_kernel_of_any_kind_spills_on_sm80_or_sm90(resources):
    spilling = [f"{r.arch} {r.kernel} ({', '.join(r.kinds)}): {r.spill_bytes} B" for r in resources if r.spill_bytes]
    assert not spilling, "\n".join(spilling)
    assert {r.arch for r in resources} == set(ARCHS)
    assert all(0 < r.registers <= 64 for r in resources)  # 32 warps of 32 threads: at most 64 registers each


def test_every_kind_has_its_gradient_kernels_checked(resources):
    """Each kind's dense backward, fused chunk and (with reweighing) unfused chunk gradient kernels are among the
    compiled ones, so a kind whose kernels were left out cannot pass the spill check unseen."""
    gradient_kinds = {kind for r in resources if r.kernel.startswith("logits_grad_kernel") for kind in r.kinds}
    assert gradient_kinds == {str(kind) for kind in (None, *KINDS)}
    assert any("ROW_LSE=True" in r.kernel and "SOFTCAPPED=True" in r.kernel for r in resources)


def test_recording_captures_the_launches_without_running_them():
    """Each launch of the call is recorded in order, with the arguments it was given (here the logits)."""
    from ntl_pretrain.loss import ce_ntl_loss

    nv = llama3_like_vocab(4096)
    labels = nv.number_ids[:3]
    logits = torch.zeros(3, nv.vocab_size, requires_grad=True)
    launches = recorded_launches(lambda: ce_ntl_loss(logits, labels, nv, kind="was", backend="triton").loss.backward())
    assert [launch.kernel for launch in launches] == ["row_partials_kernel", "logits_grad_kernel"]
    assert launches[1].kwargs["NUMBERS"] and launches[1].args[0].data_ptr() == logits.data_ptr()
