"""The multi-turn CPU task: scratchpad addition with a calculator tool, on the ~0.1M nano Qwen3.

  python -m jaxreplay.launch --config=configs/multiturn.py --workdir=runs/multiturn
  python -m jaxreplay.launch --config=configs/multiturn.py --config.rollout.backend=vllm ...
  python -m jaxreplay.experiments --sweep=multiturn --out=experiments

The task (`jaxreplay.tasks.calculator`) is configs/scratchpad.py's addition, but for any column
the policy may call the calculator ("7+9+1?" ends its turn, the environment answers "=17") and go
on from the answer in its next turn; a trajectory is one buffer row, the calculator's tokens
masked out of every loss (`jaxreplay.rollout.multiturn`). The shipped warm-start
`assets/calculator-sft` (rebuild: `python -m jaxreplay.sft --config=configs/multiturn.py
--out=assets/calculator-sft`) imitates a teacher who misremembers 30% of the column facts (as
configs/scratchpad.py's), calls the calculator on half of the columns at random and ignores its
answer 30% of the time: RL has to learn to call it and to use what it says. As built (600 steps,
19 min on the shared 2-core CPU): greedy held-out success 8.6% (256 problems), 2.7 calculator
calls per episode, 45% of them correct (the right column, its result used).

Measured (not yet a learnable setting): its success at temperature 1 is 1-4%, so most groups of 8
have one reward and no advantage; the 400-step replay run of this config (seed 0) raised the calls
per episode (2.0 -> 3.4) but not their use: eval pass@1 7.2% -> 3.9%, eval/env/tool_correct
46% -> 27% (sampler/trainer log-prob mismatch 0: the trajectories train as generated).

The schedule is configs/scratchpad.py's simulated replay pipeline; a multi-turn request costs one
prefill per turn and the tokens the policy generated (`run.schedules.base.GenerationCost`).
vLLM on CPU serves this model (head_dim 32).
"""
import os

from jaxreplay.config.defaults import base_config

_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")


def get_config():
  c = base_config()
  c.total_steps = 400
  c.model.preset = "nano"
  c.model.path = os.path.normpath(os.path.join(_ASSETS, "calculator-sft"))
  c.model.max_len = 64
  c.task.name = "calculator"
  c.task.num_digits = (2, 4)
  c.task.env_max_turns = 6          # at most 4 calls (one per column) + the final turn
  c.task.env_max_tokens = 64        # the longest trajectory (every column called) is 58 tokens
  c.task.env_step_timeout_s = 5.0
  c.rollout.backend = "jax"
  c.rollout.num_workers = 6
  c.rollout.group_size = 8
  c.rollout.prompts_per_request = 1
  c.rollout.max_tokens = 48         # per turn
  c.rollout.sampler_batch_size = 32
  c.buffer.size = 128
  c.buffer.batch_size = 32
  c.trainer.num_devices = 2
  c.trainer.learning_rate = 5e-5
  c.trainer.warmup_steps = 10
  c.trainer.schedule = "constant"
  c.trainer.buckets = (32, 48, 64)
  c.trainer.logprob_chunk = 64
  c.scheduler.kind = "simulated"
  c.scheduler.mu = 6.84
  c.scheduler.reference_tokens = 35.0
  c.eval.every = 50
  c.eval.num_problems = 256
  c.eval.n_samples = 8
  c.eval.ks = (1, 2, 4, 8)
  c.eval.top_p = 0.95
  c.checkpoint.every = 200
  c.log.every_s = 10.0
  c.sft.steps = 600
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.slip = 0.3
  c.sft.tool_rate = 0.5
  c.sft.ignore_rate = 0.3
  return c
