"""Long-tailed completion lengths: scratchpad addition of 1-8 digit operands with a geometric tail.

  python -m jaxreplay.launch --config=configs/scratchpad_longtail.py --workdir=runs/longtail
  python -m jaxreplay.launch --config=configs/scratchpad_longtail.py --workdir=runs/longtail_partial \
      --config.rollout.partial=continue

The task of partial rollouts (`rollout.partial`, docs/multiturn.md, bench/bench_partial.py):
each operand's digit count d is drawn with P(d) ~ 0.6^(d - 1) (`task.digit_decay`), and a worked
solution holds 10 max(d_a, d_b) + 1 tokens (+ eos), so completions run from 12 to 82 tokens with
a mean near 30: most requests are short and a few are long, and a whole-request call runs at the
width of its longest completion. The shipped warm-start `assets/scratchpad-longtail-sft`
(rebuild: `python -m jaxreplay.sft --config=configs/scratchpad_longtail.py
--out=assets/scratchpad-longtail-sft`) is trained on the same noisy teacher as configs/scratchpad.py
(30% of the column facts misremembered).

The default is the real asynchronous pipeline (workers beside the trainer): W = 2 JAX workers, each
holding 4 requests of 8 rollouts in flight, refreshed every step.
"""
import os

from jaxreplay.config.defaults import base_config

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")


def get_config():
  c = base_config()
  c.total_steps = 60
  c.model.preset = "nano"
  c.model.path = os.path.normpath(os.path.join(_ASSETS, "scratchpad-longtail-sft"))
  c.model.max_len = 112              # the longest prompt (18) + worked solution (82) + eos
  c.task.name = "scratchpad"
  c.task.num_digits = (1, 8)
  c.task.digit_decay = 0.6
  c.rollout.backend = "jax"
  c.rollout.num_workers = 2
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 1
  c.rollout.prompts_in_flight = 4    # 4 requests (32 rollouts) per worker call
  c.rollout.max_tokens = 88
  c.rollout.sampler_batch_size = 32
  c.rollout.partial_chunk_tokens = 16
  c.buffer.size = 128
  c.buffer.batch_size = 32
  c.trainer.num_devices = 1
  c.trainer.learning_rate = 5e-5
  c.trainer.warmup_steps = 5
  c.trainer.schedule = "constant"
  c.trainer.buckets = (32, 64, 112)
  c.trainer.logprob_chunk = 112
  c.scheduler.kind = "async"
  c.eval.every = 20
  c.eval.num_problems = 128
  c.eval.n_samples = 4
  c.eval.ks = (1, 2, 4)
  c.eval.top_p = 0.95
  c.checkpoint.every = 20
  c.log.every_s = 10.0
  c.sft.steps = 1000
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.slip = 0.3
  return c
