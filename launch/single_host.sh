#!/usr/bin/env bash
# One multi-GPU host: T trainer GPUs for JAX, the others for vLLM rollout workers.
#   launch/single_host.sh CONFIG WORKDIR TRAINER_GPUS [overrides...]
# e.g. launch/single_host.sh configs/qwen2_5_7b.py runs/q25 0,1,2 --config.model.path=/models/Qwen2.5-7B
# The split is the config's `devices` section, exactly as `python -m jaxreplay.launch` applies it
# (jaxreplay/config/devices.py): the trainer process sees only TRAINER_GPUS, and each of the W vLLM workers
# it spawns gets rollout.vllm_tensor_parallel_size of the GPUs left. Add --dry_run to print the
# per-device memory plan and the split without loading anything. With tensor-parallel engines
# (--config.rollout.vllm_tensor_parallel_size=K) also pass --config.rollout.num_workers=(other GPUs)/K:
# the last value of a repeated scalar override wins (a repeated tuple override, e.g. mesh_shape, is
# appended to the first one: give tuples once).
set -euo pipefail
config=$1; workdir=$2; trainer_gpus=$3; shift 3
all=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}
n_trainer=$(awk -F, '{print NF}' <<<"$trainer_gpus")
n_workers=$(( $(awk -F, '{print NF}' <<<"$all") - n_trainer ))
echo "trainer GPUs: $trainer_gpus (T=$n_trainer); rollout workers: W=$n_workers on the other GPUs of $all"
exec python -m jaxreplay.launch --config="$config" --workdir="$workdir" \
  --config.devices.trainer="$trainer_gpus" --config.trainer.num_devices="$n_trainer" \
  --config.rollout.num_workers="$n_workers" --config.scheduler.kind=async "$@"
