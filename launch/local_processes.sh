#!/usr/bin/env bash
# Exercises the multi-process trainer start-up on one CPU machine: N local processes, each with
# emulated devices, joined by jax.distributed (what multi_host.sh does across hosts).
#   launch/local_processes.sh 2 /tmp/mp_check
set -euo pipefail
n=${1:-2}; out=${2:-/tmp/jaxreplay_mp}
mkdir -p "$out"
for i in $(seq 0 $((n - 1))); do
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python - "$i" "$n" > "$out/$i.log" 2>&1 <<'PY' &
import sys
import jax
i, n = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address="127.0.0.1:12355", num_processes=n, process_id=i)
from jaxreplay import sharding
mesh = sharding.make_mesh((1, -1, 1))
print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local, "
      f"{jax.device_count()} global devices, mesh {dict(mesh.shape)}")
PY
done
wait
cat "$out"/*.log | grep process
