#!/usr/bin/env bash
# Train on this machine's CPU cores: NPROC gloo ranks (default 2), DeepSpeed ZeRO-3 in fp32/bf16.
#   launch/local_cpu.sh [RECIPE] [key.path=value ...]      e.g. launch/local_cpu.sh recipes/tiny-cpu.yaml train.max_steps=50
set -euo pipefail
RECIPE=${1:-recipes/tiny-cpu.yaml}
shift $(( $# > 0 ? 1 : 0 ))
export DS_ACCELERATOR=cpu
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec deepspeed --num_gpus "${NPROC:-2}" --master_port "$PORT" --module ntl_pretrain.train "$RECIPE" "$@"
