"""Environments: tasks whose problems are solved over several turns, each policy turn answered by
an environment (a tool is one kind), with time limits and plug-ins.

The protocol (duck-typed; `Environment` below documents it):

  env = factory()                        # a fresh environment per trajectory
  env.reset(problem) -> None | str       # the first observation: the problem's prompt (None: the
                                         # same); the policy's first turn answers it
  env.step(turn_text) -> (observation: str, reward: float, done: bool)
                                         # the policy's turn (decoded, without its end-of-turn
                                         # token); the observation is shown before its next turn
  env.metrics() -> {"tool_calls": int, "tool_correct": int, ...}   # optional, after the episode
  env.stop_texts: tuple[str, ...]        # optional: texts that end a policy turn besides eos (one
                                         # token each, e.g. "?" that closes a calculator call)
  env.observation_role: str              # optional: the chat-template role of observations
                                         # ("tool" by default)

A trajectory's reward is the sum of its steps' rewards. `rollout.multiturn.EpisodeRunner` drives
the turns on any rollout worker; this module only knows text.

Bad input never stops a run: `EnvCalls` runs every reset / step / metrics call in a daemon thread
with a time limit (`rewards._ThreadSlot`, as cheap reward functions run): a call that raises is an
error, one over the limit is a timeout (its thread is abandoned: a Python thread cannot be killed,
so an environment that may hang in C code or exhaust memory should do its work in a subprocess,
as `tasks.python_tool` does), and a step whose value is not (str, finite float, bool) is an error.
`check_step` is that check.

Plug-ins: `task.env_fn="module:factory"` (`import_env_factory`) makes any task's problems an
environment's; `spec_from_factory` builds one instance at start-up, so a factory that cannot be
imported or builds no environment fails before the run starts, naming the fix.
"""
from __future__ import annotations

import abc
import dataclasses
import math
import queue
import threading
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from jaxreplay.tasks import rewards as rewards_lib

# The per-episode statistics an environment's `metrics()` may report (others are ignored).
STAT_KEYS = ("tool_calls", "tool_correct")


class Environment(Protocol):
  """What an environment implements (see the module docstring)."""

  def reset(self, problem: Any) -> Optional[str]:
    """Starts an episode on `problem`; returns its first observation (its prompt) or None."""

  def step(self, turn: str) -> tuple[str, float, bool]:
    """The policy's turn -> (next observation, reward of this step, whether the episode ended)."""


class MalformedStep(ValueError):
  """An environment's step returned something other than (str, finite float, bool)."""


def check_step(value: Any) -> tuple[str, float, bool]:
  """`value` as (observation, reward, done); MalformedStep naming what is wrong otherwise."""
  if not isinstance(value, tuple) or len(value) != 3:
    raise MalformedStep(f"step returned {type(value).__name__} {str(value)[:80]!r}; expected a "
                        "tuple (observation: str, reward: float, done: bool)")
  obs, reward, done = value
  if not isinstance(obs, str):
    raise MalformedStep(f"step's observation is a {type(obs).__name__}, expected str")
  if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
    raise MalformedStep(f"step's reward {reward!r} is not a finite number")
  if not isinstance(done, bool):
    raise MalformedStep(f"step's done {done!r} is not a bool")
  return obs, float(reward), done


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """How a run's trajectories are made.

  factory: () -> a new environment (one per trajectory).
  max_turns: the policy's turns per trajectory at most (an episode still going after the last
    ends with finish reason "max_turns", keeping the rewards it got).
  max_tokens: the trajectory budget, prompt + turns + observations [tokens] (at most
    model.max_len; a longer trajectory ends with finish reason "budget" and reward 0).
  step_timeout_s: the time limit of one reset / step / metrics call [s] (over it: finish reason
    "env_timeout", reward 0, counted in env/timeouts).
  stop_texts: texts that end a policy turn besides the tokenizer's stop ids.
  observation_role: the chat-template role of observations.
  """
  factory: Callable[[], Any]
  max_turns: int
  max_tokens: int
  step_timeout_s: float
  stop_texts: tuple[str, ...] = ()
  observation_role: str = "tool"

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"task.env_max_turns={self.max_turns} must be >= 1")
    if self.max_tokens < 2:
      raise ValueError(f"task.env_max_tokens={self.max_tokens} must be >= 2 (one prompt token and "
                       "one generated)")
    if not self.step_timeout_s > 0:
      raise ValueError(f"task.env_step_timeout_s={self.step_timeout_s} must be > 0 [s]")


