"""Qwen2.5-7B on OpenR1-Math-220k: the paper's main setting (N=84, (W,T)=(5,3), G=16, lr 6.8e-8).

  python -m jaxreplay.launch --config=configs/qwen2_5_7b.py --workdir=runs/q25_7b \
      --config.model.path=/models/Qwen2.5-7B --config.task.path=/data/openr1_math.parquet
"""
from jaxreplay.config.defaults import gpu_math_config


def get_config():
  return gpu_math_config("qwen2_5_7b", learning_rate=6.8e-8, mu=5.28)
