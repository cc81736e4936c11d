"""Multi-turn rollouts: trajectories of policy turns and environment observations, on any worker.

`EpisodeRunner.generate(worker, prompts, problems, n, sampling)` is a multi-turn `generate`: for
each prompt (problem) n trajectories, each with its own environment (`tasks.environments`):

  1. `env.reset(problem)` (must give the problem's prompt, or None: the same);
  2. the policy's turn is generated (`rollout.base.run_turns`: the JAX sampler carries its KV
     cache across turns, other workers get one request per turn with the conversation so far,
     vLLM with its prefix cache on); a turn ends at a stop id (eos, or one of the environment's
     `stop_texts`), at rollout.max_tokens or at the trajectory budget;
  3. `env.step(turn_text)` -> (observation, reward, done): the observation, through the chat
     template's turn (`TextCodec.encode_observation`), is appended and the next turn generated,
     until done, `max_turns` turns, or the budget.

Each trajectory is ONE `Completion` (so one buffer row, one `Rollout`): its `tokens` are the
policy's turns and the observations in order, `mask` 1 on the policy's tokens and 0 on the
observations (which collate turns into `completion_mask` 0: no loss, KL, entropy or correction
statistic sees them), `logprobs` the behaviour log-probs (0 on observations), `turn_starts` the
turn boundaries, `episode` an `EpisodeInfo` (reward, status, turns, tool calls, correct calls).
Its `finish_reason` is its status, one of `FINISH_REASONS`:

  "stop"         the environment said done (reward: the sum of its steps' rewards)
  "max_turns"    still going after `max_turns` turns (reward: the sum so far)
  "length"       a turn hit rollout.max_tokens before its end-of-turn (reward 0; the
                 environment does not see the cut turn)
  "budget"       the trajectory budget (`EnvSpec.max_tokens`, at most model.max_len) cut a turn
                 or left no room after an observation (reward 0; the observation is not appended:
                 a trajectory is cut between tokens it holds whole, never inside one)
  "env_error"    reset / step / metrics raised, returned a malformed value, or reset returned
                 another prompt (reward 0)
  "env_timeout"  one of them ran past `EnvSpec.step_timeout_s` (reward 0)

The worker's weights do not change during a call (the pool and the local worker refresh between
requests; the JAX sampler reads its params once), so every group carries one policy version.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxreplay.rollout.base import (Completion, Group, RolloutWorker, SamplingParams, TurnDriver,
                                    run_turns)
from jaxreplay.tasks import environments

FINISH_REASONS = ("stop", "max_turns", "length", "budget", "env_error", "env_timeout")
# Statuses whose trajectory keeps the environment's rewards (the others score 0).
_REWARDED = ("stop", "max_turns")


@dataclasses.dataclass
class EpisodeInfo:
  """One trajectory's outcome: reward, status (`FINISH_REASONS`), the policy's turns, the
  environment's statistics (`environments.STAT_KEYS`) and, for env_error, the error text."""
  reward: float
  status: str
  turns: int
  tool_calls: int = 0
  tool_correct: int = 0
  error: str = ""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class _Episode:
  """One trajectory's environment and its running outcome."""

  def __init__(self, runner: "EpisodeRunner", problem: Any):
    self.runner, self.problem = runner, problem
    self.reward, self.status, self.error = 0.0, "", ""
    self.env = None
    status, value = runner.calls.call(runner.spec.factory)
    if status != "ok":
      self.fail(status, value)
      return
    self.env = value
    status, value = runner.calls.call(self.env.reset, problem)
    if status != "ok":
      self.fail(status, value)
    elif value is not None and value != getattr(problem, "prompt", value):
      self.fail("error", f"reset returned {str(value)[:60]!r}, not the problem's prompt "
                         f"{str(problem.prompt)[:60]!r} (return None or the prompt)")

  @property
  def ended(self) -> bool:
    return bool(self.status)

  def fail(self, status: str, value: Any) -> None:
    self.status = "env_timeout" if status == "timeout" else "env_error"
    self.error = "" if status == "timeout" else str(value)[:300]

  def step(self, text: str, turn: int) -> Optional[str]:
    """The observation after the policy's turn `turn` (None: the episode ended)."""
    status, value = self.runner.calls.call(self.env.step, text)
    if status != "ok":
      self.fail(status, value)
      return None
    try:
      obs, reward, done = environments.check_step(value)
    except environments.MalformedStep as e:
      self.fail("error", e)
      return None
    self.reward += reward
    if done:
      self.status = "stop"
      return None
    if turn + 1 >= self.runner.spec.max_turns:
      self.status = "max_turns"
      return None
    return obs

  def info(self, turns: int) -> EpisodeInfo:
    stats = {}
    if self.env is not None and self.status in _REWARDED and hasattr(self.env, "metrics"):
      status, value = self.runner.calls.call(self.env.metrics)
      if status != "ok" or not isinstance(value, dict):
        self.fail(status if status != "ok" else "error",
                  value if status != "ok" else f"metrics returned {type(value).__name__}")
      else:
        stats = {k: int(value.get(k, 0)) for k in environments.STAT_KEYS}
    reward = self.reward if self.status in _REWARDED else 0.0
    return EpisodeInfo(reward=float(reward), status=self.status, turns=turns, error=self.error,
                       **stats)


