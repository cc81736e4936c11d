"""When the pipeline evaluates: `EvalGrid`, the evaluation schedule and its resumable state.

Evaluations are due at the run's last step and either at each point of `config.eval.compute_grid`
that the compute axis has crossed by a step's end (device-seconds: virtual under the simulated and
sync schedules, measured under async) or, without a grid, every `eval.every` steps. With
`eval.passk_grid`, only the evaluations at those grid points (and the last) draw the pass@k
samples; the others measure pass@1. The state a resumed run needs (the next grid point, the
compute axis at the last step's end) is `state_dict()`, saved under the checkpoint host state's
"eval_grid" key (the same keys as before this class existed).

Refinement near pass@1 levels (`eval.refine_levels`, for compute-to-target readings): after each
evaluation (`observe`), when a level lies above the pass@1 just measured but within reach of it
(`eval.refine_band`, or farther when the curve's pace says it may get there: twice the last rise, or
`eval.refine_lookahead` times the last rise per device-second extrapolated over the compute left to
the next grid point, whichever reaches farthest), the grid interval ahead is split into
`eval.refine_splits` geometric parts, so that the crossing is read between points
(grid ratio)^(1/splits) apart instead of a whole grid step. Only an interval between two points of
the configured grid is split (the parts are not split again); the added points draw pass@1 only.
Evaluation samples its own noise, so the added points change no update of the run.

Why the pace lookahead: on a geometric grid of ratio r the interval ahead is r times the one behind
(evaluations fall at step ends, so in practice anywhere from 1 to ~2 times), and "twice the last rise"
covers a curve whose pace grows by up to 2 / r (1.6x on the decisive sweeps' grids, r = 2^(1/3)); a
curve that accelerates more crosses a level between two unrefined points. On-policy 3x seed 2 of
`pareto_multiplication_dense` rose 0.284 -> 0.304 over 113 device-s and then 0.304 -> 0.437 over
the next grid interval (245 device-s ahead), 2.3x its pace: that rule's reach (0.06) missed 0.414,
while 4 x the pace over the interval ahead (0.17) reaches it. 4 is the smallest of the multiples
tried (2, 3, 4, 5, 6) at which, replayed on both decisive sweeps' own evaluations
(`bench/refine_replay.py`), every first target crossing left between unrefined points follows a
flat or falling evaluation (noise, which no pace predicts): 2 of 172 on multiplication and 2 of 108
on the scratchpad, against 6 and 5 without the lookahead. It costs pass@1 evaluations only (30-35%
more intervals split).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence


class EvalGrid:
  """Which steps are evaluated, and whether an evaluation draws the pass@k samples.

  Args:
    compute_grid: the compute points [device-seconds] to evaluate at (any order; () for none).
    passk_grid: the compute points whose evaluations draw pass@k samples (() for all).
    every: without a compute grid, evaluate every this many steps (0: never, but the last step).
    refine_levels: pass@1 values whose crossing is read on a finer grid (module docstring; () for
      none). refine_band: how far below a level [pass@1] a measurement starts the refinement.
    refine_splits: the parts a refined grid interval is split into (>= 2).
    refine_lookahead: the multiple of the last pace (pass@1 rise per device-second) extrapolated
      over the compute left to the next grid point (0: the band and twice the last rise only).
  """

  def __init__(self, compute_grid: Sequence[float] = (), passk_grid: Sequence[float] = (),
               every: int = 0, refine_levels: Sequence[float] = (), refine_band: float = 0.05,
               refine_splits: int = 4, refine_lookahead: float = 4.0):
    self.points = sorted(float(x) for x in compute_grid)
    self.base_points = frozenset(self.points)  # the configured grid (refinement adds others)
    self.refine_levels = tuple(sorted(float(x) for x in refine_levels))
    self.refine_band, self.refine_splits = float(refine_band), int(refine_splits)
    self.refine_lookahead = float(refine_lookahead)
    self.added: list[float] = []  # the points refinement added, in the order it added them
    self.last_pass1: float | None = None  # the newest grid evaluation's pass@1
    self.last_compute: float | None = None  # the compute axis [device-s] at that evaluation
    self.next = 0  # index of the next compute-grid point to evaluate at
    self.passk_points = {float(x) for x in passk_grid}
    self.every = int(every)
    self.passk_due = True  # whether the next evaluation draws the pass@k samples
    self.compute_at_step_end = 0.0  # the compute axis when the last step ended

  @classmethod
  def from_config(cls, eval_config) -> "EvalGrid":
    """The grid of `config.eval`."""
    return cls(eval_config.compute_grid, eval_config.passk_grid, eval_config.every,
               eval_config.get("refine_levels", ()), eval_config.get("refine_band", 0.05),
               eval_config.get("refine_splits", 4), eval_config.get("refine_lookahead", 4.0))

  def observe(self, pass1: float | None, compute: float | None = None) -> list[float]:
    """After an evaluation at `compute` [device-s] (None: unknown, no slope lookahead): splits the
    grid interval ahead when a refine level is within reach above `pass1` (module docstring).
    Returns the points it added ([] when none)."""
    if pass1 is None or not self.refine_levels:
      return []
    previous, self.last_pass1 = self.last_pass1, float(pass1)
    before, self.last_compute = self.last_compute, None if compute is None else float(compute)
    if not 0 < self.next < len(self.points) or self.refine_splits < 2:
      return []
    lo, hi = self.points[self.next - 1], self.points[self.next]
    if lo <= 0 or lo not in self.base_points or hi not in self.base_points:
      return []
    reach = self.refine_band
    if previous is not None:
      rise = self.last_pass1 - previous
      reach = max(reach, 2 * rise)
      if self.last_compute is not None and before is not None and self.last_compute > before:
        ahead = max(hi - self.last_compute, 0.0)
        reach = max(reach, self.refine_lookahead * rise / (self.last_compute - before) * ahead)
    if not any(self.last_pass1 < level <= self.last_pass1 + reach for level in self.refine_levels):
      return []
    ratio = hi / lo
    new = [lo * ratio ** (j / self.refine_splits) for j in range(1, self.refine_splits)]
    self.points[self.next:self.next] = new
    self.added.extend(new)
    return new

  def due(self, step: int, finished: bool, compute: Callable[[], float]) -> bool:
    """Whether `step` is evaluated (the run's last step always is); moves past every grid point
    that `compute()` (the compute axis now, read only with a grid) has crossed, and sets
    `passk_due` for that evaluation."""
    self.passk_due = True
    if finished:
      return True
    if self.points:
      now, crossed = compute(), []
      while self.next < len(self.points) and self.points[self.next] <= now:
        crossed.append(self.points[self.next])
        self.next += 1
      self.passk_due = any(x in self.base_points and (not self.passk_points or x in self.passk_points)
                           for x in crossed)
      return bool(crossed)
    return bool(self.every) and step % self.every == 0

  def start(self) -> bool:
    """Whether step 0 (the initial policy) is evaluated; sets `passk_due` for it."""
    self.passk_due = not self.passk_points or 0.0 in self.passk_points
    return bool(self.every or self.points)

  def skip_evaluated(self, compute: float) -> None:
    """A fresh run, or one resumed from a checkpoint without this state: the grid points up to
    `compute` count as evaluated."""
    self.next = sum(1 for x in self.points if x <= compute)

  def state_dict(self) -> dict[str, Any]:
    """The checkpoint host state's "eval_grid": the next point and the compute at the step end
    (with refine levels also the added points and the last pass@1 and its compute)."""
    state: dict[str, Any] = {"next": self.next, "compute_at_step_end": self.compute_at_step_end}
    if self.refine_levels:
      state.update(added=list(self.added), last_pass1=self.last_pass1,
                   last_compute=self.last_compute)
    return state

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores `state_dict()` (also one written before this class: the same keys). The points up
    to the saved compute count as evaluated: the last step of a finished run is evaluated without
    moving past the points it crossed, and a run resumed to a longer budget (a grid that goes on,
    `science.sweeps.extended_grid`) must not evaluate them again at its next step."""
    self.compute_at_step_end = float(state["compute_at_step_end"])
    if self.refine_levels and state.get("added"):
      self.added = [float(x) for x in state["added"]]
      self.points = sorted(set(self.base_points).union(self.added))
    if self.refine_levels and state.get("last_pass1") is not None:
      self.last_pass1 = float(state["last_pass1"])
    if self.refine_levels and state.get("last_compute") is not None:  # absent before the lookahead
      self.last_compute = float(state["last_compute"])
    crossed = sum(1 for x in self.points if x <= self.compute_at_step_end)
    self.next = max(int(state["next"]), crossed)
