"""How the replay buffer picks a batch: the sampler options and their exact draws.

Samplers (`buffer.priority`, `buffer.max_uses`, `buffer.replace_zero_variance`; combinable with
each other and with the positive bias, which only decides what is held):
  priority="fresh"        rollout i is drawn with priority w_i = exp(-age_i / fresh_tau), age_i =
                          current_version - policy_version_i in updates (FreshPER-style age decay;
                          the normalised distribution depends only on version differences, so
                          current_version does not matter and defaults to the newest held).
  max_uses=k > 0          a rollout leaves the buffer right after its k-th use ("buffer/retired";
                          done by the buffer, `ReplayBuffer._retire`).
  replace_zero_variance   rollouts of groups whose rewards are all equal (no GRPO signal) are not
                          drawn while others are: the batch takes its B rollouts from the other
                          groups when they hold >= B, else all of those plus B - n from the
                          zero-variance ones (DAPO's dynamic sampling, arXiv 2503.14476 section 3.2,
                          without extra generation). A group's rewards are those of every member
                          added while any member is held.
The exact distribution of a weighted draw of B distinct rollouts is successive sampling
(Plackett-Luce, `random.sample` with weights): the first is drawn with probability w_i / sum_j w_j,
each next one from those not yet drawn in proportion to their weights; implemented by Gumbel-top-k
(the B largest log w_i + G_i, G_i iid standard Gumbel, in decreasing order), which has exactly this
distribution (Yellott 1977; Kool, van Hoof, Welling, arXiv 1903.06059). Uniform draws
(priority="uniform") use numpy's `choice(..., replace=False)` as without the options, so a run with
every sampler option at its default draws the same batches as before issue 27.

A new sampler goes here: its option in `sampler_options` (and `config/defaults.py`, validated in
`config/validation.py`), its draw in `draw_slots`, its test in `tests/data/test_samplers.py`
against the exact distribution.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

PRIORITIES = ("uniform", "fresh")  # buffer.priority


def sampler_options(buffer_config: Any) -> dict[str, Any]:
  """`ReplayBuffer`'s sampler keyword options from the config's `buffer` section."""
  return {"priority": str(buffer_config.get("priority", "uniform")),
          "fresh_tau": float(buffer_config.get("fresh_tau", 4.0)),
          "max_uses": int(buffer_config.get("max_uses", 0)),
          "replace_zero_variance": bool(buffer_config.get("replace_zero_variance", False))}


def check_options(priority: str, fresh_tau: float, max_uses: int, replace_zero_variance: bool,
                  consume: bool) -> None:
  """ValueError naming the bad sampler option and its fix (`ReplayBuffer`'s arguments)."""
  if priority not in PRIORITIES:
    raise ValueError(f"priority={priority!r}; expected one of {PRIORITIES}")
  if not 0.0 < float(fresh_tau) < math.inf:
    raise ValueError(f"fresh_tau={fresh_tau} must be > 0 [updates] (priority exp(-age / tau))")
  if isinstance(max_uses, bool) or int(max_uses) != max_uses or max_uses < 0:
    raise ValueError(f"max_uses={max_uses!r} must be an int >= 0 (0 = no cap)")
  if consume and (priority != "uniform" or max_uses or replace_zero_variance):
    raise ValueError("consume=True (the on-policy queue) uses each rollout once, newest or oldest "
                     "first: priority, max_uses and replace_zero_variance do not apply; leave "
                     "them at 'uniform', 0, False")


def successive_sampling(rng: np.random.Generator, log_weights: np.ndarray, k: int) -> np.ndarray:
  """k distinct indices of `log_weights` [n] drawn by successive sampling (module docstring), in
  draw order: the k largest log_weights + Gumbel noise (Gumbel-top-k). int64 [k]."""
  keys = np.asarray(log_weights, np.float64) + rng.gumbel(size=len(log_weights))
  return np.argsort(-keys, kind="stable")[:k].astype(np.int64)


def fresh_log_weights(policy_versions: np.ndarray, fresh_tau: float) -> np.ndarray:
  """log w_i = -age_i / fresh_tau with age counted from the newest held version; float64 [n]."""
  versions = np.asarray(policy_versions, np.int64)
  return (versions - versions.max()).astype(np.float64) / fresh_tau


def draw_slots(rng: np.random.Generator, slots: np.ndarray, batch_size: int,
               log_weights: Optional[np.ndarray] = None,
               zero_variance: Optional[np.ndarray] = None) -> np.ndarray:
  """`batch_size` distinct entries of `slots` [n] (the held slot ids in logical order), in draw
  order: uniformly without replacement when `log_weights` is None, else by successive sampling
  with those log weights [n]; with `zero_variance` (bool [n]), the rollouts of zero-variance groups
  only fill what the others cannot (module docstring). int64 [batch_size]."""
  def draw(pool: np.ndarray, k: int) -> np.ndarray:
    if k == 0:
      return pool[:0]
    if log_weights is None:
      return pool[rng.choice(pool.size, size=k, replace=False)]
    return pool[successive_sampling(rng, log_weights[pool], k)]

  everything = np.arange(slots.size, dtype=np.int64)
  if zero_variance is None:
    return slots[draw(everything, batch_size)]
  informative, rest = everything[~zero_variance], everything[zero_variance]
  if informative.size >= batch_size:
    return slots[draw(informative, batch_size)]
  return slots[np.concatenate([informative, draw(rest, batch_size - informative.size)])]


def newest_unused(ring_newest_first: np.ndarray, use_counts: np.ndarray,
                  batch_size: int) -> Optional[np.ndarray]:
  """The first `batch_size` of `ring_newest_first` (slot ids, newest first) whose `use_counts`
  (indexed by slot id) are 0, or None when fewer are unused: the on-policy LIFO queue's batch."""
  unused = ring_newest_first[use_counts[ring_newest_first] == 0]
  return unused[:batch_size] if unused.size >= batch_size else None
