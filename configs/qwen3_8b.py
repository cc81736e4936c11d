"""Qwen3-8B on math. The paper reports Qwen3-8B runs without a learning rate: we use Qwen2.5-7B's.

  python -m jaxreplay.launch --config=configs/qwen3_8b.py --workdir=runs/q3_8b \
      --config.model.path=/models/Qwen3-8B --config.task.path=/data/openr1_math.parquet \
      --config.buffer.size=84
"""
from jaxreplay.config_defaults import base_config


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "qwen3_8b"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.model.max_len = 4608
  c.task.name = "math"
  c.task.held_out = 500
  c.rollout.backend = "vllm"
  c.rollout.num_workers = 5
  c.rollout.group_size = 16
  c.rollout.prompts_per_request = 4
  c.rollout.max_tokens = 4096
  c.buffer.size = 84
  c.buffer.batch_size = 60
  c.trainer.num_devices = 3
  c.trainer.learning_rate = 6.8e-8
  c.trainer.num_microbatches = 15
  c.scheduler.kind = "async"
  c.scheduler.mu = 5.28
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
