#!/usr/bin/env bash
# Train on the GPUs of one node: those CUDA_VISIBLE_DEVICES makes visible (all by default), or the first NGPUS of them.
#   launch/single_node.sh recipes/qwen2.5-1.5b-cpt.yaml [key.path=value ...]
#   CUDA_VISIBLE_DEVICES=4,5 launch/single_node.sh recipes/qwen2.5-1.5b-cpt.yaml     # a shared node: GPUs 4 and 5
# Through `ntl-pretrain train`: the recipe is checked before any rank starts, and SIGTERM / Ctrl-C to this script
# makes the ranks save at the next step and stop (exit code 75; run it again to continue), leaving nothing running.
set -euo pipefail
RECIPE=$1
shift
exec ntl-pretrain train "$RECIPE" ${NGPUS:+--nproc "$NGPUS"} --master-port "${MASTER_PORT:-29500}" "$@"
