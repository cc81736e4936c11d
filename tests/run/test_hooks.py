"""`run.hooks.TrainerHooks`: every=N and rule-based hooks (the eval grid's compute points), all at
the run's last step, in registration order; decided once, run later."""
import pytest

from jaxreplay.run import hooks as hooks_lib
from jaxreplay.run.eval_grid import EvalGrid


def run_steps(hooks, steps, last):
  """Decides and runs the hooks for steps 1..steps (the last one finishes the run)."""
  for step in range(1, steps + 1):
    info = hooks_lib.StepInfo(step, finished=step == last, row={"step": step})
    hooks.run_hooks(info, hooks.decide(info))


def test_every_and_rules_and_the_last_step():
  calls = []
  hooks = hooks_lib.TrainerHooks()
  hooks.add_hook(lambda info: calls.append(("three", info.step)), every=3, name="three")
  hooks.add_hook(lambda info: calls.append(("end", info.step)), every=0, name="end")
  hooks.add_hook(lambda info: calls.append(("odd", info.step)), due=lambda i: i.step % 2 == 1,
                 name="odd")
  run_steps(hooks, 7, last=7)
  assert calls == [("odd", 1), ("three", 3), ("odd", 3), ("odd", 5), ("three", 6),
                   ("three", 7), ("end", 7), ("odd", 7)]  # step 7 finishes: every hook, in order
  assert hooks.names() == ("three", "end", "odd")


def test_the_eval_grid_as_a_rule_each_rule_called_once_per_step():
  """The compute-based rule: grid points crossed by the compute axis; pass@k only at its points.
  decide() calls each rule exactly once per step, also at the last step (the grid keeps state)."""
  compute = {1: 5.0, 2: 12.0, 3: 15.0, 4: 25.0, 5: 26.0}
  grid = EvalGrid(compute_grid=(10.0, 20.0, 30.0), passk_grid=(20.0,))
  seen, rule_calls = [], []

  def rule(info):
    rule_calls.append(info.step)
    return grid.due(info.step, info.finished, lambda: compute[info.step])

  hooks = hooks_lib.TrainerHooks()
  hooks.add_hook(lambda info: seen.append((info.step, grid.passk_due)), due=rule, name="evaluate")
  hooks.add_hook(lambda info: info.row.update(written=True), every=1, name="write")
  run_steps(hooks, 5, last=5)
  assert seen == [(2, False), (4, True), (5, True)]
  assert rule_calls == [1, 2, 3, 4, 5] and grid.next == 2


def test_a_hook_adds_to_the_row_before_the_next_one_reads_it():
  rows = []
  hooks = hooks_lib.TrainerHooks()
  hooks.add_hook(lambda info: info.row.update({"eval/pass@1": 0.5}), every=2, name="evaluate")
  hooks.add_hook(lambda info: rows.append(dict(info.row)), every=1, name="write")
  run_steps(hooks, 2, last=0)
  assert rows == [{"step": 1}, {"step": 2, "eval/pass@1": 0.5}]


def test_decided_earlier_run_later_and_errors():
  ran = []
  hooks = hooks_lib.TrainerHooks()
  hooks.add_hook(lambda info: ran.append(info.step), every=2, name="two")
  decision = hooks.decide(hooks_lib.StepInfo(2))
  assert decision == hooks_lib.Decision(2, (True,))
  # An agreed decision (process 0's) overrides what this process's rule would say.
  hooks.run_hooks(hooks_lib.StepInfo(3), hooks_lib.Decision(3, (True,)))
  assert ran == [3]
  with pytest.raises(ValueError, match="decision of step 2"):
    hooks.run_hooks(hooks_lib.StepInfo(3), decision)
  with pytest.raises(ValueError, match="exactly one of every="):
    hooks.add_hook(print, every=2, due=lambda info: True)
  with pytest.raises(ValueError, match="exactly one of every="):
    hooks.add_hook(print)
  with pytest.raises(ValueError, match="'two' is registered already"):
    hooks.add_hook(print, every=1, name="two")
  with pytest.raises(ValueError, match="every=-1"):
    hooks.add_hook(print, every=-1)
