"""aten ops that one forward + backward of the chunked head (`linear_ce_ntl_loss`) dispatches per chunk: issue 48's
host-overhead figure (the first GPU run's 135M step ran 13 chunks of ~347 ops each).

    python bench/chunk_ops.py [--positions 1024 --vocab 4096 --hidden 64] [--device cpu] [--backend torch]

torch.profiler counts the aten ops of one call (after a warm-up call) with 1 chunk and with 8, for each kind; the
difference over 7 is the ops an extra chunk costs (all ops, and top-level ones: those no other aten op called).
Launches of Triton kernels are no aten ops: with `--backend triton` (CUDA) the counts are its host side.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from ntl_pretrain.doctor.loss_checks import draw_labels, multi_digit_vocab
from ntl_pretrain.loss.chunked import linear_ce_ntl_loss

KINDS = ("was", None, "digits", "number")
CHUNKS = 8


def aten_ops(step) -> tuple[int, int]:
    """(all aten ops, top-level aten ops) of one call of `step`."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step()
    ops = [event for event in profiled.events() if event.name.startswith("aten::")]
    top = [op for op in ops if op.cpu_parent is None or not op.cpu_parent.name.startswith("aten::")]
    return len(ops), len(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch")
    args = parser.parse_args(argv)
    nv = multi_digit_vocab(args.vocab).to(args.device)
    generator = torch.Generator().manual_seed(0)
    labels = draw_labels(nv, generator, args.positions).to(args.device)
    hidden = torch.randn(args.positions, args.hidden, generator=generator).to(args.device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * args.hidden**-0.5).to(args.device)
    weight.requires_grad_()
    print(f"N={args.positions} V={args.vocab} H={args.hidden} {args.device} backend={args.backend}: aten ops per call "
          f"(all / top-level), and per extra chunk")  # fmt: skip
    for kind in KINDS:
        counts = {}
        for chunks in (1, CHUNKS):

            def step(chunks=chunks, kind=kind):
                linear_ce_ntl_loss(hidden, weight, labels, nv, kind=kind, chunk_size=-(-args.positions // chunks),
                                   backend=args.backend).loss.backward()  # fmt: skip
                hidden.grad = weight.grad = None

            counts[chunks] = aten_ops(step)
        extra = [(counts[CHUNKS][i] - counts[1][i]) / (CHUNKS - 1) for i in range(2)]
        print(f"  kind {kind!s:7} 1 chunk: {counts[1][0]} / {counts[1][1]}; per extra chunk: {extra[0]:.0f} / "
              f"{extra[1]:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
