#!/usr/bin/env bash
# A Ray cluster for the rollout workers (--config.rollout.placement=ray): start the head on one node,
# a worker on every rollout node, then the trainer with --config.rollout.ray_address=HEAD_IP:PORT.
#   launch/ray_cluster.sh head [PORT]            the head (default port 6379); schedules no rollout
#                                                actor itself unless HEAD_GPUS / HEAD_CPUS say so
#   launch/ray_cluster.sh worker HEAD_IP:PORT    a rollout node: Ray sees its GPUs (CUDA_VISIBLE_DEVICES)
#   launch/ray_cluster.sh stop                   stops Ray on this node
# Each rollout worker is one Ray actor holding rollout.ray_num_gpus_per_worker GPUs (auto: the
# engine's tensor_parallel_size) and rollout.ray_num_cpus_per_worker CPUs, in one placement group
# (rollout.ray_placement_strategy: PACK fills a node before the next, SPREAD spreads them out); Ray
# restarts a dead actor (rollout.ray_max_restarts). Weights reach other nodes through Ray's object
# store (no shared filesystem needed). Trainer GPUs must not be given to Ray: run the head on a
# trainer node with HEAD_GPUS=0 (the default), and no Ray worker on trainer nodes.
# Example (2 nodes, 8 GPUs each; node A trains on its 8 GPUs, node B generates with 8 engines):
#   node A: launch/ray_cluster.sh head
#   node B: launch/ray_cluster.sh worker nodeA:6379
#   node A: python -m jaxreplay.launch --config=configs/qwen3_8b.py --workdir=runs/q3 \
#             --config.scheduler.kind=async --config.rollout.placement=ray \
#             --config.rollout.ray_address=nodeA:6379 --config.rollout.num_workers=8
# Authentication: Ray 2.60's `ray start --head` turns token authentication on and writes the token
# to ~/.ray/auth_token; every other node (Ray workers and trainer process 0) needs the same file (a
# shared home, or copy it; or RAY_AUTH_TOKEN=...). This script and jaxreplay then set
# RAY_AUTH_MODE=token themselves.
# Several trainer nodes: run launch/multi_host.sh on each with the same flags (process 0 owns the
# replay buffer and is the only one that talks to Ray). Under SLURM see launch/slurm_ray.sbatch.
set -euo pipefail
cmd=${1:?usage: launch/ray_cluster.sh head [PORT] | worker HEAD_IP:PORT | stop}
case "$cmd" in
  head)
    port=${2:-6379}
    ray start --head --port="$port" --num-gpus="${HEAD_GPUS:-0}" --num-cpus="${HEAD_CPUS:-0}" \
      --include-dashboard=false
    echo "Ray head at $(hostname -i 2>/dev/null | awk '{print $1}'):$port; pass it as --config.rollout.ray_address"
    ;;
  worker)
    address=${2:?usage: launch/ray_cluster.sh worker HEAD_IP:PORT}
    RAY_AUTH_MODE=${RAY_AUTH_MODE:-token} ray start --address="$address"
    ;;
  stop)
    ray stop
    ;;
  *)
    echo "unknown command $cmd: expected head, worker or stop" >&2
    exit 2
    ;;
esac
