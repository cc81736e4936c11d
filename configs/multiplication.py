"""The second task: 2-6 digit numbers times one digit, written out column by column, on a ~0.1M Qwen3.

  python -m jaxreplay.launch --config=configs/multiplication.py --workdir=runs/multiplication

A completion is a worked solution of 21-62 tokens with eos
("8*7+0=56,3*7+5=26,7*7+2=51,4*7+5=33;33166", `jaxreplay.tasks.multiplication`), rewarded 1 only
when every column and the result are right. Unlike the scratchpad addition (`configs/scratchpad.py`),
the length of a solution varies three-fold between problems and a problem's chance of being right
falls steeply with it, and the column facts (x, y, carry_in) RL must fix range from common (times 2:
20 facts) to rare (times 9: 90 facts). The shipped warm-start `assets/multiplication-sft` (rebuild:
`python -m jaxreplay.sft --config=configs/multiplication.py --out=assets/multiplication-sft`) is
trained on demonstrations that misremember a share `sft.slip` of the 640 column facts (x, y in 2..9,
carry_in in 0..9), each slipped to (x +- 1) * y + carry_in with its own probability in
`sft.slip_range`.

Everything else is `configs/scratchpad.py`'s: the asynchronous replay pipeline, simulated, at
(W, T) = (6, 2), mu = 6.84, a FIFO buffer of N = 128, batches of B = 32, a constant learning rate
after 10 warmup steps. Generation cost per rollout follows its tokens, the reference rollout fixed
at the warm-start's mean completion length on the held-out problems.
"""
import os

from jaxreplay.config.defaults import base_config

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")


def get_config():
  c = base_config()
  c.total_steps = 1000
  c.model.preset = "nano"
  c.model.path = os.path.normpath(os.path.join(_ASSETS, "multiplication-sft"))
  c.model.max_len = 80               # the longest prompt ("999999*9=", 9 tokens + bos) + 64
  c.task.name = "multiplication"
  c.task.num_digits = (2, 6)
  c.rollout.backend = "jax"
  c.rollout.num_workers = 6
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 1  # requests of 8 rollouts: workers desynchronise
  c.rollout.max_tokens = 64          # the longest worked solution is 61 tokens + eos
  c.rollout.sampler_batch_size = 32
  c.buffer.size = 128
  c.buffer.batch_size = 32
  c.trainer.num_devices = 2          # T of the simulated split (compute accounting only here)
  c.trainer.learning_rate = 5e-5
  c.trainer.warmup_steps = 10
  c.trainer.schedule = "constant"
  c.trainer.buckets = (48, 64, 80)
  c.trainer.logprob_chunk = 64
  c.scheduler.kind = "simulated"
  c.scheduler.mu = 6.84
  c.scheduler.reference_tokens = 46.2
  c.eval.every = 100
  c.eval.num_problems = 512
  c.eval.n_samples = 16
  c.eval.top_p = 0.95
  c.checkpoint.every = 200
  c.log.every_s = 10.0
  c.sft.steps = 1500
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.slip = 0.4
  c.sft.slip_range = (0.6, 0.95)
  return c
