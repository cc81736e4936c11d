"""The experiments' task: 2-4 digit addition written out column by column, on a ~0.1M Qwen3.

  python -m jaxreplay.launch --config=configs/scratchpad.py --workdir=runs/scratchpad
  python -m jaxreplay.experiments --sweep=fig1 --out=experiments     # the base of every sweep

A completion is a worked solution of ~35 tokens ("8+6+0=14,3+5+1=09,7+9+0=16,4+2+1=07;7694",
`jaxreplay.tasks.scratchpad`), rewarded 1 only when every column and the result are right, so
generation costs tens of decode steps per rollout, as in the paper's setting. The shipped warm-start
`assets/scratchpad-sft` (rebuild: `python -m jaxreplay.sft --config=configs/scratchpad.py
--out=assets/scratchpad-sft`) is trained on demonstrations that misremember 30% of the 200 column
facts (each slipped with its own probability in [0.4, 0.95]); it is right on about a third of the
held-out problems at T=0.1, and RL has many separate facts to fix, so accuracy keeps rising for
thousands of steps.

The default arm is the paper's asynchronous replay pipeline, simulated: (W, T) = (6, 2) at
mu = 6.84 (replay ratio mu T / W ~ 2.3), a FIFO buffer of N = 128 rollouts, batches of B = 32, a
constant learning rate after 10 warmup steps. Generation cost per rollout follows its tokens, with
the reference rollout fixed at 35 tokens so every run of a sweep prices tokens alike.
"""
import os

from jaxreplay.config.defaults import base_config

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "nano"
  c.model.path = os.path.normpath(os.path.join(_ASSETS, "scratchpad-sft"))
  c.model.max_len = 64
  c.task.name = "scratchpad"
  c.task.num_digits = (2, 4)
  c.rollout.backend = "jax"
  c.rollout.num_workers = 6
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 1  # requests of 8 rollouts: workers desynchronise
  c.rollout.max_tokens = 48          # the longest worked solution is 41 tokens + eos
  c.rollout.sampler_batch_size = 32
  c.buffer.size = 128
  c.buffer.batch_size = 32
  c.trainer.num_devices = 2          # T of the simulated split (compute accounting only here)
  c.trainer.learning_rate = 5e-5
  c.trainer.warmup_steps = 10
  c.trainer.schedule = "constant"
  c.trainer.buckets = (32, 48, 64)
  c.trainer.logprob_chunk = 64
  c.scheduler.kind = "simulated"
  c.scheduler.mu = 6.84
  c.scheduler.reference_tokens = 35.0
  c.eval.every = 100
  c.eval.num_problems = 512
  c.eval.n_samples = 16
  c.eval.top_p = 0.95
  c.checkpoint.every = 200
  c.log.every_s = 10.0
  c.sft.steps = 1000
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.slip = 0.3
  return c
