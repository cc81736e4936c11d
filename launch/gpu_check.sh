#!/usr/bin/env bash
# The device check (bench/gpu_check.py) on one GPU: random Qwen3-0.6B-shaped weights (no hub), one
# vLLM worker and the JAX trainer sharing the GPU, 20 steps of the async pipeline. Prints a table and
# writes OUT_DIR/gpu_check.json + metrics.jsonl. Needs vLLM for GPUs and JAX with CUDA
# (`--backend jax` runs the JAX sampler instead where vLLM is not installed).
#   launch/gpu_check.sh [OUT_DIR] [bench/gpu_check.py flags...]   (in any order; --out DIR = OUT_DIR)
# e.g. launch/gpu_check.sh bench/results/gpu_check
#      launch/gpu_check.sh /tmp/gc --steps 10 --max_tokens 256
#      launch/gpu_check.sh --plan_only --out /tmp/plan
# Without a GPU (no nvidia-smi, or it sees none) it stops with one line, unless --plan_only or
# --cpu_smoke asks for a check that needs none.
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
# bench/gpu_check.py's flags that take no value; every other flag takes the next word as its value.
BOOL_FLAGS=" --plan_only --cpu_smoke "
out="" args=() need_gpu=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 ]] || { echo "gpu_check: --out needs a folder; e.g. --out runs/gc" >&2; exit 2; }
           out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --*=*) args+=("$1"); shift ;;
    -*) args+=("$1")
        [[ $BOOL_FLAGS == *" $1 "* ]] && need_gpu=0
        if [[ $BOOL_FLAGS != *" $1 "* && $# -ge 2 ]]; then args+=("$2"); shift; fi
        shift ;;
    *) [[ -z "$out" ]] || { echo "gpu_check: two output folders ('$out', '$1'); give one" >&2; exit 2; }
       out=$1; shift ;;
  esac
done
out=${out:-bench/results/gpu_check}
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
if [[ $need_gpu == 1 ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU machine, or without" \
         "one: launch/gpu_check.sh --plan_only --out $out (the memory plan) or --cpu_smoke" >&2
    exit 2
  fi
  if ! gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); then
    echo "gpu_check: nvidia-smi sees no GPU ($(echo "$gpus" | head -n 1)); check the driver and" \
         "CUDA_VISIBLE_DEVICES, or run --plan_only / --cpu_smoke" >&2
    exit 2
  fi
  echo "$gpus"
fi
mkdir -p "$out"
timeout "${GPU_CHECK_TIMEOUT_S:-540}" "$py" bench/gpu_check.py --out "$out" ${args[@]+"${args[@]}"} 2>&1 \
  | tee "$out/gpu_check.log"
