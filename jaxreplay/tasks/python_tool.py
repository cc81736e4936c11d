"""A Python-executor tool for math: the tool-use variant of the GPU math configs.

  --config.task.env_fn=jaxreplay.tasks.python_tool:make_env   (configs/qwen3_8b_tools.py)

The math task's problems become episodes of `PythonToolEnv`: a policy turn that ends with a fenced
block

  ```python
  print(sum(k * k for k in range(1, 11)))
  ```

calls the tool: the block runs in a fresh sandboxed subprocess (`sandbox.run_python`: a time limit,
an address-space limit, no file or network access) and its output comes back as the next
observation, "```output\\n385\\n```" (an error's last line, or the time limit's message, likewise).
A turn without a trailing block ends the episode, scored by math-verify on that turn against the
problem's answer (`rewards.math_verify_reward`: its boxed answer). The episode's statistics:
tool_calls, and tool_correct = calls whose code ran without error.

Each call costs one interpreter start (~0.1 s on CPU): keep task.env_step_timeout_s above
TIMEOUT_S plus that.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from jaxreplay.tasks import environments
from jaxreplay.tasks import rewards
from jaxreplay.tasks import sandbox

TIMEOUT_S = 5.0        # wall-clock limit of one call [s]
MEMORY_MIB = 1024      # address space of one call's interpreter [MiB]
MAX_OUTPUT = 1000      # characters of output shown to the policy

# A fenced python block at the very end of a turn (trailing whitespace allowed).
_CALL = re.compile(r"```python\n(?P<code>.*?)```\s*$", re.DOTALL)


class PythonTool:
  """`parse(turn)`: the code of the turn's trailing ```python block (None: no call);
  `run(code)`: the sandbox's output as an ```output block."""

  def __init__(self, timeout_s: float = TIMEOUT_S, memory_mib: int = MEMORY_MIB,
               max_output: int = MAX_OUTPUT):
    self.timeout_s, self.memory_mib, self.max_output = timeout_s, memory_mib, max_output
    self.last_status: Optional[str] = None

  def parse(self, turn: str) -> Optional[str]:
    m = _CALL.search(turn)
    return None if m is None else m.group("code")

  def run(self, code: str) -> str:
    result = sandbox.run_python(code, self.timeout_s, self.memory_mib, self.max_output)
    self.last_status = result.status
    return f"\n```output\n{result.output}\n```\n"


class PythonToolEnv(environments.ToolEnvironment):
  """Math with a Python executor (module docstring)."""

  observation_role = "tool"

  def __init__(self, tool: Optional[PythonTool] = None):
    super().__init__()
    self.tools = (tool or PythonTool(),)
    self.statuses: list[str] = []

  def reset(self, problem: Any) -> Optional[str]:
    self.statuses = []
    return super().reset(problem)

  def step(self, turn: str) -> tuple[str, float, bool]:
    out = super().step(turn)
    if not out[2]:
      self.statuses.append(self.tools[0].last_status)
    return out

  def score(self, transcript: str, problem: Any) -> float:
    del transcript  # the answer is the last turn's (tool outputs may hold other numbers)
    return rewards.math_verify_reward(self.transcript[-1], problem.answer)

  def metrics(self) -> Mapping[str, float]:
    return {"tool_calls": len(self.calls),
            "tool_correct": sum(s == "ok" for s in self.statuses)}


def make_env() -> PythonToolEnv:
  """The factory of `task.env_fn="jaxreplay.tasks.python_tool:make_env"`."""
  return PythonToolEnv()
