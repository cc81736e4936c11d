"""Qwen2.5-7B on OpenR1-Math-220k: the paper's main setting (N=84, (W,T)=(5,3), G=16, lr 6.8e-8).

  python -m jaxreplay.launch --config=configs/qwen2_5_7b.py --workdir=runs/q25_7b \
      --config.model.path=/models/Qwen2.5-7B --config.task.path=/data/openr1_math.parquet
"""
from jaxreplay.config_defaults import base_config


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "qwen2_5_7b"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = True
  c.model.max_len = 4608
  c.task.name = "math"
  c.task.held_out = 500
  c.rollout.backend = "vllm"
  c.rollout.num_workers = 5            # W
  c.rollout.group_size = 16            # G
  c.rollout.prompts_per_request = 4
  c.rollout.max_tokens = 4096
  c.buffer.size = 84                   # N
  c.buffer.batch_size = 60             # B
  c.trainer.num_devices = 3            # T
  c.trainer.mesh_shape = (1, -1, 1)
  c.trainer.learning_rate = 6.8e-8
  c.trainer.num_microbatches = 15
  c.scheduler.kind = "async"
  c.scheduler.mu = 5.28                # measured by the paper for Qwen2.5-7B
  c.eval.every = 50
  c.checkpoint.every = 50
  return c
