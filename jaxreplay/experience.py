"""From sampled groups to replay-buffer rollouts: decode, score, group-relative advantages.

Also `PromptSource`, the deterministic, resumable stream of training problems.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np

from jaxreplay import losses
from jaxreplay.buffer import Rollout
from jaxreplay.rollout.base import Group


def make_advantage_fn(loss: str, adv_eps: float = 1e-6, tau: float = -0.1) -> Callable:
  """rewards float32 [P, G] -> advantages [P, G]: GRPO's standardised or AsymRE's shifted baseline."""
  if loss == "grpo":
    return lambda r: np.asarray(losses.grpo_advantages(r, eps=adv_eps), np.float32)
  if loss == "asymre":
    return lambda r: np.asarray(losses.asymre_advantages(r, tau=tau), np.float32)
  raise ValueError(f"unknown loss {loss!r}; expected 'grpo' or 'asymre'")


def groups_to_rollouts(groups: Sequence[Group], problems: Sequence[Any], task, codec,
                       advantage_fn: Callable, group_ids: Sequence[int]):
  """Scores every completion and returns (rollouts, rewards float32 [P, G]).

  groups[i] holds the G completions of problems[i]; all groups must have the same G.
  """
  if len(groups) != len(problems) or len(groups) != len(group_ids):
    raise ValueError(f"{len(groups)} groups for {len(problems)} problems / {len(group_ids)} ids")
  sizes = {len(g.completions) for g in groups}
  if len(sizes) != 1:
    raise ValueError(f"groups have different sizes {sorted(sizes)}")
  texts, owners = [], []
  for g, p in zip(groups, problems):
    for c in g.completions:
      texts.append(codec.decode(c.tokens))
      owners.append(p)
  rewards = np.asarray(task.score_batch(texts, owners), np.float32).reshape(len(groups), -1)
  adv = advantage_fn(rewards)
  rollouts = []
  for i, (g, gid) in enumerate(zip(groups, group_ids)):
    for j, c in enumerate(g.completions):
      rollouts.append(Rollout(prompt_tokens=g.prompt_tokens, completion_tokens=c.tokens,
                              logprobs=c.logprobs, reward=float(rewards[i, j]),
                              advantage=float(adv[i, j]), policy_version=int(g.policy_version),
                              group_id=int(gid)))
  return rollouts, rewards


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

  def state_dict(self) -> dict[str, Any]:
    with self._lock:
      return {"cursor": self._cursor, "pending": list(self._requeue) + list(self._pending)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    with self._lock:
      self._cursor = int(state["cursor"])
      self._pending = {}
      self._requeue = [int(i) for i in state["pending"]]