def import_env_factory(spec: str) -> Callable[[], Any]:
  """The environment factory named by `spec` = "module:factory" (`task.env_fn`); ValueError naming
  the fix when it cannot be imported or is not callable."""
  return rewards_lib.import_object(spec, "task.env_fn")


def spec_from_factory(factory: Callable[[], Any], max_turns: int, max_tokens: int,
                      step_timeout_s: float, name: str = "task.env_fn") -> EnvSpec:
  """An `EnvSpec` of `factory`, checked by building one environment now: it must have callable
  `reset` and `step`; its `stop_texts` and `observation_role` are read from it."""
  try:
    env = factory()
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"{name}: the factory raised {type(e).__name__}: {e}; it must build an "
                     "environment with no arguments") from e
  missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
  if missing:
    raise ValueError(f"{name}: the factory built a {type(env).__name__} without {missing}; an "
                     "environment has reset(problem) and step(turn_text) -> (observation, reward, "
                     "done) (jaxreplay.tasks.environments)")
  stop_texts = tuple(getattr(env, "stop_texts", ()) or ())
  if not all(isinstance(t, str) and t for t in stop_texts):
    raise ValueError(f"{name}: stop_texts={stop_texts!r} must be non-empty strings")
  close = getattr(env, "close", None)
  if callable(close):
    close()
  return EnvSpec(factory, int(max_turns), int(max_tokens), float(step_timeout_s), stop_texts,
                 str(getattr(env, "observation_role", "tool")))


def _invoke(fn: Callable[..., Any], *args) -> Any:
  return fn(*args)


class EnvCalls:
  """Calls environment methods with a time limit, over `num_threads` daemon threads (thread-safe:
  rollout threads share it; a caller waits for a free thread, which does not count against its
  limit).

  `call(fn, *args) -> (status, value)`: status "ok" (value: fn's result), "error" (value: the
  error text) or "timeout" (the thread is abandoned and replaced; value None).
  """

  def __init__(self, timeout_s: float, num_threads: int = 4):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s={timeout_s} must be > 0")
    self.timeout_s = float(timeout_s)
    self._free: queue.Queue = queue.Queue()
    for _ in range(max(int(num_threads), 1)):
      self._free.put(rewards_lib._ThreadSlot(_invoke, convert=None))  # pylint: disable=protected-access
    self._closed = False
    self._lock = threading.Lock()

  def call(self, fn: Callable[..., Any], *args) -> tuple[str, Any]:
    slot = self._free.get()
    try:
      return slot.call((fn,) + args, self.timeout_s)
    finally:
      self._free.put(slot)

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
    while not self._free.empty():
      self._free.get().close()


# ---- tools: one kind of environment ------------------------------------------------------------


class Tool(Protocol):
  """A tool: `parse(turn_text)` finds a call in the policy's turn (None: the turn calls no tool),
  `run(call)` returns the tool's output text (its observation)."""

  def parse(self, turn: str) -> Optional[Any]:
    ...

  def run(self, call: Any) -> str:
    ...


class ToolEnvironment(abc.ABC):
  """An environment of tools: each policy turn that calls a tool (the first tool whose `parse`
  finds a call) gets the tool's output as the next observation; a turn that calls none ends the
  episode, scored by `score(transcript, problem)` (the policy's turns and the observations, in
  order, as one text). Subclasses set `tools` and `score`, and may count `tool_correct` (calls
  whose result the answer used) in `metrics`.
  """

  tools: Sequence[Tool] = ()
  stop_texts: tuple[str, ...] = ()
  observation_role = "tool"

  def __init__(self):
    self.problem: Any = None
    self.transcript: list[str] = []
    self.calls: list[tuple[Any, str]] = []  # (call, output) in order

  def reset(self, problem: Any) -> Optional[str]:
    self.problem, self.transcript, self.calls = problem, [], []
    return None

  def step(self, turn: str) -> tuple[str, float, bool]:
    self.transcript.append(turn)
    for tool in self.tools:
      call = tool.parse(turn)
      if call is not None:
        out = tool.run(call)
        self.calls.append((call, out))
        self.transcript.append(out)
        return out, 0.0, False
    return "", float(self.score("".join(self.transcript), self.problem)), True

  @abc.abstractmethod
  def score(self, transcript: str, problem: Any) -> float:
    """The trajectory's reward in [0, 1] from its whole transcript (model turns and tool outputs)."""

  def metrics(self) -> Mapping[str, float]:
    return {"tool_calls": len(self.calls)}
