"""When the pipeline evaluates: `EvalGrid`, the evaluation schedule and its resumable state.

Evaluations are due at the run's last step and either at each point of `config.eval.compute_grid`
that the compute axis has crossed by a step's end (device-seconds: virtual under the simulated and
sync schedules, measured under async) or, without a grid, every `eval.every` steps. With
`eval.passk_grid`, only the evaluations at those grid points (and the last) draw the pass@k
samples; the others measure pass@1. The state a resumed run needs (the next grid point, the
compute axis at the last step's end) is `state_dict()`, saved under the checkpoint host state's
"eval_grid" key (the same keys as before this class existed).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence


class EvalGrid:
  """Which steps are evaluated, and whether an evaluation draws the pass@k samples.

  Args:
    compute_grid: the compute points [device-seconds] to evaluate at (any order; () for none).
    passk_grid: the compute points whose evaluations draw pass@k samples (() for all).
    every: without a compute grid, evaluate every this many steps (0: never, but the last step).
  """

  def __init__(self, compute_grid: Sequence[float] = (), passk_grid: Sequence[float] = (),
               every: int = 0):
    self.points = sorted(float(x) for x in compute_grid)
    self.next = 0  # index of the next compute-grid point to evaluate at
    self.passk_points = {float(x) for x in passk_grid}
    self.every = int(every)
    self.passk_due = True  # whether the next evaluation draws the pass@k samples
    self.compute_at_step_end = 0.0  # the compute axis when the last step ended

  @classmethod
  def from_config(cls, eval_config) -> "EvalGrid":
    """The grid of `config.eval`."""
    return cls(eval_config.compute_grid, eval_config.passk_grid, eval_config.every)

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
      self.passk_due = not self.passk_points or any(x in self.passk_points for x in crossed)
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
    """The checkpoint host state's "eval_grid": the next point and the compute at the step end."""
    return {"next": self.next, "compute_at_step_end": self.compute_at_step_end}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores `state_dict()` (also one written before this class: the same keys). The points up
    to the saved compute count as evaluated: the last step of a finished run is evaluated without
    moving past the points it crossed, and a run resumed to a longer budget (a grid that goes on,
    `science.sweeps.extended_grid`) must not evaluate them again at its next step."""
    self.compute_at_step_end = float(state["compute_at_step_end"])
    crossed = sum(1 for x in self.points if x <= self.compute_at_step_end)
    self.next = max(int(state["next"]), crossed)
