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
The buffer is storage; `sample` delegates the choice of a batch to a sampler strategy of
`data.samplers` (its `SAMPLERS` table by `buffer.priority`: uniform over everything held (both
regions) by default; `buffer.replace_zero_variance`; the queues below) and keeps the bookkeeping
(use counts, `max_uses` retirement, staleness statistics). The checkpoint format is in
`data.buffer_state`.

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

from jaxreplay.data import buffer_state
from jaxreplay.data import samplers
from jaxreplay.data.buffer_keys import (  # noqa: F401 (re-exported)
    BATCH_KEYS, HELD_STALENESS_KEYS, MAX_USES_KEYS,
    METRIC_KEYS, STALENESS_KEYS, ZERO_VARIANCE_KEYS)
from jaxreplay.data.samplers import (sampler_options,  # noqa: F401 (re-exported)
                                     successive_sampling)
from jaxreplay.learner.batch import Rollout  # re-exported: `buffer.Rollout` is public

_STATE_FORMAT = buffer_state.STATE_FORMAT  # old names, kept for callers and tests
_STATE_KEYS = buffer_state.STATE_KEYS
_OPTIONAL_STATE_KEYS = buffer_state.OPTIONAL_STATE_KEYS


class BufferClosedError(RuntimeError):
  """Raised by `sample`/`add` after `ReplayBuffer.close()` (the pipeline is shutting down)."""


def _region_sizes(capacity: int, positive_fraction: float) -> tuple[int, int]:
  """(n_recent, n_positive): n_positive = floor(delta * N), n_recent = N - n_positive."""
  n_positive = int(math.floor(positive_fraction * capacity + 1e-9))
  return capacity - n_positive, n_positive


class _Held:
  """The `samplers.Held` view of a buffer's storage for one draw (taken under its lock)."""

  def __init__(self, buf: "ReplayBuffer"):
    self._buf = buf
    self.size, self.recent_size = buf._size(), buf._recent_count  # pylint: disable=protected-access
    self.slots = buf._logical_slots  # pylint: disable=protected-access

  def versions(self, slots: np.ndarray) -> np.ndarray:
    return self._buf._slot_version[slots]  # pylint: disable=protected-access

  def uses(self, slots: np.ndarray) -> np.ndarray:
    return self._buf._slot_use[slots]  # pylint: disable=protected-access

  def zero_variance(self, slots: np.ndarray) -> np.ndarray:
    return self._buf._zero_variance(slots)  # pylint: disable=protected-access

  def rewards(self, slots: np.ndarray) -> np.ndarray:
    items = self._buf._items  # pylint: disable=protected-access
    return np.array([items[s].reward for s in slots.tolist()], np.float64)

  def advantages(self, slots: np.ndarray) -> np.ndarray:
    items = self._buf._items  # pylint: disable=protected-access
    return np.array([items[s].advantage for s in slots.tolist()], np.float64)


