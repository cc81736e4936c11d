"""The CPU default: a tiny Qwen3 (2 layers, head_dim 32) on 1-2 digit addition, in minutes.

  python -m jaxreplay.launch --config=configs/tiny.py --workdir=runs/tiny

Starts from the shipped supervised warm-start `assets/tiny-arith-sft` (rebuild it with
`python -m jaxreplay.sft --config=configs/tiny.py --out=assets/tiny-arith-sft`).
The simulated scheduler models (W, T) = (4, 1) with the paper's mu for Qwen3-0.6B, so the buffer sees
the staleness of the real asynchronous pipeline; `--config.scheduler.kind=async` runs real threads.
"""
import os

from jaxreplay.config_defaults import base_config

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")


def get_config():
  c = base_config()
  c.total_steps = 400
  c.model.preset = "tiny"
  c.model.path = os.path.normpath(os.path.join(_ASSETS, "tiny-arith-sft"))
  c.model.max_len = 32
  c.task.name = "arithmetic"
  c.task.num_digits = (1, 2)
  c.task.ops = "+"
  c.task.held_out = 128
  c.rollout.backend = "jax"
  c.rollout.num_workers = 4
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 8
  c.rollout.max_tokens = 6
  c.rollout.sampler_batch_size = 64
  c.buffer.size = 256
  c.buffer.batch_size = 64
  c.trainer.num_devices = 1
  c.trainer.learning_rate = 5e-5
  c.trainer.warmup_steps = 5
  c.trainer.buckets = (16, 32)
  c.trainer.logprob_chunk = 32
  c.scheduler.kind = "simulated"
  c.scheduler.mu = 6.84
  c.eval.every = 50
  c.eval.num_problems = 128
  c.eval.n_samples = 16
  c.checkpoint.every = 50
  c.log.every_s = 5.0
  return c
