#!/usr/bin/env bash
# Several hosts: the trainer is one JAX program over all hosts' trainer GPUs (jax.distributed);
# run this on every host with the same arguments and its own HOST_INDEX.
#   COORDINATOR=host0:1234 NUM_HOSTS=2 HOST_INDEX=0 launch/multi_host.sh CONFIG WORKDIR [overrides...]
# Under the async schedule process 0 owns the replay buffer and the rollout workers and sends every
# step's batch to the others; under simulated / sync every process runs the pipeline in lockstep.
# See launch/README.md.
# Under SLURM: srun --ntasks-per-node=1 env HOST_INDEX=\$SLURM_PROCID NUM_HOSTS=\$SLURM_NTASKS ...
set -euo pipefail
config=$1; workdir=$2; shift 2
: "${COORDINATOR:?set COORDINATOR=host:port of host 0}"
: "${NUM_HOSTS:?set NUM_HOSTS}"
: "${HOST_INDEX:?set HOST_INDEX (0..NUM_HOSTS-1)}"
exec python -m jaxreplay.launch --config="$config" --workdir="$workdir" \
  --coordinator_address="$COORDINATOR" --num_processes="$NUM_HOSTS" --process_id="$HOST_INDEX" "$@"
