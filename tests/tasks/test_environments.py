"""The environment protocol (`tasks.environments`): the step check, time-limited calls, plug-in
factories and their start-up check, tool environments."""
import math
import time

import pytest

from jaxreplay.tasks import environments as envs
from tests.helpers import env_plugins

PLUGINS = "tests.helpers.env_plugins"


@pytest.mark.parametrize("value,expected", [
    (("obs", 0.0, False), ("obs", 0.0, False)),
    (("", 1, True), ("", 1.0, True)),  # an int reward is a number
    (("x", -2.5, True), ("x", -2.5, True)),
])
def test_check_step_accepts(value, expected):
  out = envs.check_step(value)
  assert out == expected and isinstance(out[1], float)


@pytest.mark.parametrize("value,match", [
    (["obs", 0.0, False], "expected a tuple"),
    (("obs", 0.0), "expected a tuple"),
    (None, "expected a tuple"),
    ((3, 0.0, False), "observation is a int"),
    ((b"obs", 0.0, False), "observation is a bytes"),
    (("obs", math.nan, False), "not a finite number"),
    (("obs", math.inf, True), "not a finite number"),
    (("obs", "1.0", True), "not a finite number"),
    (("obs", True, True), "not a finite number"),  # a bool is no reward
    (("obs", 0.0, 1), "done 1 is not a bool"),
])
def test_check_step_rejects(value, match):
  with pytest.raises(envs.MalformedStep, match=match):
    envs.check_step(value)


def test_env_calls_ok_error_timeout_and_recovery():
  calls = envs.EnvCalls(timeout_s=0.3, num_threads=2)
  try:
    assert calls.call(lambda a, b: a + b, 2, 3) == ("ok", 5)
    status, text = calls.call(env_plugins.raising_step().step, "turn")
    assert status == "error" and "the tool crashed" in text
    start = time.monotonic()
    assert calls.call(time.sleep, 5.0) == ("timeout", None)
    assert time.monotonic() - start < 3.0  # the caller is not held by the stuck call
    # The abandoned thread was replaced: every slot still answers.
    assert [calls.call(str, i) for i in range(4)] == [("ok", str(i)) for i in range(4)]
  finally:
    calls.close()
  with pytest.raises(ValueError, match="timeout_s"):
    envs.EnvCalls(0.0)


def test_spec_from_plugin_factory():
  factory = envs.import_env_factory(f"{PLUGINS}:countdown")
  spec = envs.spec_from_factory(factory, max_turns=3, max_tokens=32, step_timeout_s=1.0)
  assert (spec.max_turns, spec.max_tokens, spec.step_timeout_s) == (3, 32, 1.0)
  assert spec.stop_texts == () and spec.observation_role == "tool"
  assert isinstance(spec.factory(), env_plugins.Countdown)


@pytest.mark.parametrize("spec,match", [
    (f"{PLUGINS}", "expected 'module:function'"),
    (f"{PLUGINS}:", "expected 'module:function'"),
    ("no_such_module_xyz:factory", "cannot import module"),
    (f"{PLUGINS}:missing", "has no attribute 'missing'"),
    (f"{PLUGINS}:NOT_CALLABLE", "not a function"),
])
def test_import_env_factory_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    envs.import_env_factory(spec)


def test_spec_from_factory_checks_one_environment():
  with pytest.raises(ValueError, match="the factory raised OSError: cannot reach"):
    envs.spec_from_factory(env_plugins.raising_factory, 2, 32, 1.0)
  with pytest.raises(ValueError, match=r"without \['reset', 'step'\]"):
    envs.spec_from_factory(env_plugins.no_step, 2, 32, 1.0)

  class BadStops(env_plugins.Countdown):
    stop_texts = ("?", "")
  with pytest.raises(ValueError, match="stop_texts"):
    envs.spec_from_factory(BadStops, 2, 32, 1.0)
  for kwargs, match in [(dict(max_turns=0), "env_max_turns"), (dict(max_tokens=1), "env_max_tokens"),
                        (dict(step_timeout_s=0.0), "env_step_timeout_s")]:
    args = dict(max_turns=2, max_tokens=32, step_timeout_s=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
      envs.EnvSpec(env_plugins.countdown, **args)


class _Echo:
  """A tool: "echo:X" calls it, its output is "<X>"."""

  def parse(self, turn):
    return turn[5:] if turn.startswith("echo:") else None

  def run(self, call):
    return f"<{call}>"


class _EchoEnv(envs.ToolEnvironment):
  tools = (_Echo(),)

  def score(self, transcript, problem):
    return float(transcript == problem)


def test_tool_environment_turns_and_score():
  env = _EchoEnv()
  assert env.reset("echo:a<a>done") is None
  assert env.step("echo:a") == ("<a>", 0.0, False)
  assert env.step("done") == ("", 1.0, True)  # no call: the episode ends, scored on the transcript
  assert env.calls == [("a", "<a>")] and env.metrics() == {"tool_calls": 1}
  env.reset("x")
  assert env.step("echo:") == ("<>", 0.0, False)
  assert env.step("y") == ("", 0.0, True)
  assert env.transcript == ["echo:", "<>", "y"]
