"""Llama 3.2 3B on math (rope scaling of type llama3). Learning rate between the paper's two.

  python -m jaxreplay.launch --config=configs/llama3_2_3b.py --workdir=runs/l32_3b \
      --config.model.path=/models/Llama-3.2-3B-Instruct --config.task.path=/data/math.jsonl
"""
from jaxreplay.config_defaults import base_config


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "llama3_2_3b"
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.model.max_len = 4608
  c.task.name = "math"
  c.task.held_out = 500
  c.rollout.backend = "vllm"
  c.rollout.num_workers = 5
  c.rollout.group_size = 16
  c.rollout.max_tokens = 4096
  c.buffer.size = 84
  c.buffer.batch_size = 60
  c.trainer.num_devices = 3
  c.trainer.learning_rate = 1.5e-7
  c.trainer.num_microbatches = 8
  c.scheduler.kind = "async"
  c.scheduler.mu = 5.28
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
