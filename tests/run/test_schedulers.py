"""The two schedules over fake hooks: event order, weights reaching the workers, failures."""
import threading

import numpy as np
import pytest

from jaxreplay.rollout.base import Completion, Group, SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.base import PromptBatch
from jaxreplay.run.schedules import (AsyncScheduler, GenerationCost, SimState, SimulatedScheduler,
                                  SyncScheduler)

SAMPLING = SamplingParams(max_tokens=2)


class FakeWorker:
  """Completions of 2 tokens, or of `lengths(prompt)` tokens when given (no call counter)."""

  call_count = None

  def __init__(self, weights, log, lengths=None):
    self.policy_version, self.log, self.lengths = weights.version, log, lengths
    self.log.append(("make", weights.version))

  def generate(self, prompts, n, sampling):
    groups = []
    for i, p in enumerate(prompts):
      k = 2 if self.lengths is None else self.lengths(p)
      comp = Completion(np.zeros(k, np.int32), np.zeros(k, np.float32), "length")
      groups.append(Group(np.asarray(p), [comp] * n, self.policy_version, i))
    return groups

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

  def score(self, batch, groups):
    return np.zeros((len(groups), len(groups[0].completions)), np.float32)

  def deliver(self, batch, groups, rewards=None):
    with self.lock:
      self.in_flight -= 2
      self.held += 2
      self.delivered_versions.append(groups[0].policy_version)

  def dropped(self, batch, error):
    with self.lock:
      self.in_flight -= 2


class FakeHooks:
  """Trains when >= batch rollouts are held (consuming them when `consume`); publishes each step."""

  def __init__(self, batch=2, consume=False, capacity=None, refresh_every=1, total=3):
    self.intake = FakeIntake(capacity)
    self.batch, self.consume, self.refresh_every, self.total = batch, consume, refresh_every, total
    self.step, self.weights, self.events = 0, Weights(0), []
    self.generated_seconds = []

  def done(self):
    return self.step >= self.total

  def latest_weights(self):
    return self.weights

  def generated(self, groups, seconds):
    self.generated_seconds.append(seconds)

  def can_train(self):
    return self.intake.held >= self.batch

  def train_step(self, now):
    self.events.append(("train", self.step, now, self.intake.delivered_versions[-self.batch:]))
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


def simulated(make, w, t, hooks_or_none=None, seconds_per_rollout=1.0, prefill=0.0, state=None,
              reference_tokens=2.0, train=1.0):
  state = state or SimState(reference_tokens=reference_tokens)
  cost = GenerationCost(seconds_per_rollout, prefill, state)
  return SimulatedScheduler(make, w, t, cost, train, state)


def test_generation_cost_follows_tokens_and_calibrates_on_the_first_request():
  state = SimState()
  cost = GenerationCost(2.0, 0.25, state)
  def groups(*lengths):
    return [Group(np.ones(3, np.int32), [Completion(np.zeros(k, np.int32), np.zeros(k, np.float32),
                                                    "stop") for k in lengths], 0)]
  assert cost(groups(4, 6)) == pytest.approx(4.0)  # the first request sets L = 5: 2 x g
  assert state.reference_tokens == 5.0
  # g * (f * n + (1 - f) * tokens / L) = 2 * (0.25 * 2 + 0.75 * 20 / 5)
  assert cost(groups(10, 10)) == pytest.approx(7.0)
  assert cost(groups(5)) == pytest.approx(2.0)  # a reference-length rollout costs g
  with pytest.raises(ValueError, match="prefill_fraction"):
    GenerationCost(1.0, 1.0, state)


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


def test_async_schedule_trains_and_refreshes_the_pool():
  log = []
  hooks = FakeHooks(batch=2, consume=True, capacity=8, refresh_every=2, total=6)
  sched = AsyncScheduler(lambda i, w: FakeWorker(w, log), num_workers=2)
  sched.run(hooks)
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
    sched.run(hooks)


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
  sched.run(hooks)
  assert hooks.step == 3 and sched.pool_metrics()["pool/restarts"] == 1


