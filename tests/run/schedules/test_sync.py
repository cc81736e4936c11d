"""The synchronous schedule over fake hooks: R rollouts, then one step."""
import pytest

from jaxreplay.run.schedules import GenerationCost, SimState, SyncScheduler
from tests.helpers.schedule_fakes import FakeHooks, FakeWorker


def test_sync_schedule_generates_r_then_trains_one_step():
  log = []
  hooks = FakeHooks(batch=4, total=3)
  state = SimState(reference_tokens=2.0)
  sched = SyncScheduler(lambda i, w: FakeWorker(w, log), 2, 1, 4, GenerationCost(0.5, 0.0, state),
                        1.0, state)
  sched.run(hooks)
  # R = 4 rollouts (2 requests) per step, each with the weights of the step before.
  assert hooks.intake.delivered_versions == [0, 0, 1, 1, 2, 2]
  assert [e[1] for e in hooks.events if e[0] == "train"] == [0, 1, 2]
  assert state.generation_device_seconds == pytest.approx(3 * 4 * 0.5)
  assert state.training_device_seconds == 3.0
  assert state.clock == pytest.approx(3 * (2.0 / 2 + 1.0))  # generation on W=2, training on T=1
  assert log[0] == ("make", 0) and ("load", 2) in log
  hooks = FakeHooks(batch=4, consume=True, capacity=2, total=1)  # R does not fit the queue
  with pytest.raises(RuntimeError, match="rollouts_per_step"):
    SyncScheduler(lambda i, w: FakeWorker(w, []), 1, 1, 4, GenerationCost(0.5, 0.0, state), 1.0,
                  state).run(hooks)
