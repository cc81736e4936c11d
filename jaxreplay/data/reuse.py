"""The reuse controller: how many times each rollout is trained on, paced or set online.

Without it (buffer.reuse_control="off") the replay ratio is whatever the hardware split makes it:
W workers generate as fast as they can and T trainer devices sample B rollouts per step, so each
rollout is used ~mu T / W times, and when generation outruns training rollouts are evicted
unused (their compute wasted; `buffer/never_used_fraction`).

With it, generation is paced against training so that the run's replay ratio is a chosen rho
(rollouts generated per update R = B / rho; each update then costs (1 + mu / rho) training units,
the theory's c = B + mu R at B / R = rho):
  - a worker may start a request only while the rollouts added and in flight stay within one
    update's worth (B / rho + one request) of what the next update needs (the throttle: no
    rollout is generated that training will not reach, staleness stays bounded);
  - the trainer takes step t + 1 only once B + sum_{s <= t} B / rho_s rollouts have been added
    (it waits for fresh data when rho is below the hardware's natural ratio).
Idle devices are not charged: compute is active device-seconds (generation + training), as for
every arm, so a paced run is charged exactly what it generates and trains.

buffer.reuse_control:
  "fixed"     rho = buffer.reuse_target for the whole run (a design point, like the sync grid's
              B / R).
  "adaptive"  rho starts at buffer.reuse_target and is re-decided at every regime measurement
              (`run.regime`, log.diagnostics_every steps), by a rule with no constant fit to a task
              (`optimal_reuse`, `staleness_bound`; derivation in docs/regimes.md):
                rho* = sqrt(mu * ESS * B / noise_scale)
              is the replay ratio that maximises progress per unit of compute when an update on B
              rollouts, R = B / rho of them fresh, progresses like a fresh batch of R in its noise
              (McCandlish et al.'s 1 / (1 + noise_scale / batch)) at a cost of (1 + mu / rho) updates'
              training; ESS (diag/is_ess, in (0, 1]) is the share of the batch the importance
              weights leave effective. mu is scheduler.mu (generation / training cost per update),
              B / noise_scale is diag/batch_over_noise_scale. Below a signal of 1 / mu rho* < 1:
              fresh data only. rho is then bounded by staleness: a uniform draw from N is
              N rho / (2 B) updates old on average, so with the policy moving diag/update_kl per
              update the batch's behaviour KL stays under reuse_kl_max while
                rho <= 2 B reuse_kl_max / (N update_kl);
              reuse_kl_max defaults to eps^2 / 2 = 0.02 for the clip eps = 0.2: a rollout whose
              ratios leave the clip range gives no gradient. One measured guard remains: the
              batch's behaviour KL (k3) above reuse_kl_max cuts rho by a third (the bound assumes
              drift that adds up linearly; this catches when it does not). Optional guards, off by
              default (0): IS ESS below reuse_ess_min, update KL above reuse_update_kl_max.
              The first measurement (step 0) sets rho directly; after it rho moves by at most
              1.5x per decision (the noise scale is itself a moving average: this only keeps one
              noisy measurement from swinging the pacing). rho stays in [reuse_min, reuse_max];
              every decision is logged with its reason (controller/* keys, and a log line in
              words).
  "gradient_gate"  not a pacing control: Dynamic Gradient Gating over the on-policy queue
              (`data.batch_reuse`): each fresh batch is reused while the LM head's gradient shows
              no surge, up to buffer.gate_max_reuse updates. This controller stays inactive.
Only "adaptive" reads the regime diagnostics (`READS_DIAGNOSTICS`): with log.charge_diagnostics
"auto" their extra passes are charged to its compute (`run.regime`).
At a replay ratio of 1 (fixed reuse_target = 1, or adaptive at reuse_min = 1) each update takes the
newest B never-used rollouts (`ReplayBuffer.set_newest_unused`): the on-policy LIFO queue's batch,
whereas a uniform draw from N would train on rollouts ~N / (2B) versions old and leave others
unused. Above 1 the buffer samples as configured (uniform, or with its positive bias).
The controller's state (rho, the rollouts the steps so far required, the decisions taken) is
checkpointed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from absl import logging

REUSE_CONTROLS = ("off", "fixed", "adaptive", "gradient_gate")
PACING_CONTROLS = ("fixed", "adaptive")  # the controls this controller paces generation for
READS_DIAGNOSTICS = ("adaptive",)        # the controls that decide from the regime diagnostics
MAX_MOVE = 1.5                        # largest change of rho per decision (factor)
GUARD_CUT = 2.0 / 3.0                 # the factor a firing staleness guard applies


@dataclasses.dataclass(frozen=True)
class ReuseSettings:
  """The buffer.reuse_* keys (see config/defaults.py)."""
  control: str = "off"
  target: float = 2.0
  reuse_min: float = 1.0
  reuse_max: float = 4.0
  kl_max: float = 0.02
  ess_min: float = 0.0        # 0: off (the ESS enters rho* itself)
  update_kl_max: float = 0.0  # 0: off (the update KL enters the staleness bound itself)
  mu: float = 6.84            # generation / training cost per update (scheduler.mu)

  def __post_init__(self):
    if self.control not in REUSE_CONTROLS:
      raise ValueError(f"buffer.reuse_control={self.control!r}: expected one of {REUSE_CONTROLS}")
    if not 1.0 <= self.reuse_min <= self.reuse_max:
      raise ValueError(f"buffer.reuse_min={self.reuse_min}, buffer.reuse_max={self.reuse_max}: "
                       "need 1 <= reuse_min <= reuse_max (uses per rollout)")
    if not self.reuse_min <= self.target <= self.reuse_max and self.control in PACING_CONTROLS:
      raise ValueError(f"buffer.reuse_target={self.target} must be in [reuse_min, reuse_max] = "
                       f"[{self.reuse_min}, {self.reuse_max}]")
    if self.kl_max <= 0 or self.update_kl_max < 0 or not 0 <= self.ess_min <= 1:
      raise ValueError("buffer.reuse_kl_max must be > 0, buffer.reuse_update_kl_max >= 0 (0: off) "
                       f"and buffer.reuse_ess_min in [0, 1] (0: off); got {self.kl_max}, "
                       f"{self.update_kl_max}, {self.ess_min}")
    if not self.mu > 0:
      raise ValueError(f"scheduler.mu={self.mu}: the generation / training cost ratio must be > 0")

  @classmethod
  def from_config(cls, b, mu: float) -> "ReuseSettings":
    """b: the buffer section; mu: scheduler.mu."""
    return cls(control=str(b.reuse_control), target=float(b.reuse_target),
               reuse_min=float(b.reuse_min), reuse_max=float(b.reuse_max),
               kl_max=float(b.reuse_kl_max), ess_min=float(b.reuse_ess_min),
               update_kl_max=float(b.reuse_update_kl_max), mu=float(mu))


def optimal_reuse(signal: float, mu: float, ess: float = 1.0) -> float:
  """rho* = sqrt(mu * ess * signal): the replay ratio (uses per rollout) that maximises progress
  per unit of compute, unclipped.

  signal = B / noise_scale; ess in (0, 1] (the importance weights' normalised effective sample
  size; NaN is read as 1). An update on B rollouts of which R = B / rho are fresh progresses like
  a fresh batch of R, 1 / (1 + rho / (ess signal)) of a noiseless step, and costs (1 + mu / rho)
  updates' training (generating R = B / rho rollouts costs mu / rho of training B). Maximising
  the ratio, d/drho [(1 + rho / s)(1 + mu / rho)] = 1 / s - mu / rho^2 = 0 gives rho = sqrt(mu s).
  0 for an undefined or non-positive signal (no reuse)."""
  if not math.isfinite(ess) or ess <= 0:
    ess = 1.0
  if not math.isfinite(signal) or signal <= 0:
    return 0.0
  return math.sqrt(mu * min(ess, 1.0) * signal)


def staleness_bound(update_kl: float, kl_max: float, batch_size: int, buffer_size: int) -> float:
  """The largest rho whose batches stay within `kl_max` of behaviour KL: 2 B kl_max / (N u).

  At replay ratio rho the buffer of N holds the rollouts of N rho / B updates, so a uniform draw
  is on average N rho / (2 B) updates old; the policy moving u = update_kl (nats/token) per update
  puts the batch's behaviour KL near u N rho / (2 B). Infinite when u is not measured (NaN or
  <= 0)."""
  if not math.isfinite(update_kl) or update_kl <= 0:
    return math.inf
  return 2.0 * batch_size * kl_max / (buffer_size * update_kl)


class ReuseController:
  """Paces generation against training (module docstring). Thread-safe use: the gates are read by
  worker threads; the counters they read are the buffer's and the intake's (locked there)."""

  def __init__(self, settings: ReuseSettings, batch_size: int, request_rollouts: int,
               buffer: Optional[Any] = None, buffer_size: Optional[int] = None):
    """buffer: the `ReplayBuffer` it paces; given, it is told to take the newest unused rollouts
    while rho is 1 (module docstring). buffer_size: N for the staleness bound (default: the
    buffer's capacity, else 4 B)."""
    self.settings = settings
    self.batch_size, self.request_rollouts = int(batch_size), int(request_rollouts)
    self.buffer = buffer
    if buffer_size is None:
      buffer_size = buffer.capacity if buffer is not None else 4 * self.batch_size
    self.buffer_size = int(buffer_size)
    self.rho = float(settings.target)
    self.required = float(batch_size)  # rollouts that must have been added for the next step
    self.decisions = 0
    self.last: dict[str, Any] = {}
    self._apply_sampling()

  @property
  def newest_unused(self) -> bool:
    """Whether updates take the newest unused rollouts (rho = 1: on-policy batches)."""
    return self.active and self.rho <= 1.0 + 1e-9

  def _apply_sampling(self) -> None:
    if self.buffer is not None and self.active:
      self.buffer.set_newest_unused(self.newest_unused)

  @property
  def active(self) -> bool:
    """Whether it paces generation (buffer.reuse_control "fixed" or "adaptive")."""
    return self.settings.control in PACING_CONTROLS

  def may_start_request(self, added: int, in_flight: int) -> bool:
    """The worker gate: one more request may start (the throttle)."""
    if not self.active:
      return True
    ahead = self.batch_size / self.rho + self.request_rollouts
    return added + in_flight + self.request_rollouts <= self.required + ahead

  def may_train(self, added: int) -> bool:
    """The trainer gate: enough rollouts were added for the next step."""
    return not self.active or added >= self.required - 1e-9

  def stepped(self) -> None:
    """One update was taken: the next needs B / rho more fresh rollouts."""
    if self.active:
      self.required += self.batch_size / self.rho

  def decide(self, diag: Mapping[str, float], step: int) -> dict[str, Any]:
    """Re-decides rho from a regime measurement (adaptive only); returns the controller/* keys."""
    s = self.settings
    if s.control != "adaptive":
      return {"controller/reuse_target": self.rho} if self.active else {}
    signal = float(diag.get("diag/batch_over_noise_scale", float("nan")))
    ess = float(diag.get("diag/is_ess", float("nan")))
    update_kl = float(diag.get("diag/update_kl", float("nan")))
    best = optimal_reuse(signal, s.mu, ess)
    bound = staleness_bound(update_kl, s.kl_max, self.batch_size, self.buffer_size)
    want = min(best, bound)
    reasons = [f"batch/noise scale {signal:.3g} x ESS {ess:.3g}, mu {s.mu:g} -> rho* {best:.3g}"]
    if bound < best:
      reasons.append(f"update KL {update_kl:.3g} bounds rho at {bound:.3g}")
    guards = [("diag/behaviour_kl_k3", lambda v: v > s.kl_max, f"behaviour KL > {s.kl_max:g}")]
    if s.ess_min > 0:
      guards.append(("diag/is_ess", lambda v: v < s.ess_min, f"IS ESS < {s.ess_min:g}"))
    if s.update_kl_max > 0:
      guards.append(("diag/update_kl", lambda v: v > s.update_kl_max,
                     f"update KL > {s.update_kl_max:g}"))
    fired = 0
    for key, test, text in guards:
      v = diag.get(key)
      if v is not None and math.isfinite(v) and test(v):
        want = min(want, self.rho) * GUARD_CUT
        reasons.append(f"{text} ({v:.3g}): stale, cut")
        fired += 1
    if self.decisions == 0:  # the first measurement sets rho: the start value was a guess
      new = min(max(want, s.reuse_min), s.reuse_max)
    else:
      new = min(max(want, self.rho / MAX_MOVE, s.reuse_min), self.rho * MAX_MOVE, s.reuse_max)
    if abs(new - self.rho) > 1e-9:
      logging.info("reuse controller at step %d: rho %.3g -> %.3g (%s)", step, self.rho, new,
                   "; ".join(reasons))
    self.rho = new
    self.decisions += 1
    self._apply_sampling()
    self.last = {"controller/reuse_target": new, "controller/signal": signal,
                 "controller/optimal": best, "controller/guards_fired": float(fired),
                 "controller/newest_unused": float(self.newest_unused),
                 "controller/reason": "; ".join(reasons)}
    if math.isfinite(bound):
      self.last["controller/staleness_bound"] = bound
    return dict(self.last)

  def state_dict(self) -> dict[str, float]:
    return {"rho": self.rho, "required": self.required, "decisions": float(self.decisions)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.rho, self.required = float(state["rho"]), float(state["required"])
    # checkpoints from before the first-decision rule had decided at least once (step 0)
    self.decisions = int(state.get("decisions", 1))
    self._apply_sampling()
