#!/usr/bin/env bash
# One multi-GPU host: T trainer GPUs for JAX, W GPUs for vLLM rollout workers.
#   launch/single_host.sh CONFIG WORKDIR TRAINER_GPUS [overrides...]
# e.g. launch/single_host.sh configs/qwen2_5_7b.py runs/q25 0,1,2 --config.model.path=/models/Qwen2.5-7B
# The trainer process sees only TRAINER_GPUS (CUDA_VISIBLE_DEVICES); the vLLM worker processes it
# spawns are given the remaining GPUs, one each (JAXREPLAY_WORKER_GPUS).
set -euo pipefail
config=$1; workdir=$2; trainer_gpus=$3; shift 3
all=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
workers=$(python3 - "$all" "$trainer_gpus" <<'PY'
import sys
all_gpus = sys.argv[1].split(","); trainer = set(sys.argv[2].split(","))
print(",".join(g for g in all_gpus if g not in trainer))
PY
)
n_trainer=$(awk -F, '{print NF}' <<<"$trainer_gpus")
n_workers=$(awk -F, '{print NF}' <<<"$workers")
echo "trainer GPUs: $trainer_gpus (T=$n_trainer); worker GPUs: $workers (W=$n_workers)"
export JAXREPLAY_WORKER_GPUS="$workers"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
CUDA_VISIBLE_DEVICES="$trainer_gpus" exec python -m jaxreplay.launch --config="$config" \
  --workdir="$workdir" --config.trainer.num_devices="$n_trainer" \
  --config.rollout.num_workers="$n_workers" --config.scheduler.kind=async "$@"
