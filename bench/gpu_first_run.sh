#!/usr/bin/env bash
# The first GPU run in one prepared command: install the carried wheels, then the doctor (1 GPU), the loss and
# output-layer benchmarks in bf16, 100 bf16 steps of a ~125M Llama, and study v3's GPU-arm throughput probe, each
# time-boxed, within 8 minutes; figures and logs in $OUT (summary.md, summary.json, written after every stage).
#   bench/gpu_first_run.sh [--dry-run] [--out DIR] [--wheels DIR] [--budget SECONDS] [--stages NAME ...]
# --dry-run: every stage on CPU at toy sizes (tests/test_gpu_first_run.py). How to run it on the device machine
# and where each figure goes: docs/doctor.md, "The first GPU". The stages are in bench/gpu_first_run.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" bench/gpu_first_run.py "$@"
