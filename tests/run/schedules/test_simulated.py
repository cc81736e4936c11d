"""The simulated (virtual-time) schedule over fake hooks: event order, weights reaching the
workers, determinism and its resumed clock, failures."""
import numpy as np
import pytest

from jaxreplay.run.schedules import SimState
from tests.helpers.schedule_fakes import FakeHooks, FakeWorker, simulated


def test_simulated_schedule_timeline_and_weights():
  log = []
  hooks = FakeHooks(batch=2, total=3)
  sched = simulated(lambda i, w: FakeWorker(w, log), 2, 1)
  sched.run(hooks)
  # Two workers start at t=0 with version 0; their requests end at t=2; steps take 1 s each.
  assert [e[:3] for e in hooks.events if e[0] == "train"] == [("train", 0, 2.0), ("train", 1, 3.0),
                                                              ("train", 2, 4.0)]
  # Requests delivered at t=2 and t=4 started at t=0 and t=2, before the first update ended (t=3).
  assert hooks.intake.delivered_versions == [0, 0, 0, 0]
  # The requests started at t=4 (still in flight at the end, t=5) used the weights of step 2.
  assert log == [("make", 0), ("load", 2), ("close", 2)]
  st = sched.state
  assert st.clock == 5.0 and st.training_device_seconds == 3.0
  assert st.generation_device_seconds == 2.0 * st.requests


def test_workers_desynchronise_when_completion_lengths_differ():
  """Requests whose completions differ in length take different times, so deliveries spread out
  and batches mix policy versions: in-batch staleness varies on most steps (N >> one request)."""
  lengths = lambda p: 1 + int(p[1]) % 7  # 1..7 tokens, by request
  hooks = FakeHooks(batch=8, total=40)
  sched = simulated(lambda i, w: FakeWorker(w, [], lengths), 4, 1, seconds_per_rollout=0.25,
                    reference_tokens=4.0)
  sched.run(hooks)
  trains = [e for e in hooks.events if e[0] == "train"]
  mixed = [len(set(e[3])) > 1 for e in trains[5:]]
  assert np.mean(mixed) > 0.5, mixed
  # With equal lengths the four workers stay in lockstep: every delivery window holds one version.
  hooks = FakeHooks(batch=8, total=40)
  simulated(lambda i, w: FakeWorker(w, []), 4, 1, seconds_per_rollout=0.25).run(hooks)
  trains = [e for e in hooks.events if e[0] == "train"]
  assert np.mean([len(set(e[3])) > 1 for e in trains[5:]]) < np.mean(mixed)


def test_simulated_schedule_is_deterministic_and_resumes_its_clock():
  def run(state):
    hooks = FakeHooks(batch=4, consume=True, total=5)
    sched = simulated(lambda i, w: FakeWorker(w, []), 3, 2, seconds_per_rollout=0.7, state=state,
                      train=1.3)
    sched.run(hooks)
    return hooks.events, state
  (a, sa), (b, sb) = run(SimState(reference_tokens=2.0)), run(SimState(reference_tokens=2.0))
  assert a == b and sa == sb
  resumed = SimState(clock=100.0, generation_device_seconds=5.0, reference_tokens=2.0)
  events, _ = run(resumed)
  assert events[0][2] >= 100.0 and resumed.generation_device_seconds > 5.0


def test_simulated_schedule_reports_a_stuck_pipeline():
  hooks = FakeHooks(batch=8, consume=True, capacity=4, total=1)  # the queue never holds a batch
  with pytest.raises(RuntimeError, match="stuck"):
    simulated(lambda i, w: FakeWorker(w, []), 1, 1).run(hooks)


def test_simulated_schedule_rejects_bad_costs():
  with pytest.raises(ValueError, match="W >= 1"):
    simulated(None, 0, 1)
  with pytest.raises(ValueError, match="must be > 0"):
    simulated(None, 1, 1, seconds_per_rollout=0.0)
