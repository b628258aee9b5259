"""Data pipeline throughput per core against what the tiny recipe's training consumes; one reader's throughput,
peak memory and time to its first batch by document size.

    python bench/data.py [--recipe recipes/tiny-cpu.yaml] [--seconds 10] [--consumption TOKENS_PER_S]
    python bench/data.py --measure-consumption     # also time the recipe's model step, side by side
    python bench/data.py --document-sizes          # short records, 2 MB documents, one 50 MB document

`--document-sizes` runs each corpus in its own process (peak RSS is per process): one reader with the recipe's
tokenizer and data defaults, `num_workers: 0`, micro-batch 8. It reports the time to the first batch (which
includes filling the shuffle buffer), tokens/s after it, and the growth of peak RSS (Linux `VmHWM`, restarted after
imports and the tokenizer load) over the resident size then.

The pipeline runs in this process with one tokenizer thread (`RAYON_NUM_THREADS=1`), reading, mixing,
tokenising, shuffling, packing and snapshotting its state after every batch, exactly as a training rank
with `num_workers: 0` does. The ratio to the consumption rate must stay >= 10 so the data never gates a step.

Default consumption (15,000 tokens/s per rank): `--measure-consumption` on the 2-core dev machine timed
the tiny recipe's forward + backward + AdamW step in plain PyTorch (fp32, one thread, micro-batch 8 x 128)
at 10,650 and 14,760 tokens/s in two runs; the default takes the faster one, rounded up. Under DeepSpeed
ZeRO-3 a rank is slower still (gathers, loss head), so the default overstates demand.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from ntl_pretrain.config.loading import load_recipe
from ntl_pretrain.data import DataConfig, SourceConfig, build_dataloader  # noqa: E402
from ntl_pretrain.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_CONSUMPTION = 15000.0
REPO = Path(__file__).resolve().parent.parent


def pipeline_tokens_per_second(recipe, tokenizer, seconds: float, num_workers: int) -> float:
    recipe.data.num_workers = num_workers
    loader = build_dataloader(
        recipe.data, tokenizer, micro_batch_size=recipe.train.micro_batch_size, dp_rank=0, dp_world_size=1, seed=0
    )
    batches = iter(loader)
    next(batches)  # file opening, HF imports and worker start-up are not throughput
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += next(batches)["input_ids"].numel()
    return tokens / (time.perf_counter() - start)


def consumption_tokens_per_second(recipe, vocab_size: int, steps: int = 10) -> float:
    """Forward + backward + AdamW of the recipe's model on one thread, in plain PyTorch (no DeepSpeed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(recipe.model.model_type, vocab_size=vocab_size, **recipe.model.config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab_size, (recipe.train.micro_batch_size, recipe.data.seq_len))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * ids.numel() / (time.perf_counter() - start)


DOCUMENT_SIZES = {"short records": (200, 50_000), "2 MB documents": (2 << 20, 20), "one 50 MB document": (50 << 20, 1)}


def write_documents(path: Path, characters: int, count: int) -> None:
    """`count` JSON-lines documents of `characters` characters cut from the embedded prose (numbers included)."""
    prose = " ".join(line for line in (REPO / "ntl_pretrain" / "corpus" / "prose" / "train.jsonl").open())
    with path.open("w") as out:
        for index in range(count):
            start = index * 7919 % len(prose)
            text = (prose[start:] + prose) * (characters // len(prose) + 1)
            out.write(json.dumps({"text": text[:characters]}) + "\n")


def peak_rss() -> int:
    """This process's peak resident bytes since the last `restart_peak_rss()` (Linux)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def restart_peak_rss() -> None:
    """Make the current resident size the peak, so that imports and set-up do not count."""
    Path("/proc/self/clear_refs").write_text("5")


def reader_profile(recipe_path: Path, corpus: Path, seconds: float) -> dict[str, float]:
    """Time to the first batch, tokens/s after it and peak-RSS growth of one reader over `corpus` (this process)."""
    recipe = load_recipe(recipe_path)
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    data = DataConfig(sources=[SourceConfig(path=str(corpus))], seq_len=recipe.data.seq_len)
    restart_peak_rss()
    before = peak_rss()
    start = time.perf_counter()
    batches = iter(build_dataloader(data, tokenizer, micro_batch_size=8, dp_rank=0, dp_world_size=1, seed=0))
    next(batches)
    first_batch = time.perf_counter() - start
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += next(batches)["input_ids"].numel()
    tokens_per_s = tokens / (time.perf_counter() - start)
    peak = peak_rss() - before
    return {"first_batch_s": first_batch, "tokens_per_s": tokens_per_s, "peak_growth_mb": peak / 2**20}


def document_sizes(recipe_path: Path, seconds: float) -> None:
    """Each corpus is written here and read in a fresh process, so that its peak RSS is the reader's alone."""
    print(f"{'corpus':<22}{'first batch (s)':>16}{'tokens/s':>12}{'peak RSS growth (MB)':>22}")
    with tempfile.TemporaryDirectory() as folder:
        for corpus, (characters, count) in DOCUMENT_SIZES.items():
            path = Path(folder) / f"{characters}.jsonl"
            write_documents(path, characters, count)
            command = [sys.executable, __file__, "--recipe", str(recipe_path), "--seconds", str(seconds)]
            run = subprocess.run([*command, "--one-corpus", str(path)], capture_output=True, text=True, check=True)
            result = json.loads(run.stdout.strip().splitlines()[-1])
            print(
                f"{corpus:<22}{result['first_batch_s']:>16.2f}{result['tokens_per_s']:>12,.0f}"
                f"{result['peak_growth_mb']:>22,.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "tiny-cpu.yaml")
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time per configuration")
    parser.add_argument("--consumption", type=float, default=DEFAULT_CONSUMPTION, help="tokens/s one rank trains")
    parser.add_argument("--measure-consumption", action="store_true", help="time the recipe's model step here")
    parser.add_argument("--workers", type=int, default=2, help="also measure with this many DataLoader workers")
    parser.add_argument("--document-sizes", action="store_true", help="one reader by document size (see above)")
    parser.add_argument("--one-corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_corpus:
        print(json.dumps(reader_profile(args.recipe, args.one_corpus, args.seconds)))
        return
    if args.document_sizes:
        document_sizes(args.recipe, args.seconds)
        return

    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    tokenizer = load_tokenizer(recipe.tokenizer.path)
    consumption = args.consumption
    if args.measure_consumption:
        consumption = consumption_tokens_per_second(recipe, len(tokenizer))
        print(f"consumption (measured, 1 thread): {consumption:,.0f} tokens/s")
    else:
        print(f"consumption (given): {consumption:,.0f} tokens/s")
    per_core = pipeline_tokens_per_second(recipe, tokenizer, args.seconds, num_workers=0)
    print(f"pipeline, in-process, 1 core:   {per_core:>10,.0f} tokens/s   {per_core / consumption:6.1f}x consumption")
    if args.workers:
        workers = pipeline_tokens_per_second(recipe, tokenizer, args.seconds, num_workers=args.workers)
        print(
            f"pipeline, {args.workers} workers:            {workers:>10,.0f} tokens/s   "
            f"{workers / consumption:6.1f}x consumption"
        )


if __name__ == "__main__":
    main()
