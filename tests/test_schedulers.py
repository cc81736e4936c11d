"""The two schedules over fake hooks: event order, weights reaching the workers, failures."""
import threading

import numpy as np
import pytest

from jaxreplay.rollout.base import Completion, Group, SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.pool import PromptBatch
from jaxreplay.schedulers import AsyncScheduler, SimState, SimulatedScheduler

SAMPLING = SamplingParams(max_tokens=2)


class FakeWorker:
  def __init__(self, weights, log):
    self.policy_version, self.log = weights.version, log
    self.log.append(("make", weights.version))

  def generate(self, prompts, n, sampling):
    return [Group(np.asarray(p), [Completion(np.zeros(2, np.int32), np.zeros(2, np.float32),
                                             "length")] * n, self.policy_version, i)
            for i, p in enumerate(prompts)]

  def load_weights(self, weights):
    self.log.append(("load", weights.version))
    self.policy_version = weights.version

  def close(self):
    self.log.append(("close", self.policy_version))


class FakeIntake:
  """Requests of one prompt x 2 rollouts; `capacity` bounds held + in-flight rollouts (on-policy)."""

  def __init__(self, capacity=None):
    self.capacity, self.held, self.in_flight, self.count = capacity, 0, 0, 0
    self.delivered_versions, self.lock = [], threading.Lock()

  def next_request(self):
    with self.lock:
      if self.capacity is not None and self.held + self.in_flight + 2 > self.capacity:
        return None
      self.in_flight += 2
      self.count += 1
      return PromptBatch([np.array([1, self.count], np.int32)], 2, SAMPLING, meta=self.count)

  def deliver(self, batch, groups):
    with self.lock:
      self.in_flight -= 2
      self.held += 2
      self.delivered_versions.append(groups[0].policy_version)

  def dropped(self, batch, error):
    with self.lock:
      self.in_flight -= 2


class FakeHooks:
  """Trains when >= batch rollouts are held (consuming them when `consume`); publishes each step."""

  def __init__(self, batch=2, consume=False, capacity=None, refresh_every=1):
    self.intake = FakeIntake(capacity)
    self.batch, self.consume, self.refresh_every = batch, consume, refresh_every
    self.step, self.weights, self.events = 0, Weights(0), []
    self.generated_seconds = []

  def steps_done(self):
    return self.step

  def latest_weights(self):
    return self.weights

  def generated(self, groups, seconds):
    self.generated_seconds.append(seconds)

  def can_train(self):
    return self.intake.held >= self.batch

  def train_step(self, now):
    self.events.append(("train", self.step, now))
    if self.consume:
      with self.intake.lock:
        self.intake.held -= self.batch
    self.step += 1
    return self.step

  def publish_if_due(self, step):
    if step % self.refresh_every:
      return None
    self.weights = Weights(step)
    return self.weights

  def finish_step(self, step, now):
    self.events.append(("finish", step, now))


def test_simulated_schedule_timeline_and_weights():
  log = []
  hooks = FakeHooks(batch=2)
  sched = SimulatedScheduler(lambda i, w: FakeWorker(w, log), num_workers=2, num_trainer_devices=1,
                             request_rollouts=2, gen_seconds_per_rollout=1.0,
                             train_device_seconds=1.0)
  sched.run(hooks, total_steps=3)
  # Two workers start at t=0 with version 0; their requests end at t=2; steps take 1 s each.
  assert [e for e in hooks.events if e[0] == "train"] == [("train", 0, 2.0), ("train", 1, 3.0),
                                                          ("train", 2, 4.0)]
  # Requests delivered at t=2 and t=4 started at t=0 and t=2, before the first update ended (t=3).
  assert hooks.intake.delivered_versions == [0, 0, 0, 0]
  # The requests started at t=4 (still in flight at the end, t=5) used the weights of step 2.
  assert log == [("make", 0), ("load", 2), ("close", 2)]
  st = sched.state
  assert st.clock == 5.0 and st.training_device_seconds == 3.0
  assert st.generation_device_seconds == 2.0 * st.requests
  assert len(hooks.generated_seconds) == st.requests


def test_simulated_schedule_is_deterministic_and_resumes_its_clock():
  def run(state):
    hooks = FakeHooks(batch=4, consume=True)
    SimulatedScheduler(lambda i, w: FakeWorker(w, []), 3, 2, 2, 0.7, 1.3, state=state).run(hooks, 5)
    return hooks.events, state
  (a, sa), (b, sb) = run(SimState()), run(SimState())
  assert a == b and sa == sb
  resumed = SimState(clock=100.0, generation_device_seconds=5.0)
  events, _ = run(resumed)
  assert events[0][2] >= 100.0 and resumed.generation_device_seconds > 5.0


def test_simulated_schedule_reports_a_stuck_pipeline():
  hooks = FakeHooks(batch=8, consume=True, capacity=4)  # the queue can never hold a batch
  sched = SimulatedScheduler(lambda i, w: FakeWorker(w, []), 1, 1, 2, 1.0, 1.0)
  with pytest.raises(RuntimeError, match="stuck"):
    sched.run(hooks, total_steps=1)


def test_simulated_schedule_rejects_bad_costs():
  with pytest.raises(ValueError, match="W >= 1"):
    SimulatedScheduler(None, 0, 1, 2, 1.0, 1.0)
  with pytest.raises(ValueError, match="must be > 0"):
    SimulatedScheduler(None, 1, 1, 2, 0.0, 1.0)


def test_async_schedule_trains_and_refreshes_the_pool():
  log = []
  hooks = FakeHooks(batch=2, consume=True, capacity=8, refresh_every=2)
  sched = AsyncScheduler(lambda i, w: FakeWorker(w, log), num_workers=2)
  sched.run(hooks, total_steps=6)
  assert hooks.step == 6
  m = sched.pool_metrics()
  assert m["pool/requests"] >= 6 and m["pool/restarts"] == 0
  assert sched.pool.target.version == 6
  assert any(e[0] == "load" and e[1] >= 2 for e in log)  # workers loaded newer weights
  assert set(hooks.intake.delivered_versions) <= {0, 2, 4, 6}


def test_async_schedule_raises_when_the_pool_fails():
  class Broken(FakeWorker):
    def generate(self, prompts, n, sampling):
      raise ValueError("a bug in the worker")
  hooks = FakeHooks(batch=2)
  sched = AsyncScheduler(lambda i, w: Broken(w, []), num_workers=1)
  with pytest.raises(RuntimeError, match="rollout pool failed"):
    sched.run(hooks, total_steps=3)


def test_async_schedule_replaces_a_dead_worker():
  deaths = []

  class DiesOnce(FakeWorker):
    def generate(self, prompts, n, sampling):
      if not deaths:
        deaths.append(1)
        raise WorkerDied("killed")
      return super().generate(prompts, n, sampling)
  hooks = FakeHooks(batch=2, consume=True, capacity=8)
  sched = AsyncScheduler(lambda i, w: DiesOnce(w, []), num_workers=1)
  sched.run(hooks, total_steps=3)
  assert hooks.step == 3 and sched.pool_metrics()["pool/restarts"] == 1
