"""Qwen3-8B on math. The paper reports Qwen3-8B runs without a learning rate: we use Qwen2.5-7B's.

  python -m jaxreplay.launch --config=configs/qwen3_8b.py --workdir=runs/q3_8b \
      --config.model.path=/models/Qwen3-8B --config.task.path=/data/openr1_math.parquet \
      --config.buffer.size=84
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  return gpu_math_config("qwen3_8b", learning_rate=6.8e-8, mu=5.28)
