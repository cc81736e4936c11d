"""Qwen3-0.6B on math (paper: lr 3.37e-7, mu ~ 6.84).

  python -m jaxreplay.launch --config=configs/qwen3_0_6b.py --workdir=runs/q3_06b \
      --config.model.path=/models/Qwen3-0.6B --config.task.path=/data/math.jsonl
"""
from jaxreplay.config_defaults import base_config


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "qwen3_0_6b"
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
  c.trainer.learning_rate = 3.37e-7
  c.trainer.num_microbatches = 4
  c.scheduler.kind = "async"
  c.scheduler.mu = 6.84
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
