"""Environment plug-ins for the tests (`task.env_fn="tests.helpers.env_plugins:NAME"`), good and
broken: each factory takes no arguments and builds a fresh environment (`tasks.environments`).

`Countdown` is a well-behaved two-turn game: its first step answers "=", its second ends the
episode with reward 1.0 when the turn is the problem's answer's first character (texts within the
arithmetic tasks' character set). The broken ones
misbehave at a chosen call: `raising_step`, `hanging_step` (sleeps `HANG_S`), `malformed_step`
(a list instead of a tuple), `nan_reward_step`, `raising_reset`, `other_prompt_reset`,
`raising_metrics`, `raising_factory`; `no_step` builds an object without `step`.
"""
import time

HANG_S = 30.0


class Countdown:
  """Two turns: "=" after the first, reward 1.0 when the second is the answer's first char."""

  stop_texts = ()
  observation_role = "tool"

  def __init__(self):
    self.problem, self.turns = None, []

  def reset(self, problem):
    self.problem, self.turns = problem, []
    return None

  def step(self, turn):
    self.turns.append(turn)
    if len(self.turns) == 1:
      return "=", 0.0, False
    return "", float(turn[:1] == self.problem.answer[:1]), True

  def metrics(self):
    return {"tool_calls": len(self.turns) - 1, "tool_correct": 0}


class _Broken(Countdown):
  """Countdown, but `fail()` replaces its `bad_call` (reset, step or metrics)."""

  bad_call = ""

  def _maybe_fail(self, call):
    if call == self.bad_call:
      return self.fail()
    return None

  def reset(self, problem):
    out = self._maybe_fail("reset")
    return super().reset(problem) if out is None else out

  def step(self, turn):
    out = self._maybe_fail("step")
    return super().step(turn) if out is None else out

  def metrics(self):
    self._maybe_fail("metrics")
    return super().metrics()


class _RaisingStep(_Broken):
  bad_call = "step"

  def fail(self):
    raise RuntimeError("the tool crashed")


class _HangingStep(_Broken):
  bad_call = "step"

  def fail(self):
    time.sleep(HANG_S)
    return "", 1.0, True


class _MalformedStep(_Broken):
  bad_call = "step"

  def fail(self):
    return ["=", 0.0, False]


class _NanRewardStep(_Broken):
  bad_call = "step"

  def fail(self):
    return "", float("nan"), True


class _RaisingReset(_Broken):
  bad_call = "reset"

  def fail(self):
    raise KeyError("no such problem")


class _OtherPromptReset(_Broken):
  bad_call = "reset"

  def fail(self):
    return "a different prompt"


class _RaisingMetrics(_Broken):
  bad_call = "metrics"

  def fail(self):
    raise ValueError("no metrics today")


def countdown():
  return Countdown()


def raising_step():
  return _RaisingStep()


def hanging_step():
  return _HangingStep()


def malformed_step():
  return _MalformedStep()


def nan_reward_step():
  return _NanRewardStep()


def raising_reset():
  return _RaisingReset()


def other_prompt_reset():
  return _OtherPromptReset()


def raising_metrics():
  return _RaisingMetrics()


def raising_factory():
  raise OSError("cannot reach the environment server")


def no_step():
  return object()


NOT_CALLABLE = 3
