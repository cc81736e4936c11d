#!/usr/bin/env bash
# The multi-host trainer on one CPU machine: N local processes, each with 2 emulated devices, joined
# by jax.distributed into one trainer over 2N devices (what multi_host.sh does across hosts).
#   launch/local_processes.sh 2 /tmp/mp_run [overrides...]      (defaults: configs/tiny.py, 20 steps)
# tests/test_multiprocess.py checks that such a run matches a one-process run on 2N devices.
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
      "$@" > "$workdir/process_$i.log" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
grep -h "trainer process\|finished" "$workdir"/process_*.log || true
if [ $status -ne 0 ]; then tail -n 5 "$workdir"/process_*.log; fi
exit $status
