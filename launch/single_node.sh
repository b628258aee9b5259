#!/usr/bin/env bash
# Train on the GPUs of one node (all visible GPUs unless NGPUS is set).
#   launch/single_node.sh recipes/qwen2.5-1.5b-cpt.yaml [key.path=value ...]
set -euo pipefail
RECIPE=$1
shift
NGPUS=${NGPUS:-$(nvidia-smi --list-gpus | wc -l)}
exec deepspeed --num_gpus "$NGPUS" --master_port "${MASTER_PORT:-29500}" --module ntl_pretrain.train "$RECIPE" "$@"
