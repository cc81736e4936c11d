"""Experience: prompts out to the rollout workers, scored rollouts with advantages into the buffer.

  PromptSource  the deterministic, resumable stream of training problems;
  Intake        request intake for both schedules: `next_request` hands out a `PromptBatch`
                (or None while an on-policy queue is full), `deliver` scores a request's groups
                and adds their rollouts to the buffer (`score` alone, outside any lock, lets
                concurrent deliveries score in parallel), `dropped` re-queues the prompts of a
                lost request; it counts rollouts in flight, numbers groups and keeps fresh rewards;
  score_groups / to_rollouts / groups_to_rollouts  decode, score, group-relative advantages.

Multi-turn tasks (an `EpisodeRunner`, `rollout.multiturn`): each request carries its `Episodes`
(`PromptBatch.episodes`), a completion is a whole trajectory scored by its environment
(`EpisodeInfo.reward`), its rollout keeps the trajectory's mask and turn boundaries, and the
intake counts the trajectories' statistics for the metrics rows (`env_metrics`).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

from absl import logging
import numpy as np

from jaxreplay.learner import algorithms
from jaxreplay.learner.batch import Rollout
from jaxreplay.rollout.base import Group, SamplingParams
from jaxreplay.rollout.base import PoolStopped, PromptBatch
from jaxreplay.rollout import multiturn


def make_advantage_fn(loss: str, options: Any = None) -> Callable:
  """rewards float32 [P, G] -> advantages float32 [P, G] of `algorithms.ALGORITHMS[loss]`.

  options: that algorithm's options dataclass (`algorithms.options_from_config(config.trainer)`,
  or the run's `loss_fn.LossFn.options`); None: its defaults.
  """
  algorithms.get(loss)  # an unknown name fails here, not at the first delivery
  return lambda r: np.asarray(algorithms.advantages(loss, r, options), np.float32)


def score_groups(groups: Sequence[Group], problems: Sequence[Any], task, codec) -> np.ndarray:
  """Decodes every completion and scores it against its problem: rewards float32 [P, G].

  groups[i] holds the G completions of problems[i]; all groups must have the same G. Multi-turn
  trajectories (completions with an `episode`) were scored by their environment: its reward.
  """
  if len(groups) != len(problems):
    raise ValueError(f"{len(groups)} groups for {len(problems)} problems")
  sizes = {len(g.completions) for g in groups}
  if len(sizes) != 1:
    raise ValueError(f"groups have different sizes {sorted(sizes)}")
  if all(c.episode is not None for g in groups for c in g.completions):
    return np.asarray([[c.episode.reward for c in g.completions] for g in groups],
                      np.float32).reshape(len(groups), -1)
  texts, owners = [], []
  for g, p in zip(groups, problems):
    for c in g.completions:
      texts.append(codec.decode(c.tokens))
      owners.append(p)
  return np.asarray(task.score_batch(texts, owners), np.float32).reshape(len(groups), -1)


def to_rollouts(groups: Sequence[Group], rewards: np.ndarray, advantages: np.ndarray,
                group_ids: Sequence[int]) -> list[Rollout]:
  """One `Rollout` per completion; rewards and advantages float32 [P, G], one group id per group."""
  if len(groups) != len(group_ids):
    raise ValueError(f"{len(groups)} groups for {len(group_ids)} group ids")
  rollouts = []
  for i, (g, gid) in enumerate(zip(groups, group_ids)):
    for j, c in enumerate(g.completions):
      rollouts.append(Rollout(prompt_tokens=g.prompt_tokens, completion_tokens=c.tokens,
                              logprobs=c.logprobs, reward=float(rewards[i, j]),
                              advantage=float(advantages[i, j]),
                              policy_version=_oldest(g, c), group_id=int(gid),
                              token_versions=c.versions, completion_mask=c.mask,
                              turn_starts=c.turn_starts))
  return rollouts


def _oldest(group: Group, completion) -> int:
  """A rollout's policy version: its oldest token's (a completion continued across refreshes
  carries each token's, `Completion.versions`), else its group's."""
  if completion.versions is None:
    return int(group.policy_version)
  return int(np.min(completion.versions))


def groups_to_rollouts(groups: Sequence[Group], problems: Sequence[Any], task, codec,
                       advantage_fn: Callable, group_ids: Sequence[int]):
  """Scores every completion and returns (rollouts, rewards float32 [P, G])."""
  if len(groups) != len(group_ids):
    raise ValueError(f"{len(groups)} groups for {len(problems)} problems / {len(group_ids)} ids")
  rewards = score_groups(groups, problems, task, codec)
  return to_rollouts(groups, rewards, advantage_fn(rewards), group_ids), rewards


class PromptSource:
  """The stream of training problems: problem i = task.sample(default_rng([seed, i]), 1)[0].

  `take` hands out the next indices (re-issuing first any that were handed out but never delivered,
  e.g. in flight when the previous run died); `delivered` marks them done. The state (cursor +
  pending) is checkpointed with the buffer, so a resumed run neither skips nor repeats prompts.
  Thread-safe.
  """

  def __init__(self, task, seed: int):
    self.task, self.seed = task, int(seed)
    self._cursor = 0
    self._pending: dict[int, None] = {}   # handed out, not yet delivered (insertion ordered)
    self._requeue: list[int] = []
    self._lock = threading.Lock()

  def problem(self, index: int):
    return self.task.sample(np.random.default_rng([self.seed, int(index)]), 1)[0]

  def take(self, n: int) -> list[tuple[int, Any]]:
    with self._lock:
      idx = self._requeue[:n]
      del self._requeue[:n]
      while len(idx) < n:
        idx.append(self._cursor)
        self._cursor += 1
      for i in idx:
        self._pending[i] = None
    return [(i, self.problem(i)) for i in idx]

  def delivered(self, indices: Sequence[int]) -> None:
    with self._lock:
      for i in indices:
        self._pending.pop(int(i), None)

  def dropped(self, indices: Sequence[int]) -> None:
    """Requests that were lost (a worker died): hand these prompts out again."""
    with self._lock:
      for i in indices:
        if self._pending.pop(int(i), "gone") is None:
          self._requeue.append(int(i))

  def restore_in_flight(self, indices: Sequence[int]) -> None:
    """A resumed run re-creates requests that were in flight at its checkpoint (their completions
    were saved): these indices are pending again, not handed out a second time."""
    with self._lock:
      for i in indices:
        i = int(i)
        if i in self._requeue:
          self._requeue.remove(i)
        self._pending[i] = None

  def state_dict(self) -> dict[str, Any]:
    with self._lock:
      # Sorted: the same set of pending prompts saves the same way, however it was reached (an
      # uninterrupted run, or one whose in-flight requests were restored from a checkpoint).
      return {"cursor": self._cursor, "pending": sorted({*self._requeue, *self._pending})}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    with self._lock:
      self._cursor = int(state["cursor"])
      self._pending = {}
      self._requeue = [int(i) for i in state["pending"]]


class Intake:
  """Request intake and experience building, shared by both schedules (thread-safe).

  Args:
    task: scores completions (`score_batch`); codec: encodes prompts, decodes completions.
    prompts: the `PromptSource`; buffer: the `ReplayBuffer` that rollouts are added to.
    advantage_fn: rewards float32 [P, G] -> advantages [P, G].
    sampling: the workers' `SamplingParams`.
    prompts_per_request: P prompts per request; group_size: G completions per prompt.
    on_policy: the buffer is a queue: a request may start only when its rollouts, those in
      flight and those held fit the capacity (workers wait, as the paper's baseline does).
    gate: `fn(rollouts in flight) -> bool`, whether a request may start (the reuse controller's
      throttle, `data.reuse`); None = always.
    episodes: a multi-turn task's `multiturn.EpisodeRunner` (requests carry their `Episodes`);
      None: one completion per sample.
  """

  def __init__(self, task, codec, prompts: PromptSource, buffer, advantage_fn: Callable,
               sampling: SamplingParams, prompts_per_request: int, group_size: int,
               on_policy: bool = False, gate: Optional[Callable[[int], bool]] = None,
               episodes: Optional[multiturn.EpisodeRunner] = None):
    self.task, self.codec, self.prompts, self.buffer = task, codec, prompts, buffer
    self.advantage_fn, self.sampling = advantage_fn, sampling
    self.prompts_per_request, self.group_size = int(prompts_per_request), int(group_size)
    self.request_rollouts = self.prompts_per_request * self.group_size
    self.on_policy = bool(on_policy)
    self.gate = gate
    self.episodes = episodes
    self._env_counts = dict.fromkeys(multiturn.COUNT_KEYS, 0)
    self._fresh_env: list[multiturn.EpisodeInfo] = []
    self.next_group_id = 0
    self._in_flight = 0
    self._fresh_rewards: list[np.ndarray] = []
    self._lock = threading.Lock()
    # Held while a delivery lands (buffer, prompts, fresh rewards) and while a checkpoint reads
    # them, so a snapshot never holds a delivery's rollouts without its prompts or the reverse.
    self.snapshot_lock = threading.Lock()

  @property
  def in_flight(self) -> int:
    """Rollouts handed out to workers and not yet delivered or dropped."""
    with self._lock:
      return self._in_flight

  def _may_start(self) -> bool:
    if self.gate is not None and not self.gate(self._in_flight):
      return False
    if not self.on_policy:
      return True
    return len(self.buffer) + self._in_flight + self.request_rollouts <= self.buffer.capacity

  def next_request(self) -> Optional[PromptBatch]:
    """The next request (its `meta` holds the (index, problem) pairs), or None while a full
    on-policy queue makes the workers wait."""
    with self._lock:
      if not self._may_start():
        return None
      self._in_flight += self.request_rollouts
    items = self.prompts.take(self.prompts_per_request)
    return self._batch(items)

  def _batch(self, items: list[tuple[int, Any]]) -> PromptBatch:
    tokens = [self.codec.encode_prompt(p.prompt) for _, p in items]
    episodes = (None if self.episodes is None else
                multiturn.Episodes(self.episodes, tuple(p for _, p in items)))
    return PromptBatch(tokens, self.group_size, self.sampling, meta=items, episodes=episodes)

  def score(self, batch: PromptBatch, groups: Sequence[Group]) -> np.ndarray:
    """Rewards float32 [P, G] of the groups of `batch` (decoded and scored by the task). Holds no
    lock: several threads may score at once (the task's reward processes are shared), e.g. the
    async pool's `prepare` stage, before `deliver(..., rewards=...)` lands them."""
    return score_groups(groups, [p for _, p in batch.meta], self.task, self.codec)

  def deliver(self, batch: PromptBatch, groups: Sequence[Group],
              rewards: Optional[np.ndarray] = None) -> None:
    """Adds the rollouts of `batch`'s groups to the buffer (all or nothing), with advantages and
    group ids; scores them first unless `rewards` (float32 [P, G], from `score`) is given. Group
    ids are numbered in the order deliveries land in the buffer."""
    try:
      if rewards is None:
        rewards = self.score(batch, groups)
      rewards = np.asarray(rewards, np.float32).reshape(len(groups), -1)
      advantages = self.advantage_fn(rewards)
      with self.snapshot_lock:
        with self._lock:
          ids = list(range(self.next_group_id, self.next_group_id + len(groups)))
          self.next_group_id += len(groups)
        self.buffer.add(to_rollouts(groups, rewards, advantages, ids))
        self.prompts.delivered([i for i, _ in batch.meta])
        with self._lock:
          self._fresh_rewards.append(rewards.reshape(-1))
          if self.episodes is not None:
            infos = multiturn.episode_infos(groups)
            self._fresh_env.extend(infos)
            for k, v in multiturn.counts(infos).items():
              self._env_counts[k] += v
    finally:
      with self._lock:
        self._in_flight -= self.request_rollouts

  def restore_request(self, indices: Sequence[int]) -> PromptBatch:
    """The request of prompt `indices` that was in flight when the run was checkpointed, rebuilt
    on resume (it counts as in flight again; `deliver` completes it as usual)."""
    items = [(int(i), self.prompts.problem(int(i))) for i in indices]
    self.prompts.restore_in_flight([i for i, _ in items])
    with self._lock:
      self._in_flight += self.request_rollouts
    return self._batch(items)

  def dropped(self, batch: PromptBatch, error: BaseException) -> None:
    """A worker died mid-request: its prompts are handed out again, nothing reached the buffer."""
    # At the end of a run (or a stop) the requests in flight are dropped by design: not a warning.
    log = logging.info if isinstance(error, PoolStopped) else logging.warning
    log("rollout request dropped (%s); re-queueing its %d prompts", error, len(batch.meta))
    self.prompts.dropped([i for i, _ in batch.meta])
    with self._lock:
      self._in_flight -= self.request_rollouts

  def take_fresh_rewards(self) -> np.ndarray:
    """float32 [n]: rewards of the rollouts delivered since the last call."""
    with self._lock:
      fresh, self._fresh_rewards = self._fresh_rewards, []
    return np.concatenate(fresh) if fresh else np.zeros(0, np.float32)

  def env_metrics(self) -> dict[str, float]:
    """Multi-turn only ({} otherwise): the env/* keys of a metrics row: the counts of every
    trajectory delivered (`multiturn.COUNT_KEYS`: cumulative) and the means of those delivered
    since the last call (`multiturn.means`: env/turns_mean, env/tool_calls_mean, env/tool_correct,
    finish fractions; NaN without fresh trajectories)."""
    if self.episodes is None:
      return {}
    with self._lock:
      fresh, self._fresh_env = self._fresh_env, []
      counts = {k: float(v) for k, v in self._env_counts.items()}
    return {**multiturn.means(fresh), **counts}

  def env_counts(self) -> dict[str, float]:
    """The cumulative env/* counts (`multiturn.COUNT_KEYS`), {} for a single-turn task."""
    if self.episodes is None:
      return {}
    with self._lock:
      return {k: float(v) for k, v in self._env_counts.items()}

  def state_dict(self) -> dict[str, Any]:
    """{"next_group_id", "prompts", "fresh_rewards"}: merged into the checkpoint's host state
    (fresh rewards: those not yet reported in a metrics row); multi-turn also "fresh_episodes"
    (the fresh trajectories' `EpisodeInfo`s as dicts)."""
    with self._lock:
      fresh = (np.concatenate(self._fresh_rewards) if self._fresh_rewards
               else np.zeros(0, np.float32))
      episodes = [i.to_dict() for i in self._fresh_env]
    state = {"next_group_id": self.next_group_id, "prompts": self.prompts.state_dict(),
             "fresh_rewards": fresh}
    if self.episodes is not None:
      state["fresh_episodes"] = episodes
    return state

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Reads the keys of `state_dict` from a checkpoint's host state (other keys are ignored)."""
    self.next_group_id = int(state["next_group_id"])
    self.prompts.load_state_dict(state["prompts"])
    fresh = np.asarray(state.get("fresh_rewards", np.zeros(0)), np.float32)
    with self._lock:
      self._fresh_rewards = [fresh] if fresh.size else []
      self._fresh_env = [multiturn.EpisodeInfo(**e) for e in state.get("fresh_episodes", ())]
