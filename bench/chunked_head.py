"""Peak memory and time of one loss step: chunked head vs `hidden @ weight.T` + `ce_ntl_loss`, side by side, and
the chunked head with its weight gradient taken in groups of chunks (`--weight-grad-rows`, loss/chunked.py).

    python bench/chunked_head.py [--positions 8192 --hidden 2048 --vocab 128256 --repeats 1 --weight-grad-rows R]

Each measurement runs in a fresh process (so max RSS is that path's own high-water mark), alternating between
the paths. A step is forward + backward of CE + 0.3·NTL-WAS ("mean") through the output layer, fp32, with the
Llama-3 tokenizer's number tokens (padded to --vocab). "step peak" is the max RSS minus the RSS once the inputs
(hidden, weight, labels) exist, i.e. what the loss step itself adds, weight gradient included. Wall time and
process CPU time are both reported: on a machine shared with other work, CPU time is the steadier of the two.
"chunked" takes the library's default weight-gradient grouping (none in fp32, none on CPU); "grouped" passes
`--weight-grad-rows` (default: 4 chunks), which on CPU fp32 costs a [G, V] fp32 buffer: the bf16 GPU case it is
made for (module docstring of loss/chunked.py) is what `ntl-pretrain doctor` measures on a GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

LLAMA3_TOKENIZER = "pkg:quicktok/data/llama3.vocab"
PATHS = ("unchunked", "chunked", "grouped")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(path: str, positions: int, hidden_size: int, vocab: int, chunk_size: int | None,
            weight_grad_rows: int | None) -> dict:  # fmt: skip
    """One loss step of `path` in this process: seconds, max RSS and RSS before the step, in bytes."""
    import torch

    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.loss.chunked import linear_ce_ntl_loss
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.tokenizer import load_tokenizer

    nv = NumberVocab.from_tokenizer(load_tokenizer(LLAMA3_TOKENIZER), vocab_size=vocab)
    generator = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(positions, hidden_size, generator=generator).requires_grad_(True)
    weight_VH = (0.02 * torch.randn(vocab, hidden_size, generator=generator)).requires_grad_(True)
    numbers_N = nv.number_ids[torch.randint(0, len(nv.number_ids), (positions,), generator=generator)]
    words_N = torch.randint(0, nv.vocab_size, (positions,), generator=generator)
    labels_N = torch.where(torch.rand(positions, generator=generator) < 0.3, numbers_N, words_N)
    before = rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    if path == "chunked":
        loss = linear_ce_ntl_loss(hidden_NH, weight_VH, labels_N, nv, chunk_size=chunk_size).loss
    elif path == "grouped":
        loss = linear_ce_ntl_loss(hidden_NH, weight_VH, labels_N, nv, chunk_size=chunk_size,
                                  weight_grad_rows=weight_grad_rows).loss  # fmt: skip
    else:
        loss = ce_ntl_loss(hidden_NH @ weight_VH.T, labels_N, nv).loss
    loss.backward()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "path": path,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "max_rss": max_rss_bytes(),
        "rss_before": before,
        "loss": float(loss.detach()),
    }


def run_in_fresh_process(path: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", path] + [
        f"--{name}={getattr(args, name)}" for name in ("positions", "hidden", "vocab")
    ]
    if args.chunk_size:
        command.append(f"--chunk-size={args.chunk_size}")
    command.append(f"--weight-grad-rows={args.weight_grad_rows}")
    return json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk-size", type=int, default=None, help="positions per chunk (default: the library's)")
    parser.add_argument("--weight-grad-rows", type=int, default=None, help="positions per weight-gradient matmul "
                        "of the grouped path (default: 4 chunks)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.weight_grad_rows is None:
        from ntl_pretrain.loss.chunked import default_chunk_rows

        args.weight_grad_rows = 4 * (args.chunk_size or default_chunk_rows(args.vocab))
    if args.child:
        print(json.dumps(measure(args.child, args.positions, args.hidden, args.vocab, args.chunk_size,
                                 args.weight_grad_rows)))  # fmt: skip
        return
    print(f"N={args.positions} H={args.hidden} V={args.vocab} fp32, chunk_size={args.chunk_size or 'default'}, "
          f"grouped: weight_grad_rows={args.weight_grad_rows}")  # fmt: skip
    results = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path in PATHS:
            results[path].append(run_in_fresh_process(path, args))
            print_result(results[path][-1])
    peak = {path: max(step_peak(r) for r in results[path]) for path in PATHS}
    total = {path: max(r["max_rss"] for r in results[path]) for path in PATHS}
    for path, base in (("chunked", "unchunked"), ("grouped", "chunked")):
        ratio = lambda key, p=path, b=base: min(r[key] for r in results[p]) / min(r[key] for r in results[b])
        print(
            f"{path} / {base} (best of {args.repeats}): wall time {ratio('seconds'):.3f}x, CPU time "
            f"{ratio('cpu_seconds'):.3f}x, step peak {peak[path] / peak[base]:.1%}, max RSS "
            f"{total[path] / total[base]:.1%}"
        )


def step_peak(result: dict) -> int:
    return result["max_rss"] - result["rss_before"]


def print_result(r: dict) -> None:
    print(
        f"  {r['path']:9s} wall {r['seconds']:7.2f} s  CPU {r['cpu_seconds']:7.2f} s  max RSS "
        f"{r['max_rss'] / 2**30:6.2f} GiB  step peak {step_peak(r) / 2**30:6.2f} GiB  loss {r['loss']:.6f}"
    )


if __name__ == "__main__":
    main()
