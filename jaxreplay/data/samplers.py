"""How the replay buffer picks a batch: the sampler options and their exact draws.

Samplers (`buffer.priority`, `buffer.max_uses`, `buffer.replace_zero_variance`; combinable with
each other and with the positive bias, which only decides what is held):
  priority="fresh"        rollout i is drawn with priority
                            w_i = (p_base_i * exp(-age_i / fresh_tau)) ** fresh_alpha,
                          age_i = current_version - policy_version_i in updates (gradient steps;
                          the normalised distribution depends only on version differences, so
                          current_version does not matter and defaults to the newest held).
                          p_base_i by `buffer.fresh_base`: "uniform" (1, the default: w_i =
                          exp(-age_i / fresh_tau) at fresh_alpha 1, the draws of before issue 37
                          bit for bit), "reward" (|reward_i| + fresh_eps) or "advantage"
                          (|advantage_i| + fresh_eps).
                          FreshPER (Ma et al., arXiv 2604.16918; code github.com/Vision-CAIR/
                          Freshness-Aware-PER, `roll/agentic/replay_buffer`) is fresh_base
                          "reward", fresh_eps 1e-6, fresh_alpha 0.6, fresh_tau 500: its
                          `reward_fresh_priority` ((|reward| + 1e-6) * exp(-age / age_decay),
                          age_decay 500 "paper default"), raised to its PER exponent
                          `priority_exponent` 0.6 in the sum tree (`refresh_all_age_decay`, every
                          training step). What differs here: it samples with replacement from the
                          sum tree, this sampler draws B distinct rollouts by successive sampling
                          with the same weights; its age counts steps since the rollout was stored,
                          this one since the policy version that generated it (the behaviour
                          policy, whose drift its ESS argument is about); its optional
                          importance-sampling correction (beta 0.4 -> 1) is not applied (its README:
                          it "rarely changes peak performance"); its `max(., 1e-8)` floor on the
                          priority never binds at ages of a few hundred updates.
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

The buffer is storage (`data.buffer.ReplayBuffer`: rings of slots, FIFO, positive bias, max_uses
bookkeeping, checkpoints); which of its rollouts a batch takes is a sampler's `draw`, chosen from
the tables below: `SAMPLERS` by `buffer.priority`, `QUEUES` by `buffer.on_policy_order` for the
on-policy queue (`consume=True`), and `NewestUnused` while the reuse controller asks for the newest
never-used rollouts. A sampler reads what is held through the `Held` view (under the buffer's
lock) and draws from the buffer's one PCG64 stream.

A new sampler is one entry in `SAMPLERS` (a factory of `SamplerOptions` returning an object with
`draw(held, rng, batch_size)` and `consumes`; its test against the exact distribution in
`tests/data/test_samplers.py`); `config.validation` accepts its name from the table. A new option
of it is a `SamplerOptions` field read in `sampler_options` with its default in `config/defaults.py`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Protocol

import numpy as np


class Held(Protocol):
  """What a sampler may read of the buffer's storage (the buffer holds its lock meanwhile).

  Logical positions: recent oldest..newest (0 .. recent_size - 1), then positive oldest..newest.
  """
  size: int          # rollouts held
  recent_size: int   # of which in the recent region

  def slots(self, logical: np.ndarray) -> np.ndarray:
    """Slot ids (int64) of logical positions `logical` (int64)."""

  def versions(self, slots: np.ndarray) -> np.ndarray:
    """Policy versions (int64) of the rollouts in `slots`."""

  def uses(self, slots: np.ndarray) -> np.ndarray:
    """Use counts (int64) of the rollouts in `slots`."""

  def zero_variance(self, slots: np.ndarray) -> np.ndarray:
    """bool: whether each slot's group has all rewards equal."""


  def rewards(self, slots: np.ndarray) -> np.ndarray:
    """Rewards (float64) of the rollouts in `slots`."""

  def advantages(self, slots: np.ndarray) -> np.ndarray:
    """Advantages (float64) of the rollouts in `slots`."""


# buffer.fresh_base -> p_base of priority "fresh" over the held slots (None: 1 for every rollout)
FRESH_BASES: dict[str, Optional[Callable[[Held, np.ndarray], np.ndarray]]] = {
    "uniform": None,
    "reward": lambda held, slots: np.abs(held.rewards(slots)),
    "advantage": lambda held, slots: np.abs(held.advantages(slots)),
}


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
  """The options a sampler is built with (config `buffer.*`, see `sampler_options`).

  fresh_tau: tau > 0 of priority "fresh" [updates].
  replace_zero_variance: draw rollouts of zero-variance groups only when the others are too few.
  fresh_base: p_base of priority "fresh", a name of `FRESH_BASES`.
  fresh_alpha: the exponent > 0 of priority "fresh" (PER's alpha).
  fresh_eps: added to |reward| / |advantage| of the "reward" / "advantage" bases (> 0).
  """
  fresh_tau: float = 4.0
  replace_zero_variance: bool = False
  fresh_base: str = "uniform"
  fresh_alpha: float = 1.0
  fresh_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class PrioritySampler:
  """B distinct held rollouts: uniformly (`log_weights` None) or by successive sampling with
  per-rollout log weights; zero-variance groups last when `replace_zero_variance` (module
  docstring). Uniform draws without that option map B drawn positions straight to slots
  (`Generator.choice(held, B, replace=False)`: O(B), whatever is held)."""
  log_weights: Optional[Callable[[Held, np.ndarray], np.ndarray]] = None  # held, slots -> log w
  replace_zero_variance: bool = False
  consumes = False

  def draw(self, held: Held, rng: np.random.Generator, batch_size: int) -> np.ndarray:
    if self.log_weights is None and not self.replace_zero_variance:
      idx = rng.choice(held.size, size=batch_size, replace=False)
      return held.slots(np.asarray(idx, np.int64))
    slots = held.slots(np.arange(held.size, dtype=np.int64))
    log_w = None if self.log_weights is None else self.log_weights(held, slots)
    zero = held.zero_variance(slots) if self.replace_zero_variance else None
    return draw_slots(rng, slots, batch_size, log_weights=log_w, zero_variance=zero)


