"""Qwen3-0.6B on math (paper: lr 3.37e-7, mu ~ 6.84).

  python -m jaxreplay.launch --config=configs/qwen3_0_6b.py --workdir=runs/q3_06b \
      --config.model.path=/models/Qwen3-0.6B --config.task.path=/data/math.jsonl

Fits an H100 80GB at (W, T) = (5, 3) by XLA's own count (`--dry_run --compile_for=h100`;
bench/gpu_compile.py) with nothing traded.
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  return gpu_math_config("qwen3_0_6b", learning_rate=3.37e-7, mu=6.84)
