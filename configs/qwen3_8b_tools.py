"""Qwen3-8B on math with a Python executor tool (multi-turn; issue 38): configs/qwen3_8b.py, whose
math problems become episodes of `jaxreplay.tasks.python_tool`'s environment.

  python -m jaxreplay.launch --config=configs/qwen3_8b_tools.py --workdir=runs/q3_8b_tools \
      --config.model.path=/models/Qwen3-8B --config.task.path=/data/openr1_math.parquet
  python -m jaxreplay.launch --config=configs/qwen3_8b_tools.py --dry_run --workdir=/tmp/plan

A policy turn ending in a ```python block runs it in a sandboxed subprocess (5 s, 1 GiB of address
space, no file or network access: `jaxreplay.tasks.sandbox`); its output is the next observation,
a tool message of the chat template. A turn without a block is the answer, scored by math-verify.
A trajectory holds at most model.max_len tokens (prompt, turns, outputs: the memory plan's rows are
unchanged), each turn at most rollout.max_tokens; the tool's tokens are masked out of every loss.
"""
import os
import runpy

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_8b.py")


def get_config():
  c = runpy.run_path(_BASE)["get_config"]()
  c.task.env_fn = "jaxreplay.tasks.python_tool:make_env"
  c.task.env_max_turns = 4          # up to 3 tool calls, then the answer
  c.task.env_max_tokens = 0         # = model.max_len
  c.task.env_step_timeout_s = 30.0  # above the tool's 5 s (and math-verify's scoring)
  c.rollout.max_tokens = 2048       # per turn
  return c