@dataclasses.dataclass(frozen=True)
class QueueSampler:
  """The on-policy queue (`consume=True`): the newest B ("lifo", the paper's baseline) or the
  oldest B ("fifo") of the recent region, which the buffer then removes. No randomness."""
  newest_first: bool
  consumes = True

  def draw(self, held: Held, rng: np.random.Generator, batch_size: int) -> np.ndarray:
    del rng
    n = held.recent_size
    logical = n - 1 - np.arange(batch_size) if self.newest_first else np.arange(batch_size)
    return held.slots(np.asarray(logical, np.int64))


@dataclasses.dataclass(frozen=True)
class NewestUnused:
  """The reuse controller's replay ratio 1 (`ReplayBuffer.set_newest_unused`): the newest B
  never-used rollouts of the recent region (the LIFO queue's batch, nothing removed) when at least
  B are unused, else `fallback`'s draw."""
  fallback: Any

  @property
  def consumes(self) -> bool:
    return self.fallback.consumes

  def draw(self, held: Held, rng: np.random.Generator, batch_size: int) -> np.ndarray:
    n = held.recent_size
    ring = held.slots(np.asarray(n - 1 - np.arange(n), np.int64))  # newest first
    slots = newest_unused(ring, held.uses(ring), batch_size)
    return self.fallback.draw(held, rng, batch_size) if slots is None else slots


# buffer.priority -> the sampler it draws with
SAMPLERS: dict[str, Callable[[SamplerOptions], Any]] = {
    "uniform": lambda o: PrioritySampler(None, o.replace_zero_variance),
    "fresh": lambda o: PrioritySampler(functools.partial(fresh_priority_log_weights, o),
                                       o.replace_zero_variance),
}

# buffer.on_policy_order -> the on-policy queue's sampler (consume=True)
QUEUES: dict[str, QueueSampler] = {
    "lifo": QueueSampler(newest_first=True),
    "fifo": QueueSampler(newest_first=False),
}


def make_sampler(priority: str, options: SamplerOptions):
  """The sampler of `buffer.priority` (ValueError naming the valid ones)."""
  if priority not in SAMPLERS:
    raise ValueError(f"priority={priority!r}; expected one of {tuple(SAMPLERS)}")
  return SAMPLERS[priority](options)


def sampler_options(buffer_config: Any) -> dict[str, Any]:
  """`ReplayBuffer`'s sampler keyword options from the config's `buffer` section."""
  return {"priority": str(buffer_config.get("priority", "uniform")),
          "fresh_tau": float(buffer_config.get("fresh_tau", 4.0)),
          "max_uses": int(buffer_config.get("max_uses", 0)),
          "replace_zero_variance": bool(buffer_config.get("replace_zero_variance", False)),
          "fresh_base": str(buffer_config.get("fresh_base", "uniform")),
          "fresh_alpha": float(buffer_config.get("fresh_alpha", 1.0)),
          "fresh_eps": float(buffer_config.get("fresh_eps", 1e-6))}


def check_options(priority: str, fresh_tau: float, max_uses: int, replace_zero_variance: bool,
                  consume: bool, fresh_base: str = "uniform", fresh_alpha: float = 1.0,
                  fresh_eps: float = 1e-6) -> None:
  """ValueError naming the bad sampler option and its fix (`ReplayBuffer`'s arguments)."""
  if priority not in SAMPLERS:
    raise ValueError(f"priority={priority!r}; expected one of {tuple(SAMPLERS)}")
  if not 0.0 < float(fresh_tau) < math.inf:
    raise ValueError(f"fresh_tau={fresh_tau} must be > 0 [updates] (priority exp(-age / tau))")
  if fresh_base not in FRESH_BASES:
    raise ValueError(f"fresh_base={fresh_base!r}; expected one of {tuple(FRESH_BASES)}")
  if not 0.0 < float(fresh_alpha) < math.inf or not 0.0 < float(fresh_eps) < math.inf:
    raise ValueError(f"fresh_alpha={fresh_alpha} and fresh_eps={fresh_eps} must be > 0 (priority "
                     "((p_base + eps) * exp(-age / tau)) ** alpha)")
  if priority != "fresh" and (fresh_base != "uniform" or fresh_alpha != 1.0):
    raise ValueError(f"fresh_base={fresh_base!r} and fresh_alpha={fresh_alpha} shape priority "
                     f"'fresh' only; got priority={priority!r}: set priority='fresh' or leave "
                     "them at 'uniform', 1.0")
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


def fresh_priority_log_weights(options: SamplerOptions, held: Held,
                               slots: np.ndarray) -> np.ndarray:
  """log w_i of priority "fresh" over `slots` (module docstring): alpha * (log p_base_i - age_i /
  tau); float64 [n]. The uniform base at alpha 1 is `fresh_log_weights` itself."""
  age_term = fresh_log_weights(held.versions(slots), options.fresh_tau)
  base = FRESH_BASES[options.fresh_base]
  if base is None and options.fresh_alpha == 1.0:
    return age_term
  log_base = 0.0 if base is None else np.log(base(held, slots) + options.fresh_eps)
  return options.fresh_alpha * (log_base + age_term)


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
  (aligned with the ring) are 0, or None when fewer are unused: the on-policy LIFO queue's batch."""
  unused = ring_newest_first[use_counts == 0]
  return unused[:batch_size] if unused.size >= batch_size else None
