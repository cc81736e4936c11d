#!/usr/bin/env bash
# The device check (bench/gpu_check.py) on one GPU: random Qwen3-0.6B-shaped weights (no hub), one
# vLLM worker and the JAX trainer sharing the GPU, 20 steps of the async pipeline. Prints a table and
# writes OUT_DIR/gpu_check.json + metrics.jsonl. Needs vLLM for GPUs and JAX with CUDA
# (`--backend jax` runs the JAX sampler instead where vLLM is not installed).
#   launch/gpu_check.sh [OUT_DIR] [bench/gpu_check.py flags...]
# e.g. launch/gpu_check.sh bench/results/gpu_check
#      launch/gpu_check.sh /tmp/gc --steps 10 --max_tokens 256
# Memory: JAX takes XLA_PYTHON_CLIENT_MEM_FRACTION (0.45; 0.85 with --backend jax) of the GPU,
# vLLM --vllm_memory (0.4). Python packages missing on the machine may be carried as wheels in
# .whl/ (installed to /tmp/site first), e.g. for an image without them:
#   pip download --no-deps -d .whl ml-collections==1.1.0 tensorboardX==2.6.5
# PYTHON picks the interpreter (default python3). Before a GPU is there, check that the config fits
# one H200 by the memory plan: python bench/gpu_check.py --plan_only --out /tmp/plan (no GPU needed).
# Budget: about 8 minutes on an H200 (vLLM compile + CUDA graphs, JAX compile, 20 steps); the whole
# check is stopped after GPU_CHECK_TIMEOUT_S (default 540) seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu_check}; [[ $# -gt 0 ]] && shift
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
"$py" - <<'PY'
import importlib.util, sys
missing = [m for m in ("jax", "ml_collections", "orbax", "transformers", "tensorboardX")
           if importlib.util.find_spec(m.split(".")[0]) is None]
if missing:
  sys.exit(f"gpu_check: missing Python packages {missing}; `pip install -e '.[gpu]'` (or carry "
           "their wheels in .whl/)")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mkdir -p "$out"
timeout "${GPU_CHECK_TIMEOUT_S:-540}" "$py" bench/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
