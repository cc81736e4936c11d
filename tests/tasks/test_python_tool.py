"""The Python-executor tool for math (`tasks.python_tool`): calls parsed from a turn's trailing
block, the sandbox's output as the observation, math-verify on the final turn, the tool
statistics; configs/qwen3_8b_tools.py plans with --dry_run."""
import os
import subprocess
import sys

import pytest

from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import environments
from jaxreplay.tasks import python_tool
from tests.helpers.deps import require
from tests.helpers.paths import REPO

PROBLEM = arithmetic.Problem("What is 1^2 + ... + 10^2?", "385", 1)


def test_parse_calls():
  tool = python_tool.PythonTool()
  assert tool.parse("Let me compute.\n```python\nprint(1 + 1)\n```") == "print(1 + 1)\n"
  assert tool.parse("```python\nx = 2\nprint(x)\n```  \n") == "x = 2\nprint(x)\n"
  assert tool.parse("```python\nprint(1)\n``` and then more text") is None  # not at the end
  assert tool.parse("The answer is \\boxed{385}.") is None
  assert tool.parse("```\nprint(1)\n```") is None  # not a python block


def test_episode_with_a_call_then_the_answer():
  require("math_verify")
  env = python_tool.make_env()
  assert env.reset(PROBLEM) is None
  obs, reward, done = env.step("```python\nprint(sum(k * k for k in range(1, 11)))\n```")
  assert obs == "\n```output\n385\n```\n" and (reward, done) == (0.0, False)
  obs, reward, done = env.step("```python\nprint(1/0)\n```")
  assert "ZeroDivisionError" in obs and not done
  obs, reward, done = env.step("So the sum is \\boxed{385}.")
  assert (obs, reward, done) == ("", 1.0, True)
  assert env.metrics() == {"tool_calls": 2, "tool_correct": 1}
  env.reset(PROBLEM)
  assert env.step("The output 385 was wrong, it is \\boxed{384}.")[1:] == (0.0, True)
  assert env.metrics() == {"tool_calls": 0, "tool_correct": 0}


def test_factory_passes_the_start_up_check():
  spec = environments.spec_from_factory(python_tool.make_env, 4, 4608, 30.0,
                                        name="task.env_fn")
  assert spec.stop_texts == () and spec.observation_role == "tool"
  assert environments.import_env_factory("jaxreplay.tasks.python_tool:make_env") is (
      python_tool.make_env)


@pytest.mark.slow
def test_tool_config_plans_with_dry_run(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, "-m", "jaxreplay.launch", "--config=configs/qwen3_8b_tools.py",
         f"--workdir={tmp_path}", "--dry_run",
         f"--config.task.path={os.path.join(REPO, 'assets', 'math_example.jsonl')}"]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "qwen3_8b" in out.stdout and "per device" in out.stdout
  assert os.path.isfile(tmp_path / "plan.json")
