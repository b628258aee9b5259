#!/usr/bin/env bash
# Train on several nodes listed in a DeepSpeed hostfile (see launch/hostfile.example).
#
# With ssh between nodes: run once, on the first node of the hostfile; DeepSpeed starts the others via pdsh.
#   HOSTFILE=launch/hostfile launch/multinode.sh recipes/llama3-8b-cpt.yaml
# Without ssh: run on every node at the same time with its NODE_RANK (0 = the first line of the hostfile) and
# the same MASTER_ADDR (the first node's address); launch/slurm/train.sbatch starts one such launcher per node.
#   NODE_RANK=1 MASTER_ADDR=gpu-node-01 HOSTFILE=launch/hostfile launch/multinode.sh recipes/llama3-8b-cpt.yaml
# Each launcher runs under ntl_pretrain.runtime.supervisor: SIGTERM / SIGUSR1 / Ctrl-C to this script makes this node's
# ranks save at the next step and stop (exit code 75), and nothing of the run outlives the script. With pdsh the
# other nodes' ranks are reached by DeepSpeed's own kill command instead (no save): signal every node's script, or
# use the per-node form (docs/multinode.md, "Stopping a run").
set -euo pipefail
RECIPE=$1
shift
HOSTFILE=${HOSTFILE:-launch/hostfile}
MASTER_ADDR=${MASTER_ADDR:-$(grep -v '^#' "$HOSTFILE" | awk 'NF {print $1; exit}')}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -n "${NODE_RANK:-}" ]]; then
  exec python -m ntl_pretrain.runtime.supervisor -- deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --module ntl_pretrain.train "$RECIPE" "$@"
fi
exec python -m ntl_pretrain.runtime.supervisor -- deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" \
  --master_port "$MASTER_PORT" --module ntl_pretrain.train "$RECIPE" "$@"
