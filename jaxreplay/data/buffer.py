"""The host-side replay buffer: FIFO storage of rollouts, uniform sampling, optional positive bias.

The unit is one rollout (one completion of one prompt), so the capacity N, the batch size B and the
number R of fresh rollouts per gradient step all count rollouts, as in the paper.

Storage is circular: `capacity` preallocated slots hold the `Rollout` objects and their per-slot
metadata (uid, policy version, use count) in numpy arrays; a ring of slot ids per region gives the
FIFO order. Adding is O(1) per rollout, sampling is O(B) (see `ReplayBuffer.sample`).

Regions (`positive_fraction = delta`):
  recent    the n_recent = N - floor(delta * N) newest rollouts (FIFO). With delta = 0 this is the
            whole buffer. floor() rounds the positive region down, so (1 - delta) * N is rounded up.
  positive  up to n_positive = floor(delta * N) rollouts with reward > 0 that have left the recent
            region (FIFO): a rollout evicted from the recent region moves here if its reward is > 0
            (evicting the oldest positive when full); a non-positive one is dropped.
Sampling is uniform over everything held (both regions), unless a sampler option is set:

Samplers (`buffer.priority`, `buffer.max_uses`, `buffer.replace_zero_variance`; combinable with
each other and with the positive bias, which only decides what is held):
  priority="fresh"        rollout i is drawn with priority w_i = exp(-age_i / fresh_tau), age_i =
                          current_version - policy_version_i in updates (FreshPER-style age decay;
                          the normalised distribution depends only on version differences, so
                          current_version does not matter and defaults to the newest held).
  max_uses=k > 0          a rollout leaves the buffer right after its k-th use ("buffer/retired").
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

`consume=True` turns the buffer into the on-policy baseline's queue: `sample` pops B rollouts, so
each rollout is used once and the trainer waits for fresh data. `consume_order="lifo"` (the paper's
baseline, the default) pops the NEWEST B, `"fifo"` the oldest B. A queue that overflows drops its
oldest rollouts (counted in "buffer/evicted").

`set_newest_unused(True)` (the reuse controller at a replay ratio of 1) makes `sample` take the
newest B never-used rollouts, as that queue would, while keeping everything held for later reuse.

All methods are thread-safe (one lock and condition variable); `sample` blocks until enough
rollouts are held, and `close()` wakes blocked samplers with `BufferClosedError`.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from typing import Any, Iterable, Optional, Union

import numpy as np

from jaxreplay.learner.batch import Rollout  # re-exported: `buffer.Rollout` is public

# Keys `ReplayBuffer.metrics` always returns (floats).
METRIC_KEYS = (
    "buffer/size",                  # rollouts held (both regions)
    "buffer/capacity",              # N
    "buffer/fill",                  # size / capacity
    "buffer/recent_size",           # rollouts in the recent (FIFO) region
    "buffer/positive_size",         # rollouts in the positive-bias region
    "buffer/total_added",           # rollouts ever added
    "buffer/total_sampled",         # rollout-uses ever returned by `sample` (sum of batch sizes)
    "buffer/replay_ratio",          # total_sampled / total_added: B/R over the run
    "buffer/evicted",               # rollouts dropped from the buffer
    "buffer/promoted",              # rollouts moved from the recent to the positive region
    "buffer/consumed",              # rollouts removed by `sample` (consume=True only)
    "buffer/use_count_mean",        # mean use count over evicted and held rollouts
    "buffer/evicted_use_count_mean",  # mean uses over a whole life (evicted rollouts; 0 if none)
    "buffer/held_use_count_mean",   # mean use count of the rollouts held now (0 if empty)
    "buffer/evicted_unused",        # rollouts evicted without ever being sampled (wasted generation)
    "buffer/never_used_fraction",   # (evicted unused + held unused) / total_added: the share of the
                                    # generated rollouts not trained on (so far; exact at the end)
)
# Keys about the last sampled batch, present once a batch was sampled.
BATCH_KEYS = (
    "buffer/batch_use_count_mean",  # use counts of the batch's rollouts, this use included
    "buffer/batch_use_count_max",
)
# Keys present when the last batch was sampled with `current_version=`: its staleness
# (current_version - policy_version, in policy versions).
STALENESS_KEYS = (
    "buffer/staleness_mean",
    "buffer/staleness_max",
    "buffer/staleness_min",
)
# Keys present when `metrics(current_version=...)` is given: staleness of everything held.
HELD_STALENESS_KEYS = (
    "buffer/held_staleness_mean",
    "buffer/held_staleness_max",
)
# Keys present with max_uses > 0.
MAX_USES_KEYS = (
    "buffer/retired",               # rollouts removed after their max_uses-th use
)
# Keys present with replace_zero_variance.
ZERO_VARIANCE_KEYS = (
    "buffer/zero_variance_fraction",  # share of held rollouts whose group's rewards are all equal
    "buffer/batch_zero_variance_fraction",  # the same share in the last batch (once sampled)
)

CONSUME_ORDERS = ("lifo", "fifo")
PRIORITIES = ("uniform", "fresh")  # buffer.priority
_STATE_FORMAT = 1
_STATE_KEYS = (
    "format", "capacity", "positive_fraction", "consume", "recent_count", "positive_count",
    "next_uid", "total_added", "total_sampled", "evicted", "evicted_use_count_sum", "promoted",
    "consumed", "rng_state", "uid", "use_count", "reward", "advantage", "policy_version",
    "group_id", "prompt_len", "completion_len", "prompt_tokens", "completion_tokens", "logprobs",
)
# Keys added by issue 27; a state without them (an older checkpoint) loads with: no rollout
# retired, and each held group's reward range taken from its held members.
_OPTIONAL_STATE_KEYS = ("retired", "retired_use_count_sum", "group_stats_id", "group_stats_min",
                        "group_stats_max")
_U64 = (1 << 64) - 1


class BufferClosedError(RuntimeError):
  """Raised by `sample`/`add` after `ReplayBuffer.close()` (the pipeline is shutting down)."""


def sampler_options(buffer_config: Any) -> dict[str, Any]:
  """`ReplayBuffer`'s sampler keyword options from the config's `buffer` section."""
  return {"priority": str(buffer_config.get("priority", "uniform")),
          "fresh_tau": float(buffer_config.get("fresh_tau", 4.0)),
          "max_uses": int(buffer_config.get("max_uses", 0)),
          "replace_zero_variance": bool(buffer_config.get("replace_zero_variance", False))}


def successive_sampling(rng: np.random.Generator, log_weights: np.ndarray, k: int) -> np.ndarray:
  """k distinct indices of `log_weights` [n] drawn by successive sampling (module docstring), in
  draw order: the k largest log_weights + Gumbel noise (Gumbel-top-k). int64 [k]."""
  keys = np.asarray(log_weights, np.float64) + rng.gumbel(size=len(log_weights))
  return np.argsort(-keys, kind="stable")[:k].astype(np.int64)


def _region_sizes(capacity: int, positive_fraction: float) -> tuple[int, int]:
  """(n_recent, n_positive): n_positive = floor(delta * N), n_recent = N - n_positive."""
  n_positive = int(math.floor(positive_fraction * capacity + 1e-9))
  return capacity - n_positive, n_positive


class ReplayBuffer:
  """A FIFO replay buffer of rollouts with uniform sampling (see the module docstring).

  Args:
    capacity: N, the most rollouts held (both regions together).
    seed: seeds the numpy Generator (PCG64) that draws the batches.
    positive_fraction: delta in [0, 1); the positive-bias region holds floor(delta * N) slots.
    consume: the on-policy queue: `sample` removes the B rollouts it returns.
    consume_order: which B a consuming `sample` pops: "lifo" (the newest, the paper's baseline) or
      "fifo" (the oldest).
    priority: "uniform" or "fresh" (draw priority exp(-age / fresh_tau), module docstring).
    fresh_tau: tau > 0 of priority "fresh" [updates].
    max_uses: k > 0: a rollout leaves after its k-th use; 0 = no cap.
    replace_zero_variance: draw rollouts of zero-variance groups only when the others are too few.
  The sampler options do not apply to a consuming queue (each rollout is used once there).
  """

  def __init__(self, capacity: int, seed: int = 0, positive_fraction: float = 0.0,
               consume: bool = False, consume_order: str = "lifo", priority: str = "uniform",
               fresh_tau: float = 4.0, max_uses: int = 0, replace_zero_variance: bool = False):
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
      raise ValueError(f"capacity={capacity!r} must be a positive int (rollouts)")
    positive_fraction = float(positive_fraction)
    if not 0.0 <= positive_fraction < 1.0:
      raise ValueError(f"positive_fraction={positive_fraction} must be in [0, 1) (the recent "
                       "region needs at least one slot)")
    n_recent, n_positive = _region_sizes(int(capacity), positive_fraction)
    if positive_fraction > 0 and n_positive == 0:
      raise ValueError(f"positive_fraction={positive_fraction} * capacity={capacity} gives no "
                       "positive slot (floor < 1): raise capacity or positive_fraction, or use 0")
    if n_recent < 1:
      raise ValueError(f"positive_fraction={positive_fraction} leaves no recent slot for "
                       f"capacity={capacity}: lower positive_fraction")
    if consume and positive_fraction > 0:
      raise ValueError("consume=True (the on-policy queue) cannot have a positive region: "
                       "set positive_fraction=0")
    if consume_order not in CONSUME_ORDERS:
      raise ValueError(f"consume_order={consume_order!r}; expected one of {CONSUME_ORDERS}")
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
    self.priority, self.fresh_tau = priority, float(fresh_tau)
    self.max_uses, self.replace_zero_variance = int(max_uses), bool(replace_zero_variance)
    self.capacity = int(capacity)
    self.positive_fraction = positive_fraction
    self.consume = bool(consume)
    self.consume_order = consume_order
    self.n_recent, self.n_positive = n_recent, n_positive
    self._seed = seed
    self._cond = threading.Condition(threading.Lock())
    self._closed = False
    self._newest_unused = False
    self._last_batch_stats: Optional[dict[str, Any]] = None
    self._reset()
    self._rng = np.random.Generator(np.random.PCG64(seed))

  def _reset(self):
    n = self.capacity
    self._items: list[Optional[Rollout]] = [None] * n
    self._slot_uid = np.full(n, -1, np.int64)
    self._slot_version = np.zeros(n, np.int64)
    self._slot_use = np.zeros(n, np.int64)
    self._slot_group = np.zeros(n, np.int64)
    self._groups: dict[int, list] = {}  # group id -> [min reward, max reward, members held]
    self._free = list(range(n - 1, -1, -1))  # a stack of free slot ids
    self._recent = np.zeros(self.n_recent, np.int64)  # ring of slot ids, oldest at the head
    self._recent_head = 0
    self._recent_count = 0
    self._pos = np.zeros(max(self.n_positive, 1), np.int64)
    self._pos_head = 0
    self._pos_count = 0
    self._next_uid = 0
    self._total_added = 0
    self._total_sampled = 0
    self._evicted = 0
    self._evicted_use_sum = 0
    self._evicted_unused = 0
    self._promoted = 0
    self._consumed = 0
    self._retired = 0
    self._retired_use_sum = 0

  # ---- adding ----------------------------------------------------------------------------------

  def add(self, rollouts: Union[Rollout, Iterable[Rollout]]) -> list[int]:
    """Adds rollouts (newest last), evicting the oldest when full; returns their uids.

    The buffer stores a shallow copy of each `Rollout` (its arrays are shared, not copied) with
    `uid` and `use_count` set; the caller's objects are not modified.
    """
    if isinstance(rollouts, Rollout):
      rollouts = [rollouts]
    rollouts = list(rollouts)
    for r in rollouts:
      if not isinstance(r, Rollout):
        raise ValueError(f"ReplayBuffer.add takes Rollout objects, got {type(r).__name__}")
    with self._cond:
      if self._closed:
        raise BufferClosedError("add() on a closed ReplayBuffer (the pipeline is shutting down)")
      uids = [self._insert(r) for r in rollouts]
      if uids:
        self._cond.notify_all()
    return uids

  def _insert(self, r: Rollout) -> int:
    if self._recent_count == self.n_recent:
      slot = int(self._recent[self._recent_head])
      self._recent_head = (self._recent_head + 1) % self.n_recent
      self._recent_count -= 1
      if self.n_positive and self._items[slot].reward > 0:
        if self._pos_count == self.n_positive:
          old = int(self._pos[self._pos_head])
          self._pos_head = (self._pos_head + 1) % self.n_positive
          self._pos_count -= 1
          self._drop(old, evicted=True)
        self._pos[(self._pos_head + self._pos_count) % self.n_positive] = slot
        self._pos_count += 1
        self._promoted += 1
      else:
        self._drop(slot, evicted=True)
    slot = self._free.pop()
    item = copy.copy(r)
    item.uid, item.use_count = self._next_uid, 0
    self._next_uid += 1
    self._total_added += 1
    self._items[slot] = item
    self._slot_uid[slot] = item.uid
    self._slot_version[slot] = item.policy_version
    self._slot_use[slot] = 0
    self._hold_group(slot, item)
    self._recent[(self._recent_head + self._recent_count) % self.n_recent] = slot
    self._recent_count += 1
    return item.uid

  def _hold_group(self, slot: int, item: Rollout) -> None:
    """Records `item` (now in `slot`) in its group's reward range and held count."""
    gid, reward = int(item.group_id), float(item.reward)
    self._slot_group[slot] = gid
    g = self._groups.get(gid)
    if g is None:
      self._groups[gid] = [reward, reward, 1]
    else:
      g[0], g[1], g[2] = min(g[0], reward), max(g[1], reward), g[2] + 1

  def _drop(self, slot: int, evicted: bool):
    if evicted:
      self._evicted += 1
      self._evicted_use_sum += int(self._slot_use[slot])
      self._evicted_unused += int(self._slot_use[slot] == 0)
    gid = int(self._slot_group[slot])
    g = self._groups.get(gid)
    if g is not None:
      g[2] -= 1
      if g[2] <= 0:
        del self._groups[gid]
    self._items[slot] = None
    self._slot_uid[slot] = -1
    self._free.append(slot)

  def _retire(self, slots: np.ndarray) -> None:
    """Removes `slots` (used max_uses times) from both regions, keeping the FIFO order of the rest."""
    if not slots.size:
      return
    def compact(ring, head, count, size):
      order = ring[(head + np.arange(count)) % size] if count else ring[:0]
      kept = order[~np.isin(order, slots)]
      ring[:kept.size] = kept
      return 0, int(kept.size)
    self._recent_head, self._recent_count = compact(self._recent, self._recent_head,
                                                    self._recent_count, self.n_recent)
    if self.n_positive:
      self._pos_head, self._pos_count = compact(self._pos, self._pos_head, self._pos_count,
                                                self.n_positive)
    for s in slots.tolist():
      self._retired += 1
      self._retired_use_sum += int(self._slot_use[s])
      self._drop(s, evicted=False)

  def _zero_variance(self, slots: np.ndarray) -> np.ndarray:
    """bool [len(slots)]: whether each slot's group has all rewards equal."""
    groups = self._groups
    return np.fromiter((groups[g][0] == groups[g][1] for g in self._slot_group[slots].tolist()),
                       bool, count=len(slots))

  # ---- sampling --------------------------------------------------------------------------------

  @property
  def total_added(self) -> int:
    """Rollouts ever added (resumes included). Read without the lock (an int read is atomic), so
    a gate that holds another lock may ask it (`run.reuse`)."""
    return self._total_added

  def __len__(self) -> int:
    with self._cond:
      return self._recent_count + self._pos_count

  def _size(self) -> int:
    return self._recent_count + self._pos_count

  def _logical_slots(self, idx: np.ndarray) -> np.ndarray:
    """Slot ids of logical positions `idx` (recent oldest..newest, then positive oldest..newest)."""
    in_recent = idx < self._recent_count
    slots = np.empty_like(idx)
    slots[in_recent] = self._recent[(self._recent_head + idx[in_recent]) % self.n_recent]
    if self.n_positive:
      rest = idx[~in_recent] - self._recent_count
      slots[~in_recent] = self._pos[(self._pos_head + rest) % self.n_positive]
    return slots

  def sample(self, batch_size: int, timeout: Optional[float] = None,
             current_version: Optional[int] = None) -> list[Rollout]:
    """Returns `batch_size` distinct rollouts drawn uniformly from what is held.

    Blocks until at least `batch_size` rollouts are held (at most `timeout` seconds, then
    TimeoutError). Nothing is removed unless `consume=True`, which pops the oldest `batch_size`
    instead. Draws use numpy's `Generator.choice(size, B, replace=False)`, whose cost grows with B,
    not with the number held (measured: ~40 us for B=1000 from 2e3 to 2e6 held); the logical
    positions map to slots with vectorised ring arithmetic.
    The returned objects are the buffer's own (shared, treat as read-only); their `use_count`
    includes this use. With `current_version`, `last_batch_stats` records the staleness
    current_version - policy_version of each returned rollout.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
      raise ValueError(f"batch_size={batch_size!r} must be an int")
    batch_size = int(batch_size)
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be >= 1")
    if batch_size > self.capacity:
      raise ValueError(f"sample({batch_size}) can never be satisfied by a buffer of capacity "
                       f"{self.capacity}: raise capacity to >= {batch_size} or lower the batch size")
    deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
    with self._cond:
      while not self._closed and self._size() < batch_size:
        if deadline is None:
          self._cond.wait()
        else:
          left = deadline - time.monotonic()
          if left <= 0:
            raise TimeoutError(
                f"ReplayBuffer.sample({batch_size}) timed out after {timeout} s: the buffer holds "
                f"{self._size()} of the {batch_size} rollouts requested (capacity "
                f"{self.capacity}); are the producers running?")
          self._cond.wait(left)
      if self._closed:
        raise BufferClosedError(
            f"ReplayBuffer closed while sample({batch_size}) waited (held {self._size()}): "
            "the pipeline is shutting down")
      newest_unused = self._newest_unused_slots(batch_size) if self._newest_unused else None
      if newest_unused is not None:
        slots = newest_unused
      elif self.consume:
        if self.consume_order == "lifo":
          logical = self._recent_count - 1 - np.arange(batch_size)  # newest first
        else:
          logical = np.arange(batch_size)
        slots = self._recent[(self._recent_head + logical) % self.n_recent]
      elif self.priority == "uniform" and not self.replace_zero_variance:
        idx = self._rng.choice(self._size(), size=batch_size, replace=False)
        slots = self._logical_slots(np.asarray(idx, np.int64))
      else:
        slots = self._draw(batch_size)
      self._slot_use[slots] += 1
      use = self._slot_use[slots].copy()
      out = [self._items[s] for s in slots.tolist()]
      for r, u in zip(out, use.tolist()):
        r.use_count = u
      self._total_sampled += batch_size
      versions = self._slot_version[slots].copy()
      stats: dict[str, Any] = {"uids": self._slot_uid[slots].copy(), "use_counts": use,
                               "policy_versions": versions, "use_count_mean": float(use.mean()),
                               "use_count_max": int(use.max())}
      if current_version is not None:
        st = int(current_version) - versions
        stats.update(current_version=int(current_version), staleness=st,
                     staleness_mean=float(st.mean()), staleness_max=int(st.max()),
                     staleness_min=int(st.min()))
      if self.replace_zero_variance:
        stats["zero_variance"] = self._zero_variance(slots)
      self._last_batch_stats = stats
      if self.max_uses:
        self._retire(slots[use >= self.max_uses])
      if self.consume:
        if self.consume_order == "fifo":
          self._recent_head = (self._recent_head + batch_size) % self.n_recent
        self._recent_count -= batch_size
        self._consumed += batch_size
        for s in slots.tolist():
          self._drop(s, evicted=False)
      return out

  def set_newest_unused(self, on: bool) -> None:
    """While on, `sample` takes the B newest never-used rollouts whenever at least B are held in
    the recent region (the on-policy LIFO queue's batch, without removing anything, so the
    rollouts stay available if reuse is raised again), and draws as configured otherwise. The
    reuse controller switches it on while its replay ratio is 1 (`run.reuse`)."""
    with self._cond:
      self._newest_unused = bool(on)

  @property
  def newest_unused(self) -> bool:
    return self._newest_unused

  def _newest_unused_slots(self, batch_size: int) -> Optional[np.ndarray]:
    """Slot ids of the `batch_size` newest never-used rollouts (newest first), or None when fewer
    are held. O(held) (one vectorised pass over the recent ring)."""
    logical = self._recent_count - 1 - np.arange(self._recent_count)  # newest first
    ring = self._recent[(self._recent_head + logical) % self.n_recent]
    unused = ring[self._slot_use[ring] == 0]
    return unused[:batch_size] if unused.size >= batch_size else None

  def _draw(self, batch_size: int) -> np.ndarray:
    """Slot ids of a batch under the sampler options (module docstring), in draw order."""
    size = self._size()
    slots = self._logical_slots(np.arange(size, dtype=np.int64))
    if self.priority == "fresh":
      versions = self._slot_version[slots]
      log_w = (versions - versions.max()).astype(np.float64) / self.fresh_tau
    else:
      log_w = None

    def draw(pool: np.ndarray, k: int) -> np.ndarray:
      if k == 0:
        return pool[:0]
      if log_w is None:
        return pool[self._rng.choice(pool.size, size=k, replace=False)]
      return pool[successive_sampling(self._rng, log_w[pool], k)]

    everything = np.arange(size, dtype=np.int64)
    if not self.replace_zero_variance:
      return slots[draw(everything, batch_size)]
    zero = self._zero_variance(slots)
    informative, rest = everything[~zero], everything[zero]
    if informative.size >= batch_size:
      return slots[draw(informative, batch_size)]
    return slots[np.concatenate([informative, draw(rest, batch_size - informative.size)])]

  @property
  def last_batch_stats(self) -> Optional[dict[str, Any]]:
    """Stats of the most recent `sample` (any thread): uids, use_counts, policy_versions (int64
    [B]), use_count_mean / use_count_max (this use included) and, when sampled with
    current_version, staleness (int64 [B]) and staleness_mean / staleness_max / staleness_min;
    with replace_zero_variance, zero_variance (bool [B]: the rollout's group has all rewards equal)."""
    with self._cond:
      return None if self._last_batch_stats is None else dict(self._last_batch_stats)

  def close(self):
    """Wakes every blocked `sample` with BufferClosedError; later `sample`/`add` raise it too."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    return self._closed

  # ---- inspection and metrics ------------------------------------------------------------------

  @property
  def recent_size(self) -> int:
    with self._cond:
      return self._recent_count

  @property
  def positive_size(self) -> int:
    with self._cond:
      return self._pos_count

  def contents(self) -> list[Rollout]:
    """The held rollouts in logical order: recent oldest..newest, then positive oldest..newest."""
    with self._cond:
      slots = self._logical_slots(np.arange(self._size(), dtype=np.int64))
      return [self._items[s] for s in slots.tolist()]

  def metrics(self, current_version: Optional[int] = None) -> dict[str, float]:
    """Counters and gauges under the names in METRIC_KEYS, plus BATCH_KEYS / STALENESS_KEYS /
    HELD_STALENESS_KEYS when known, MAX_USES_KEYS / ZERO_VARIANCE_KEYS with those options (see
    their comments)."""
    with self._cond:
      size = self._size()
      slots = self._logical_slots(np.arange(size, dtype=np.int64))
      held_use = self._slot_use[slots]
      n_life = self._evicted + self._retired + size
      m = {
          "buffer/size": size,
          "buffer/capacity": self.capacity,
          "buffer/fill": size / self.capacity,
          "buffer/recent_size": self._recent_count,
          "buffer/positive_size": self._pos_count,
          "buffer/total_added": self._total_added,
          "buffer/total_sampled": self._total_sampled,
          "buffer/replay_ratio": self._total_sampled / max(self._total_added, 1),
          "buffer/evicted": self._evicted,
          "buffer/promoted": self._promoted,
          "buffer/consumed": self._consumed,
          "buffer/use_count_mean": (self._evicted_use_sum + self._retired_use_sum +
                                    int(held_use.sum())) / max(n_life, 1),
          "buffer/evicted_use_count_mean": self._evicted_use_sum / max(self._evicted, 1),
          "buffer/held_use_count_mean": float(held_use.mean()) if size else 0.0,
          "buffer/evicted_unused": self._evicted_unused,
          "buffer/never_used_fraction": ((self._evicted_unused + int(np.sum(held_use == 0)))
                                         / max(self._total_added, 1)),
      }
      if self.max_uses:
        m["buffer/retired"] = self._retired
      if self.replace_zero_variance:
        m["buffer/zero_variance_fraction"] = (float(self._zero_variance(slots).mean()) if size
                                              else 0.0)
      last = self._last_batch_stats
      if last is not None:
        if "zero_variance" in last:
          m["buffer/batch_zero_variance_fraction"] = float(last["zero_variance"].mean())
        m["buffer/batch_use_count_mean"] = float(last["use_counts"].mean())
        m["buffer/batch_use_count_max"] = float(last["use_counts"].max())
        if "staleness" in last:
          m["buffer/staleness_mean"] = last["staleness_mean"]
          m["buffer/staleness_max"] = last["staleness_max"]
          m["buffer/staleness_min"] = last["staleness_min"]
      if current_version is not None and size:
        st = int(current_version) - self._slot_version[slots]
        m["buffer/held_staleness_mean"] = float(st.mean())
        m["buffer/held_staleness_max"] = float(st.max())
      return {k: float(v) for k, v in m.items()}

  # ---- checkpointing ---------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """Everything needed to resume: contents of both regions, counters and the RNG state.

    A flat dict of numpy arrays and python ints/floats (picklable; np.savez / orbax can store it).
    Rollouts are in logical order (the first `recent_count` are the recent region, oldest first);
    token arrays are concatenated, `prompt_len` / `completion_len` give each rollout's share.
    """
    with self._cond:
      items = [self._items[s] for s in
               self._logical_slots(np.arange(self._size(), dtype=np.int64)).tolist()]
      rng = self._rng.bit_generator.state
      st, inc = rng["state"]["state"], rng["state"]["inc"]

      def cat(arrays, dtype):
        return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

      return {
          "format": _STATE_FORMAT,
          "capacity": self.capacity,
          "positive_fraction": self.positive_fraction,
          "consume": int(self.consume),
          "consume_lifo": int(self.consume_order == "lifo"),
          "recent_count": self._recent_count,
          "positive_count": self._pos_count,
          "next_uid": self._next_uid,
          "total_added": self._total_added,
          "total_sampled": self._total_sampled,
          "evicted": self._evicted,
          "evicted_use_count_sum": self._evicted_use_sum,
          "evicted_unused": self._evicted_unused,
          "promoted": self._promoted,
          "consumed": self._consumed,
          "retired": self._retired,
          "retired_use_count_sum": self._retired_use_sum,
          "group_stats_id": np.array(list(self._groups), np.int64),
          "group_stats_min": np.array([g[0] for g in self._groups.values()], np.float64),
          "group_stats_max": np.array([g[1] for g in self._groups.values()], np.float64),
          "rng_state": np.array([st >> 64, st & _U64, inc >> 64, inc & _U64,
                                 rng["has_uint32"], rng["uinteger"]], np.uint64),
          "uid": np.array([r.uid for r in items], np.int64),
          "use_count": np.array([r.use_count for r in items], np.int64),
          "reward": np.array([r.reward for r in items], np.float64),
          "advantage": np.array([r.advantage for r in items], np.float64),
          "policy_version": np.array([r.policy_version for r in items], np.int64),
          "group_id": np.array([r.group_id for r in items], np.int64),
          "prompt_len": np.array([r.prompt_tokens.shape[0] for r in items], np.int64),
          "completion_len": np.array([r.completion_tokens.shape[0] for r in items], np.int64),
          "prompt_tokens": cat([r.prompt_tokens for r in items], np.int32),
          "completion_tokens": cat([r.completion_tokens for r in items], np.int32),
          "logprobs": cat([r.logprobs for r in items], np.float32),
      }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()` output; capacity, positive_fraction and consume (with its order)
    must match. The sampler options are this buffer's own (they may change across a resume); a
    state from before them (no retired count, no group reward ranges) loads too."""
    missing = sorted(set(_STATE_KEYS) - set(state))
    if missing:
      raise ValueError(f"buffer state is missing keys {missing}: not a ReplayBuffer.state_dict()")
    scalar = lambda k: np.asarray(state[k]).item()
    if int(scalar("format")) != _STATE_FORMAT:
      raise ValueError(f"buffer state format {scalar('format')} != {_STATE_FORMAT}")
    state = {"consume_lifo": 0, **state}  # checkpoints from before LIFO queues were FIFO
    checks = [("capacity", self.capacity), ("positive_fraction", self.positive_fraction),
              ("consume", int(self.consume))]
    if self.consume:
      checks.append(("consume_lifo", int(self.consume_order == "lifo")))
    for key, mine in checks:
      if scalar(key) != mine:
        raise ValueError(f"buffer state has {key}={scalar(key)} but this buffer has {key}={mine}: "
                         f"build the ReplayBuffer with the {key} of the checkpoint")
    n_recent, n_pos = int(scalar("recent_count")), int(scalar("positive_count"))
    held = n_recent + n_pos
    if not (0 <= n_recent <= self.n_recent and 0 <= n_pos <= self.n_positive):
      raise ValueError(f"buffer state holds {n_recent} recent / {n_pos} positive rollouts, more "
                       f"than the regions' {self.n_recent} / {self.n_positive} slots")
    per_item = ("uid", "use_count", "reward", "advantage", "policy_version", "group_id",
                "prompt_len", "completion_len")
    arrays = {k: np.asarray(state[k]) for k in per_item}
    for k, a in arrays.items():
      if a.shape != (held,):
        raise ValueError(f"buffer state {k!r} has shape {a.shape}, expected ({held},)")
    plen, clen = arrays["prompt_len"], arrays["completion_len"]
    ptok = np.asarray(state["prompt_tokens"])
    ctok = np.asarray(state["completion_tokens"])
    lps = np.asarray(state["logprobs"])
    if ptok.shape != (int(plen.sum()),) or ctok.shape != (int(clen.sum()),) or lps.shape != ctok.shape:
      raise ValueError("buffer state token arrays do not match prompt_len / completion_len")
    p_off = np.concatenate([[0], np.cumsum(plen)])
    c_off = np.concatenate([[0], np.cumsum(clen)])
    items = []
    for i in range(held):
      items.append(Rollout(
          prompt_tokens=ptok[p_off[i]:p_off[i + 1]].copy(),
          completion_tokens=ctok[c_off[i]:c_off[i + 1]].copy(),
          logprobs=lps[c_off[i]:c_off[i + 1]].copy(),
          reward=float(arrays["reward"][i]), advantage=float(arrays["advantage"][i]),
          policy_version=int(arrays["policy_version"][i]), group_id=int(arrays["group_id"][i]),
          uid=int(arrays["uid"][i]), use_count=int(arrays["use_count"][i])))
    words = [int(w) for w in np.asarray(state["rng_state"], np.uint64)]
    rng_state = {"bit_generator": "PCG64",
                 "state": {"state": (words[0] << 64) | words[1], "inc": (words[2] << 64) | words[3]},
                 "has_uint32": words[4], "uinteger": words[5]}
    with self._cond:
      self._reset()
      for i, item in enumerate(items):
        slot = self._free.pop()
        self._items[slot] = item
        self._slot_uid[slot] = item.uid
        self._slot_version[slot] = item.policy_version
        self._slot_use[slot] = item.use_count
        if i < n_recent:
          self._recent[i] = slot
        else:
          self._pos[i - n_recent] = slot
        self._hold_group(slot, item)
      self._recent_count, self._pos_count = n_recent, n_pos
      for attr, key in (("_next_uid", "next_uid"), ("_total_added", "total_added"),
                        ("_total_sampled", "total_sampled"), ("_evicted", "evicted"),
                        ("_evicted_use_sum", "evicted_use_count_sum"), ("_promoted", "promoted"),
                        ("_consumed", "consumed"), ("_retired", "retired"),
                        ("_retired_use_sum", "retired_use_count_sum")):
        setattr(self, attr, int(scalar(key)) if key in state else 0)
      if "group_stats_id" in state:  # the reward ranges include members no longer held
        for gid, lo, hi in zip(np.asarray(state["group_stats_id"]).tolist(),
                               np.asarray(state["group_stats_min"]).tolist(),
                               np.asarray(state["group_stats_max"]).tolist()):
          g = self._groups.get(int(gid))
          if g is not None:
            g[0], g[1] = min(g[0], float(lo)), max(g[1], float(hi))
      # A checkpoint from before the counter: its evicted rollouts' uses are unknown, counted as 0.
      self._evicted_unused = int(state["evicted_unused"]) if "evicted_unused" in state else 0
      self._rng = np.random.Generator(np.random.PCG64())
      self._rng.bit_generator.state = rng_state
      self._last_batch_stats = None
      self._cond.notify_all()
