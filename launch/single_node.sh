#!/usr/bin/env bash
# Train on the GPUs of one node (all visible GPUs unless NGPUS is set).
#   launch/single_node.sh recipes/qwen2.5-1.5b-cpt.yaml [key.path=value ...]
# Through `ntl-pretrain train`: the recipe is checked before any rank starts, and SIGTERM / Ctrl-C to this script
# makes the ranks save at the next step and stop (exit code 75; run it again to continue), leaving nothing running.
set -euo pipefail
RECIPE=$1
shift
NGPUS=${NGPUS:-$(nvidia-smi --list-gpus | wc -l)}
exec ntl-pretrain train "$RECIPE" --nproc "$NGPUS" --master-port "${MASTER_PORT:-29500}" "$@"
