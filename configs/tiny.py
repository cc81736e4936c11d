"""The CPU default: a tiny Qwen3 (2 layers, head_dim 32) on 1-2 digit addition, in minutes.

  python -m jaxreplay.launch --config=configs/tiny.py --workdir=runs/tiny

Starts from the shipped supervised warm-start `assets/tiny-arith-sft` (rebuild it with
`python -m jaxreplay.sft --config=configs/tiny.py --out=assets/tiny-arith-sft`, ~6 min): trained on
demonstrations that often drop the carry, it is right on about half of the held-out problems; the RL
run (GRPO, replay buffer N=256, B=64) raises held-out pass@1 from 0.56 to about 0.87 in ~2 minutes.
The simulated scheduler models (W, T) = (4, 1) with the paper's mu for Qwen3-0.6B, so the buffer sees
the staleness of the real asynchronous pipeline; `--config.scheduler.kind=async` runs real threads.
"""
import os

from jaxreplay.config.defaults import base_config

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
  c.rollout.backend = "auto"       # vllm (one CPU engine) when installed, else the JAX sampler
  c.rollout.num_workers = 4
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 1  # small requests: workers desynchronise, as real ones do
  c.rollout.max_tokens = 6
  c.rollout.sampler_batch_size = 64
  c.buffer.size = 256
  c.buffer.batch_size = 64
  c.trainer.num_devices = 1
  c.trainer.learning_rate = 1e-4
  c.trainer.warmup_steps = 5
  c.trainer.schedule = "cosine"
  c.trainer.buckets = (16, 32)
  c.trainer.logprob_chunk = 32
  c.scheduler.kind = "simulated"
  c.scheduler.mu = 6.84
  c.eval.every = 50
  c.eval.num_problems = 512
  c.eval.n_samples = 16
  c.checkpoint.every = 50
  c.log.every_s = 5.0
  # The warm-start (`python -m jaxreplay.sft --config=configs/tiny.py`): noisy demonstrations in
  # which 60% of the additions that need a carry drop it ("47+38=" -> "75"), so the policy is right
  # about half the time on held-out problems and RL with the exact-match reward has the error to fix.
  c.sft.steps = 1200
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.carry_drop = 0.6
  return c
