#!/usr/bin/env bash
# A multi-process trainer on one CPU machine: N local processes, each with 2 emulated devices, joined
# by jax.distributed into one trainer over 2N devices (what multi_host.sh does across hosts), running
# the async schedule: process 0 owns the replay buffer and places the rollout workers as Ray actors
# on a local Ray instance it starts; every step it sends the batch to the other processes.
#   launch/local_processes.sh 2 /tmp/mp_run [overrides...]      (defaults: configs/tiny.py, 20 steps)
# Environment: CONFIG (configs/tiny.py), PORT (jax.distributed, 12355), SCHEDULE (async; simulated
# runs every process's pipeline in lockstep), PLACEMENT (ray; local = worker threads / processes
# of process 0), WORKERS (2 rollout workers). Logs: DIR/process_I.log.
# tests/integration/test_multiprocess.py runs it (and checks a lockstep run against a one-process run).
set -euo pipefail
n=${1:-2}; workdir=${2:-/tmp/jaxreplay_mp}; shift $(( $# > 2 ? 2 : $# ))
config=${CONFIG:-configs/tiny.py}
port=${PORT:-12355}
mkdir -p "$workdir"
pids=()
for i in $(seq 0 $((n - 1))); do
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
    python -m jaxreplay.launch --config="$config" --workdir="$workdir" \
      --coordinator_address="127.0.0.1:$port" --num_processes="$n" --process_id="$i" \
      --config.rollout.backend=jax --config.total_steps=20 --config.trainer.mesh_shape='(1,-1,1)' \
      --config.scheduler.kind="${SCHEDULE:-async}" --config.rollout.placement="${PLACEMENT:-ray}" \
      --config.rollout.num_workers="${WORKERS:-2}" \
      "$@" > "$workdir/process_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
grep -h "trainer process\|rollout pool stopped\|replay buffer:\|finished" "$workdir"/process_*.log || true
if [ $status -ne 0 ]; then tail -n 5 "$workdir"/process_*.log; fi
exit $status