def test_async_schedule_caps_worker_deaths_at_max_restarts():
  """The pool's cap per worker slot is the scheduler's `max_restarts` (Ray placement passes
  rollout.ray_max_restarts): a worker that always dies fails the run after that many restarts."""
  class AlwaysDies(FakeWorker):
    def generate(self, prompts, n, sampling):
      raise WorkerDied("killed")
  made = []

  def make(i, w):
    made.append(i)
    return AlwaysDies(w, [])
  sched = AsyncScheduler(make, num_workers=1, max_restarts=2)
  with pytest.raises(RuntimeError, match=r"died 3 times \(max_restarts=2\)"):
    sched.run(FakeHooks(batch=2))
  assert len(made) == 3


def test_local_worker_runs_jobs_at_the_given_weights_then_rollouts_at_the_newest():
  log = []
  hooks = FakeHooks(batch=2, total=2)
  state = SimState(reference_tokens=2.0)
  sched = simulated(lambda i, w: FakeWorker(w, log), 1, 1, state=state)
  assert sched.job_parallelism == 1
  # Before run (the step-0 evaluation): the worker is made at the job's weights.
  out = sched.run_jobs(hooks, Weights(7), [lambda w: ("a", w.policy_version),
                                          lambda w: ("b", w.policy_version)])
  assert out == [("a", 7), ("b", 7)] and log == [("make", 7)]
  sched.run(hooks)
  assert log[1] == ("load", 0)  # the first request reloads the newest published weights
  assert set(hooks.intake.delivered_versions) <= {0, 1, 2} and hooks.step == 2
  sched.close()  # idempotent after run


def test_async_jobs_before_run_start_the_pool_that_run_then_uses():
  log = []
  hooks = FakeHooks(batch=2, consume=True, capacity=8, total=3)
  sched = AsyncScheduler(lambda i, w: FakeWorker(w, log), num_workers=2)
  assert sched.job_parallelism == 2
  assert sched.run_jobs(hooks, Weights(0), [lambda w: w.policy_version] * 3) == [0, 0, 0]
  pool = sched.pool
  assert pool is not None and pool.metrics()["jobs"] == 3
  sched.run(hooks)
  assert sched.pool is pool and hooks.step == 3 and pool.stopping
  sched.close()


def test_schedules_answer_what_they_are():
  """Callers ask the schedule's class (by config.scheduler.kind), never the kind string."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import schedules  # pylint: disable=g-import-not-at-top
  from jaxreplay.run.schedules import FollowerScheduler  # pylint: disable=g-import-not-at-top
  assert set(schedules.SCHEDULES) == {"simulated", "sync", "async"}
  from jaxreplay.config import validation  # pylint: disable=g-import-not-at-top
  assert set(schedules.SCHEDULES) == set(validation.SCHEDULES)
  sim, sync, asyn = (schedules.schedule_class(k) for k in ("simulated", "sync", "async"))
  assert (sim, sync, asyn) == (SimulatedScheduler, SyncScheduler, AsyncScheduler)
  assert sim.virtual_time and sync.virtual_time and not asyn.virtual_time
  assert sim.mismatch_at_generation and sync.mismatch_at_generation
  assert not asyn.mismatch_at_generation
  assert asyn.leader_owns_workers and FollowerScheduler.leader_owns_workers
  assert not sim.leader_owns_workers and not sync.leader_owns_workers
  c = ml_collections.ConfigDict({
      "rollout": {"num_workers": 5}, "trainer": {"num_devices": 3},
      "buffer": {"on_policy": False, "batch_size": 60, "reuse_control": "off"},
      "scheduler": {"mu": 5.28, "rollouts_per_step": 60}})
  assert asyn.num_actors(c) == 5 and sim.num_actors(c) == 1 and sync.num_actors(c) == 1
  assert asyn.gamma(c, SimState()) is None
  assert sim.gamma(c, SimState()) == pytest.approx(0.4246, abs=1e-4)  # (1 + 5/3) / (1 + 5.28)
  assert sync.gamma(c, SimState()) == pytest.approx(1.0)  # N = B = R
  c.buffer.on_policy = True
  assert sim.gamma(c, SimState()) == 1.0
  with pytest.raises(ValueError, match="expected one of"):
    schedules.schedule_class("nope")


def test_old_schedule_import_paths_keep_working():
  import jaxreplay.schedulers as old  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import schedules  # pylint: disable=g-import-not-at-top
  for name in ("AsyncScheduler", "FollowerScheduler", "GenerationCost", "Hooks", "LeaderStopped",
               "LocalWorker", "SimState", "SimulatedScheduler", "SyncScheduler", "decode_group",
               "encode_group", "MakeWorker", "Job"):
    assert getattr(old, name) is getattr(schedules, name)
