#!/usr/bin/env bash
# Train on this machine's CPU cores: NPROC gloo ranks (default 2), DeepSpeed ZeRO-3 in fp32/bf16.
#   launch/local_cpu.sh [RECIPE] [key.path=value ...]      e.g. launch/local_cpu.sh recipes/tiny-cpu.yaml train.max_steps=50
# Through `ntl-pretrain train`: the recipe is checked before any rank starts, and SIGTERM / Ctrl-C to this script
# makes the ranks save at the next step and stop (exit code 75; run it again to continue), leaving nothing running.
set -euo pipefail
RECIPE=${1:-recipes/tiny-cpu.yaml}
shift $(( $# > 0 ? 1 : 0 ))
export DS_ACCELERATOR=cpu
exec ntl-pretrain train "$RECIPE" --nproc "${NPROC:-2}" "$@"