class EpisodeRunner:
  """Runs multi-turn trajectories of one environment spec on rollout workers (module docstring).

  Args:
    spec: the `environments.EnvSpec` (factory, max_turns, budget, step time limit, stop texts).
    codec: the run's `TextCodec`: decodes turns, encodes observations per turn of the chat template.
    max_len: the workers' longest sequence (model.max_len): the budget is at most this.
    env_threads: threads the environments' calls run on (shared by the rollout threads).
  Thread-safe: several rollout threads may generate at once.
  """

  def __init__(self, spec: environments.EnvSpec, codec, max_len: int, env_threads: int = 4):
    self.spec, self.codec = spec, codec
    self.max_total = min(int(spec.max_tokens), int(max_len))
    stops = []
    for text in spec.stop_texts:
      ids = codec.encode(text, add_bos=False)
      if len(ids) != 1:
        raise ValueError(f"the environment's stop text {text!r} is {len(ids)} tokens with this "
                         "tokenizer; a turn can only end at one token: use a text the tokenizer "
                         "holds as one token (or end turns with the chat template's eos)")
      stops.append(int(ids[0]))
    self.turn_stop_ids = tuple(stops)
    self.calls = environments.EnvCalls(spec.step_timeout_s, env_threads)

  def sampling(self, sampling: SamplingParams) -> SamplingParams:
    """`sampling` with the environment's turn-ending tokens among its stop ids."""
    stops = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + self.turn_stop_ids))
    return dataclasses.replace(sampling, stop_token_ids=stops)

  def generate(self, worker: RolloutWorker, prompts: Sequence[np.ndarray],
               problems: Sequence[Any], n: int, sampling: SamplingParams) -> list[Group]:
    """n trajectories per prompt (int32 [Lp], the problem's encoded prompt); one Group per
    prompt, in order, each completion a whole trajectory (module docstring)."""
    if len(problems) != len(prompts):
      raise ValueError(f"{len(problems)} problems for {len(prompts)} prompts")
    version = int(worker.policy_version)
    episodes = [_Episode(self, problems[r // n]) for r in range(len(prompts) * n)]

    def respond(turn: int, rows: list[int], turns: list[Completion]) -> list[Optional[np.ndarray]]:
      out = []
      for r, t in zip(rows, turns):
        ep = episodes[r]
        if not ep.ended and t.finish_reason in ("length", "budget"):
          ep.status = t.finish_reason  # a cut turn is not shown to the environment
        if ep.ended:
          out.append(None)
          continue
        obs = ep.step(self.codec.decode(t.tokens), turn)
        out.append(None if obs is None else
                   self.codec.encode_observation(obs, self.spec.observation_role))
      return out

    driver = TurnDriver([len(p) for p in prompts], n, sampling.max_tokens, self.max_total, respond)
    run_turns(worker, prompts, n, self.sampling(sampling), driver)
    completions = []
    for ep, c in zip(episodes, driver.completions()):
      if not ep.ended:  # the driver ended it: no room for the next turn
        ep.status = c.finish_reason
      info = ep.info(c.num_turns)
      close = getattr(ep.env, "close", None)
      if callable(close):
        self.calls.call(close)
      completions.append(dataclasses.replace(c, finish_reason=info.status, episode=info))
    return [Group(prompt_tokens=np.asarray(prompts[i], np.int32),
                  completions=completions[i * n:(i + 1) * n], policy_version=version,
                  prompt_index=i) for i in range(len(prompts))]

  def close(self) -> None:
    self.calls.close()


@dataclasses.dataclass(frozen=True)
class Episodes:
  """A multi-turn request's episodes: its runner and one problem per prompt (`PromptBatch.
  episodes`; `rollout.base.generate_request` runs it)."""
  runner: EpisodeRunner
  problems: tuple

  def generate(self, worker: RolloutWorker, prompts: Sequence[np.ndarray], n: int,
               sampling: SamplingParams) -> list[Group]:
    return self.runner.generate(worker, prompts, self.problems, n, sampling)

  def __add__(self, other: "Episodes") -> "Episodes":
    """The episodes of two requests generated in one call (same runner)."""
    if other.runner is not self.runner:
      raise ValueError("episodes of different runners cannot share a call")
    return Episodes(self.runner, self.problems + other.problems)


# ---- statistics of trajectories ----------------------------------------------------------------

COUNT_KEYS = ("env/episodes", "env/errors", "env/timeouts", "env/budget_cuts", "env/tool_calls")


def episode_infos(groups: Sequence[Group]) -> list[EpisodeInfo]:
  """The `EpisodeInfo` of every trajectory of `groups` (none for single-turn groups)."""
  return [c.episode for g in groups for c in g.completions if c.episode is not None]


def counts(infos: Sequence[EpisodeInfo]) -> dict[str, int]:
  """COUNT_KEYS of `infos`: trajectories, env errors, env timeouts, budget cuts, tool calls."""
  return {"env/episodes": len(infos),
          "env/errors": sum(i.status == "env_error" for i in infos),
          "env/timeouts": sum(i.status == "env_timeout" for i in infos),
          "env/budget_cuts": sum(i.status == "budget" for i in infos),
          "env/tool_calls": sum(i.tool_calls for i in infos)}


def means(infos: Sequence[EpisodeInfo], prefix: str = "env/") -> dict[str, float]:
  """Per-trajectory means of `infos` (NaN without any): turns_mean, tool_calls_mean, tool_correct
  (correct calls / calls; NaN without a call), finish fractions (stop_fraction, ...)."""
  nan = float("nan")
  n = len(infos)
  calls = sum(i.tool_calls for i in infos)
  out = {f"{prefix}turns_mean": sum(i.turns for i in infos) / n if n else nan,
         f"{prefix}tool_calls_mean": calls / n if n else nan,
         f"{prefix}tool_correct": sum(i.tool_correct for i in infos) / calls if calls else nan}
  for status in FINISH_REASONS:
    out[f"{prefix}{status}_fraction"] = (sum(i.status == status for i in infos) / n if n
                                         else nan)
  return out
