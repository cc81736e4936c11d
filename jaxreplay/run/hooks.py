"""What runs at a step's end, and when: `TrainerHooks`, levanter's `TrainerHooks` in small.

A hook is a function of the step's `StepInfo`, registered with the rule that says when it is due:

    hooks = TrainerHooks()
    hooks.add_hook(write_row, every=1)                  # every step
    hooks.add_hook(save_checkpoint, every=100)          # steps 100, 200, ... (0: only the last)
    hooks.add_hook(evaluate, due=eval_grid_rule)        # any rule StepInfo -> bool (the eval
                                                        # grid's compute points, `eval_grid`)

At the run's last step (`StepInfo.finished`) every hook runs, as levanter's `force=True` does.
Hooks run in the order they were added (the pipeline: evaluation, which adds its metrics to the
row, then the row's writer, then checkpoint, then HF export).

Deciding and running are two calls, so that the pipeline can decide at a step's end (before it
publishes), agree on the decisions across trainer processes (process 0's, one allgather), and run
the hooks afterwards: `decide(info) -> Decision`, `run_hooks(info, decision)`. A rule is called
exactly once per step end, in `decide`, also when the run finishes (a rule may keep state: the
eval grid moves past the compute points it crossed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

Rule = Callable[["StepInfo"], bool]


@dataclasses.dataclass
class StepInfo:
  """One step's end, as the hooks see it.

  step: updates taken so far (the step just finished). finished: the run's last step (every hook
  runs). row: the step's metrics row (a hook may add to it: the evaluation's eval/* keys).
  result: the schedule's handle of the step (`training.StepResult`: its metrics, its rollouts).
  """
  step: int
  finished: bool = False
  row: dict = dataclasses.field(default_factory=dict)
  result: Any = None


def every_steps(n: int) -> Rule:
  """The rule of steps n, 2n, ... (n = 0: no step; the hook then runs only when finished)."""
  if n < 0:
    raise ValueError(f"every={n}: expected a step count >= 0 (0 = only at the run's end)")
  return lambda info: bool(n) and info.step % n == 0


@dataclasses.dataclass(frozen=True)
class Hook:
  name: str
  fn: Callable[[StepInfo], None]
  due: Rule


@dataclasses.dataclass(frozen=True)
class Decision:
  """Which hooks run at `step` (one flag per hook, in registration order)."""
  step: int
  flags: tuple[bool, ...]


class TrainerHooks:
  """The hooks of a run, in registration order (module docstring)."""

  def __init__(self):
    self.hooks: list[Hook] = []

  def add_hook(self, fn: Callable[[StepInfo], None], *, every: Optional[int] = None,
               due: Optional[Rule] = None, name: Optional[str] = None) -> Hook:
    """Registers `fn(info)`, due by `every=N` (steps N, 2N, ...; 0: only the last) or by the rule
    `due(info) -> bool` (exactly one of the two)."""
    if (every is None) == (due is None):
      raise ValueError("add_hook takes exactly one of every= (a step count) or due= (a rule)")
    rule = every_steps(every) if every is not None else due
    hook = Hook(name or getattr(fn, "__name__", f"hook{len(self.hooks)}"), fn, rule)
    if hook.name in self.names():
      raise ValueError(f"a hook named {hook.name!r} is registered already")
    self.hooks.append(hook)
    return hook

  def names(self) -> tuple[str, ...]:
    return tuple(h.name for h in self.hooks)

  def index(self, name: str) -> int:
    return self.names().index(name)

  def decide(self, info: StepInfo) -> Decision:
    """Each hook's rule at this step end (every rule is called once); all due when finished."""
    flags = []
    for hook in self.hooks:
      due = bool(hook.due(info))
      flags.append(due or info.finished)
    return Decision(info.step, tuple(flags))

  def run_hooks(self, info: StepInfo, decision: Optional[Decision] = None) -> None:
    """Runs the hooks `decision` (default: `decide(info)` now) marks as due, in order."""
    if decision is None:
      decision = self.decide(info)
    if decision.step != info.step or len(decision.flags) != len(self.hooks):
      raise ValueError(f"the decision of step {decision.step} ({len(decision.flags)} hooks) is "
                       f"not that of step {info.step} ({len(self.hooks)} hooks)")
    for hook, due in zip(self.hooks, decision.flags):
      if due:
        hook.fn(info)
