"""Llama 3.2 3B on math (rope scaling of type llama3). Learning rate between the paper's two.

  python -m jaxreplay.launch --config=configs/llama3_2_3b.py --workdir=runs/l32_3b \
      --config.model.path=/models/Llama-3.2-3B-Instruct --config.task.path=/data/math.jsonl

Fits an H100 80GB at (W, T) = (5, 3) by XLA's own count (`--dry_run --compile_for=h100`;
bench/gpu_compile.py) with nothing traded.
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  return gpu_math_config("llama3_2_3b", learning_rate=1.5e-7, mu=5.28)
