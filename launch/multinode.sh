#!/usr/bin/env bash
# Train on several nodes listed in a DeepSpeed hostfile (see launch/hostfile.example).
#
# With ssh between nodes: run once, on the first node of the hostfile; DeepSpeed starts the others via pdsh.
#   HOSTFILE=launch/hostfile launch/multinode.sh recipes/llama3-8b-cpt.yaml
# Without ssh: run on every node at the same time with its NODE_RANK (0 = the first line of the hostfile) and
# the same MASTER_ADDR (the first node's address); launch/slurm/train.sbatch starts one such launcher per node.
#   NODE_RANK=1 MASTER_ADDR=gpu-node-01 HOSTFILE=launch/hostfile launch/multinode.sh recipes/llama3-8b-cpt.yaml
set -euo pipefail
RECIPE=$1
shift
HOSTFILE=${HOSTFILE:-launch/hostfile}
MASTER_ADDR=${MASTER_ADDR:-$(grep -v '^#' "$HOSTFILE" | awk 'NF {print $1; exit}')}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -n "${NODE_RANK:-}" ]]; then
  exec deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" --module ntl_pretrain.train "$RECIPE" "$@"
fi
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --module ntl_pretrain.train "$RECIPE" "$@"
