"""The multi-turn CPU task: scratchpad addition with a calculator tool, on the ~0.1M nano Qwen3.

  python -m jaxreplay.launch --config=configs/multiturn.py --workdir=runs/multiturn
  python -m jaxreplay.launch --config=configs/multiturn.py --config.rollout.backend=vllm ...
  python -m jaxreplay.experiments --sweep=multiturn --out=experiments

The task (`jaxreplay.tasks.calculator`) is configs/scratchpad.py's addition (2-3 digit operands
here), but for any column the policy may call the calculator ("7+9+1?" ends its turn, the
environment answers "=17") and go on from the answer in its next turn; a trajectory is one buffer
row, the calculator's tokens masked out of every loss (`jaxreplay.rollout.multiturn`). The shipped
warm-start `assets/calculator-sft` (rebuild: `python -m jaxreplay.sft --config=configs/multiturn.py
--out=assets/calculator-sft`; 2000 steps, 22 min on the shared 2-core CPU) imitates a teacher who
misremembers 30% of the column facts (as configs/scratchpad.py's), calls the calculator on half of
the columns at random and ignores its answer 30% of the time: RL has to learn to call it where
its own facts are wrong, and to use what it says. As built: held-out pass@1 (T = 0.1, 256
problems) 0.657, at T = 1 0.708, 1.0 calculator calls per episode (2.8 columns), every call it
makes right and used (eval/env/tool_correct 0.999).

Measured (seed 0, replay, lr 5e-5): RL learns to call the calculator on every column (calls per
episode 1.03 -> 2.81 by step 50) and held-out pass@1 rises 0.657 -> 0.986 (step 50) -> 1.000
(step 100); at 3x the rate (1.5e-4) it peaks at 0.996 (step 50) and then declines to 0.874
(step 250) as its entropy collapses (0.086 -> 0.005). The first warm-start (600 SFT steps on 2-4
digit operands) was too weak to learn from: pass@1 0.169 on 2-3 digits, 0.035 at T = 1, most
errors in copying the operands' digits and the result, which the tool does not help with.

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
  c.task.num_digits = (2, 3)
  c.task.env_max_turns = 6          # at most 3 calls (one per column) + the final turn, 2 spare
  c.task.env_max_tokens = 64        # the longest trajectory (every column called) is 44 tokens
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
  c.sft.steps = 2000
  c.sft.batch = 128
  c.sft.learning_rate = 3e-3
  c.sft.slip = 0.3
  c.sft.tool_rate = 0.5
  c.sft.ignore_rate = 0.3
  return c
