"""Several updates on each fresh batch: multi-epoch PPO-style reuse and Dynamic Gradient Gating.

Both designs take a fresh batch of B rollouts from the on-policy queue (`buffer.on_policy=True`,
LIFO: the newest B, removed from the queue) and train on it several times before the next one;
the behaviour log-probs stay those of generation (the PPO clip's old policy).

  trainer.ppo_epochs k, trainer.ppo_minibatches m (the classical baseline; k = m = 1 is one update
      per batch, the on-policy run itself, and this module is not used):
      k epochs over the batch, each a fresh random permutation of its B rollouts cut into m
      minibatches of B/m; k * m updates per batch, each on B/m rollouts (the permutation of epoch
      e of batch b is `np.random.default_rng([seed, b, e]).permutation(B)`). In the simulated
      schedule an update costs its minibatch's share of train_seconds_per_step (B/m of B), so a
      batch costs the generation of B rollouts and k full steps of training.

  buffer.reuse_control="gradient_gate" (Dynamic Gradient Gating, DGG: Miao et al., "When to Stop
      Reusing: Dynamic Gradient Gating for Sample-Efficient RLVR", arXiv 2605.19425): up to
      buffer.gate_max_reuse K updates on the whole batch while the gate does not fire. The gate
      watches the LM head's gradient energy g_k = |grad_lm_head|^2 (squared L2 norm of the
      unclipped gradient of the update's loss; `learner.trainer.gate_leaf`) of the k-th update on
      the batch and its increment d_k = g_k - g_{k-1} over the previous update on the same batch.
      A sliding window holds the last buffer.gate_window increments of the run (every d_k
      measured, fired ones included); once it is full, update k >= 2 is intercepted when
          z_k = (d_k - mean(window)) / std(window) > buffer.gate_threshold tau
      (population std; with std = 0 when d_k > mean). The train step decides it on the device
      before the optimizer (it receives the bound g_{k-1} + mean + tau * std, `gate_bound`): a
      fired update's gradient is dropped (params and Adam state untouched) and the batch ends, so
      the next update trains on fresh rollouts. The first update of a batch is never gated. The
      gate costs nothing beyond a normal step (the energy is read off the step's own gradient); a
      fired update is charged as the step it was (its forward and backward ran).

      What the paper says (its abstract; its full text is not in the reference stores searched
      here, so this follows secondary accounts of it: a summary page listing its claims,
      mouseion-sites.pages.dev/topics/dynamic-gradient-gating, and a Q&A digest): DGG
      "monitors the lm_head gradient norm in real time and intercepts harmful gradients before
      they corrupt the optimizer"; it "monitors lm_head gradient energy and its step-wise
      increment", keeps running mean and standard deviation estimates and fires when "the
      instantaneous Z-score exceeds the threshold tau", then (1) "zeros gradients ... before Adam
      updates the optimizer state" and (2) "ends reuse", resampling fresh rollouts; it "activates
      gating only after the sliding window is populated and the current reuse index is greater
      than one"; defaults: "maximum reuse K equal to 4 and threshold tau in the range 0.1 to 0.5"
      (experiments: tau in {0.1, 0.5, 1.0}). Choices made here where those accounts leave one:
      energy = the squared norm; the Z-score is that of the increment d_k (not of g_k) against a
      window of the last W = 10 increments measured within batches (gate_window; the window size
      is not stated); population std; tau = 0.5 (the upper end of the recommended range);
      "zeros gradients" = no optimizer step at all (Adam's moments are not decayed by a zero
      gradient); each reuse is one update on the whole batch (no minibatches). With tied
      embeddings (the nano preset's `tie_word_embeddings`) the LM head is the embedding matrix:
      the monitored gradient is that matrix's, the head's part plus the input-embedding rows'
      part, since Adam updates the one matrix with their sum (separating the head's part would
      take another backward pass).

Logged (metrics rows; `run.metrics_row`): batch_reuse/index (the update's number on its batch,
1-based), batch_reuse/epoch (ppo: 0-based epoch), and on the row that ends a batch
batch_reuse/updates (updates applied to it) and batch_reuse/epochs (passes over it: epochs taken;
for the gate, its applied updates); on every row batch_reuse/replay_ratio, the uses per rollout of
the fresh batches so far (applied updates / (m x batches): the reuse the buffer's
buffer/replay_ratio does not see, since the queue hands each batch out once); the gate's gate/lm_head_grad_energy, gate/fired,
gate/bound (the energy that would have fired; inf before the window is full or on a first update),
gate/zscore (once the window is full, on updates k >= 2), and a log line in words when it fires.
The held batch, the position in it and the gate's window are checkpointed (`state_dict`).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

from absl import logging
import numpy as np

from jaxreplay.data import buffer_state
from jaxreplay.learner.batch import Rollout

GATE_CONTROL = "gradient_gate"  # buffer.reuse_control's value for Dynamic Gradient Gating


@dataclasses.dataclass(frozen=True)
class GateSettings:
  """The buffer.gate_* keys (config/defaults.py): K, tau, W of the module docstring."""
  max_reuse: int = 4
  threshold: float = 0.5
  window: int = 10

  def __post_init__(self):
    if isinstance(self.max_reuse, bool) or int(self.max_reuse) != self.max_reuse or \
        self.max_reuse < 2:
      raise ValueError(f"buffer.gate_max_reuse={self.max_reuse!r} must be an int >= 2 (updates "
                       "per batch; the paper's K = 4)")
    if not math.isfinite(self.threshold):
      raise ValueError(f"buffer.gate_threshold={self.threshold} must be finite (a Z-score; the "
                       "paper's tau is 0.1-0.5)")
    if isinstance(self.window, bool) or int(self.window) != self.window or self.window < 2:
      raise ValueError(f"buffer.gate_window={self.window!r} must be an int >= 2 (increments in "
                       "the sliding window)")

  @classmethod
  def from_config(cls, b) -> "GateSettings":
    return cls(max_reuse=int(b.gate_max_reuse), threshold=float(b.gate_threshold),
               window=int(b.gate_window))


def gate_bound(previous: float, window: Sequence[float], threshold: float) -> float:
  """The largest gradient energy of the next update that does not fire: previous + mean + tau *
  std over the window of increments (z > tau <=> energy > this); float."""
  w = np.asarray(window, np.float64)
  return float(previous + w.mean() + threshold * w.std())


def zscore(increment: float, window: Sequence[float]) -> float:
  """(increment - mean) / std over the window (population std); +-inf or 0 when std = 0."""
  w = np.asarray(window, np.float64)
  mean, std = float(w.mean()), float(w.std())
  if std > 0:
    return (increment - mean) / std
  return 0.0 if increment == mean else math.copysign(math.inf, increment - mean)


class GradientGate:
  """DGG's state over a run: the window of the last W increments and the previous update's
  energy on the current batch (module docstring)."""

  def __init__(self, settings: GateSettings):
    self.settings = settings
    self.window: collections.deque = collections.deque(maxlen=int(settings.window))
    self.previous: Optional[float] = None

  @property
  def armed(self) -> bool:
    """Whether the window is populated (the gate may fire)."""
    return len(self.window) == self.window.maxlen

  def bound(self, index: int) -> float:
    """The energy bound of the update with reuse index `index` (1-based); inf when it may not
    fire (a first update, or the window not yet populated)."""
    if index <= 1 or not self.armed or self.previous is None:
      return math.inf
    return gate_bound(self.previous, self.window, self.settings.threshold)

  def record(self, index: int, energy: float) -> dict[str, float]:
    """Adds the measured energy of update `index`; returns its gate/zscore (armed, index >= 2)."""
    out = {}
    if index >= 2 and self.previous is not None:
      increment = energy - self.previous
      if self.armed:
        out["gate/zscore"] = zscore(increment, self.window)
      self.window.append(increment)
    self.previous = energy
    return out

  def state_dict(self) -> dict[str, Any]:
    return {"window": [float(x) for x in self.window],
            "previous": float("nan") if self.previous is None else float(self.previous)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.window.clear()
    self.window.extend(float(x) for x in state["window"])
    previous = float(state["previous"])
    self.previous = None if math.isnan(previous) else previous


class BatchReuse:
  """Which rollouts each update takes when every fresh batch is trained on several times.

  Args:
    batch_size: B, rollouts of a fresh batch.
    epochs, minibatches: ppo_epochs k and ppo_minibatches m (module docstring).
    gate: the gradient gate's settings (buffer.reuse_control="gradient_gate"), or None.
    seed: the run's seed (the epochs' permutations).
  `active` is False for k = m = 1 without a gate: one update per batch, nothing to reuse.
  Process 0 holds the batch (`begin`, `next_rollouts`); every trainer process calls `bound` and
  `record` on the same step metrics, so their positions and gate windows agree.
  """

  def __init__(self, batch_size: int, epochs: int = 1, minibatches: int = 1,
               gate: Optional[GateSettings] = None, seed: int = 0):
    for name, v in (("trainer.ppo_epochs", epochs), ("trainer.ppo_minibatches", minibatches)):
      if isinstance(v, bool) or int(v) != v or v < 1:
        raise ValueError(f"{name}={v!r} must be an int >= 1")
    if batch_size % minibatches:
      raise ValueError(f"trainer.ppo_minibatches={minibatches} must divide buffer.batch_size="
                       f"{batch_size} (minibatches of B/m rollouts)")
    if gate is not None and epochs * minibatches > 1:
      raise ValueError("buffer.reuse_control='gradient_gate' reuses each batch up to "
                       "buffer.gate_max_reuse times on its own: leave trainer.ppo_epochs and "
                       "trainer.ppo_minibatches at 1")
    self.batch_size, self.epochs, self.minibatches = int(batch_size), int(epochs), int(minibatches)
    self.gate = None if gate is None else GradientGate(gate)
    self.seed = int(seed)
    self.held: list[Rollout] = []
    self.index = 0     # updates taken on the held batch (0: the next update needs a fresh batch)
    self.batches = 0   # fresh batches begun
    self.applied = 0   # updates applied to the held batch (a fired gate's update is not)
    self.total_applied = 0  # updates applied over the run (batch_reuse/replay_ratio)

  @classmethod
  def from_config(cls, c) -> "BatchReuse":
    gate = GateSettings.from_config(c.buffer) if c.buffer.reuse_control == GATE_CONTROL else None
    return cls(c.buffer.batch_size, int(c.trainer.get("ppo_epochs", 1)),
               int(c.trainer.get("ppo_minibatches", 1)), gate, c.seed)

  @property
  def active(self) -> bool:
    return self.gate is not None or self.epochs * self.minibatches > 1

  @property
  def max_updates(self) -> int:
    """Updates per batch at most: k * m, or the gate's K."""
    return self.gate.settings.max_reuse if self.gate is not None else self.epochs * self.minibatches

  @property
  def share(self) -> float:
    """An update's rollouts over B (1 / m): its share of a full step's training cost."""
    return 1.0 / self.minibatches

  def wants_fresh(self) -> bool:
    """Whether the next update starts a new batch."""
    return self.index == 0

  def begin(self, rollouts: Sequence[Rollout]) -> None:
    """Holds a fresh batch of B rollouts (process 0)."""
    if len(rollouts) != self.batch_size:
      raise ValueError(f"a fresh batch of {len(rollouts)} rollouts, expected B={self.batch_size}")
    self.held = list(rollouts)
    self.batches += 1

  def next_rollouts(self) -> list[Rollout]:
    """The rollouts of the next update on the held batch (process 0): the whole batch, or
    minibatch j of epoch e's permutation."""
    if not self.held:
      raise RuntimeError("BatchReuse.next_rollouts without a batch: call begin() first")
    if self.minibatches == 1:  # whole-batch updates (the gate's, or epochs without minibatches)
      return list(self.held)
    epoch, j = divmod(self.index, self.minibatches)
    size = self.batch_size // self.minibatches
    order = self.permutation(self.batches - 1, epoch)[j * size:(j + 1) * size]
    return [self.held[i] for i in order.tolist()]

  def permutation(self, batch: int, epoch: int) -> np.ndarray:
    """The order of the held batch's rollouts in `epoch` of batch number `batch` (0-based)."""
    return np.random.default_rng([self.seed, int(batch), int(epoch)]).permutation(self.batch_size)

  def bound(self) -> float:
    """The gradient gate's energy bound for the next update (inf: it may not fire)."""
    return math.inf if self.gate is None else self.gate.bound(self.index + 1)

  def record(self, metrics: Mapping[str, float], step: int) -> dict[str, float]:
    """Advances past the update just taken (every process, on the same step metrics); returns
    the batch_reuse/* and gate/* keys of its row (module docstring) and logs a fired gate."""
    index = self.index + 1
    out = {"batch_reuse/index": float(index)}
    if self.gate is None:
      out["batch_reuse/epoch"] = float((index - 1) // self.minibatches)
      fired = False
    else:
      bound, previous = self.gate.bound(index), self.gate.previous
      energy = float(metrics["gate/lm_head_grad_energy"])
      fired = bool(metrics["gate/fired"] > 0)
      window = np.asarray(self.gate.window, np.float64)
      out.update(self.gate.record(index, energy))
      out["gate/bound"] = bound
      if fired:
        logging.info(
            "gradient gate at step %d: lm_head gradient energy %.4g on reuse %d of batch %d rose "
            "%.3g over the previous update, z = %.2f > tau %.2f (the last %d increments: mean "
            "%.3g, std %.3g): update intercepted before the optimizer; the batch ends after %d "
            "applied updates, fresh rollouts next", step, energy, index, self.batches,
            energy - previous, out.get("gate/zscore", math.inf), self.gate.settings.threshold,
            window.size, window.mean(), window.std(), self.applied)
    self.applied += 0 if fired else 1
    if self.total_applied is not None:  # uses per rollout of the fresh batches so far
      self.total_applied += 0 if fired else 1
      out["batch_reuse/replay_ratio"] = self.total_applied / (self.minibatches * self.batches)
    self.index = index
    if fired or index >= self.max_updates:
      out["batch_reuse/updates"] = float(self.applied)
      out["batch_reuse/epochs"] = float(self.applied // self.minibatches)
      self.index, self.applied, self.held = 0, 0, []
    return out

  def state_dict(self) -> dict[str, Any]:
    """The held batch (arrays of `data.buffer_state`), the position in it and the gate's window."""
    state = {"index": self.index, "batches": self.batches, "applied": self.applied,
             "total_applied": self.total_applied, "held": len(self.held),
             "gate": None if self.gate is None else self.gate.state_dict()}
    if self.held:
      state["rollouts"] = buffer_state.rollouts_to_arrays(self.held)
    return state

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.index, self.batches = int(state["index"]), int(state["batches"])
    self.applied = int(state["applied"])
    # A checkpoint from before the key cannot tell its past updates: batch_reuse/replay_ratio is
    # then left out of the rows (None), never made up.
    total = state.get("total_applied")
    self.total_applied = None if total is None else int(total)
    held = int(state["held"])
    self.held = buffer_state.rollouts_from_arrays(state["rollouts"], held) if held else []
    if self.gate is not None and state.get("gate") is not None:
      self.gate.load_state_dict(state["gate"])