class ReplayBuffer:
  """A FIFO replay buffer of rollouts with uniform sampling (see the module docstring).

  Args:
    capacity: N, the most rollouts held (both regions together).
    seed: seeds the numpy Generator (PCG64) that draws the batches.
    positive_fraction: delta in [0, 1); the positive-bias region holds floor(delta * N) slots.
    consume: the on-policy queue: `sample` removes the B rollouts it returns.
    consume_order: which B a consuming `sample` pops: "lifo" (the newest, the paper's baseline) or
      "fifo" (the oldest).
    priority: a name of `samplers.SAMPLERS` ("uniform"; "fresh": draw priority
      (p_base * exp(-age / fresh_tau)) ** fresh_alpha, see `data.samplers`).
    fresh_tau: tau > 0 of priority "fresh" [updates].
    fresh_base, fresh_alpha, fresh_eps: p_base ("uniform", "reward": |reward| + fresh_eps,
      "advantage": |advantage| + fresh_eps) and the exponent of priority "fresh" (FreshPER:
      "reward", 0.6, 1e-6).
    max_uses: k > 0: a rollout leaves after its k-th use; 0 = no cap.
    replace_zero_variance: draw rollouts of zero-variance groups only when the others are too few.
  The sampler options do not apply to a consuming queue (each rollout is used once there).
  """

  def __init__(self, capacity: int, seed: int = 0, positive_fraction: float = 0.0,
               consume: bool = False, consume_order: str = "lifo", priority: str = "uniform",
               fresh_tau: float = 4.0, max_uses: int = 0, replace_zero_variance: bool = False,
               fresh_base: str = "uniform", fresh_alpha: float = 1.0, fresh_eps: float = 1e-6):
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
    if consume_order not in samplers.QUEUES:
      raise ValueError(f"consume_order={consume_order!r}; expected one of {tuple(samplers.QUEUES)}")
    samplers.check_options(priority, fresh_tau, max_uses, replace_zero_variance, consume,
                           fresh_base, fresh_alpha, fresh_eps)
    self.priority, self.fresh_tau = priority, float(fresh_tau)
    self.max_uses, self.replace_zero_variance = int(max_uses), bool(replace_zero_variance)
    # how `sample` picks a batch: the queue's order, else the priority's sampler
    self._sampler = (samplers.QUEUES[consume_order] if consume else samplers.make_sampler(
        priority, samplers.SamplerOptions(self.fresh_tau, self.replace_zero_variance,
                                          str(fresh_base), float(fresh_alpha),
                                          float(fresh_eps))))
    self.capacity = int(capacity)
    self.positive_fraction = positive_fraction
    self.consume = bool(consume)
    self.consume_order = consume_order
    self.n_recent, self.n_positive = n_recent, n_positive
    self._seed = seed
    self._cond = threading.Condition(threading.Lock())
    self._closed = False
    self._newest_unused = None  # a samplers.NewestUnused over `_sampler` while switched on
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
    self._take_out(slots)
    for s in slots.tolist():
      self._retired += 1
      self._retired_use_sum += int(self._slot_use[s])
      self._drop(s, evicted=False)

  def _consume(self, slots: np.ndarray) -> None:
    """Removes the on-policy queue's batch `slots` (each rollout is used once)."""
    self._take_out(slots)
    self._consumed += int(slots.size)
    for s in slots.tolist():
      self._drop(s, evicted=False)

  def _take_out(self, slots: np.ndarray) -> None:
    """Removes `slots` from the rings of both regions, keeping the FIFO order of the rest."""
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

  def _zero_variance(self, slots: np.ndarray) -> np.ndarray:
    """bool [len(slots)]: whether each slot's group has all rewards equal."""
    groups = self._groups
    return np.fromiter((groups[g][0] == groups[g][1] for g in self._slot_group[slots].tolist()),
                       bool, count=len(slots))

  # ---- sampling --------------------------------------------------------------------------------

  @property
  def total_added(self) -> int:
    """Rollouts ever added (resumes included). Read without the lock (an int read is atomic), so
    a gate that holds another lock may ask it (`data.reuse`)."""
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
    """Returns `batch_size` distinct rollouts chosen by the buffer's sampler (`data.samplers`:
    uniformly from what is held by default).

    Blocks until at least `batch_size` rollouts are held (at most `timeout` seconds, then
    TimeoutError). Nothing is removed unless `consume=True`, which pops the queue's `batch_size`
    (newest or oldest) instead. Uniform draws use numpy's `Generator.choice(size, B,
    replace=False)`, whose cost grows with B, not with the number held (measured: ~40 us for B=1000
    from 2e3 to 2e6 held); the logical positions map to slots with vectorised ring arithmetic.
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
      sampler = self._sampler if self._newest_unused is None else self._newest_unused
      slots = sampler.draw(_Held(self), self._rng, batch_size)
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
      if sampler.consumes:
        self._consume(slots)
      return out

  def set_newest_unused(self, on: bool) -> None:
    """While on, `sample` takes the B newest never-used rollouts whenever at least B are held in
    the recent region (the on-policy LIFO queue's batch, without removing anything, so the
    rollouts stay available if reuse is raised again), and draws as configured otherwise. The
    reuse controller switches it on while its replay ratio is 1 (`data.reuse`)."""
    with self._cond:
      self._newest_unused = samplers.NewestUnused(self._sampler) if on else None

  @property
  def newest_unused(self) -> bool:
    return self._newest_unused is not None

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
      return {
          "format": buffer_state.STATE_FORMAT,
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
          "rng_state": buffer_state.rng_to_words(self._rng),
          **buffer_state.rollouts_to_arrays(items),
      }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()` output; capacity, positive_fraction and consume (with its order)
    must match. The sampler options are this buffer's own (they may change across a resume); a
    state from before them (no retired count, no group reward ranges) loads too."""
    missing = sorted(set(buffer_state.STATE_KEYS) - set(state))
    if missing:
      raise ValueError(f"buffer state is missing keys {missing}: not a ReplayBuffer.state_dict()")
    scalar = lambda k: np.asarray(state[k]).item()
    if int(scalar("format")) != buffer_state.STATE_FORMAT:
      raise ValueError(f"buffer state format {scalar('format')} != {buffer_state.STATE_FORMAT}")
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
    items = buffer_state.rollouts_from_arrays(state, held)
    rng = buffer_state.rng_from_words(state["rng_state"])
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
      self._rng = rng
      self._last_batch_stats = None
      self._cond.notify_all()
