"""The asynchronous schedule over fake hooks: training against a real worker pool, refreshes,
failures, dead workers and their cap, jobs on the pool."""
import pytest

from jaxreplay.rollout.base import Weights, WorkerDied
from jaxreplay.run.schedules import AsyncScheduler
from tests.helpers.schedule_fakes import FakeHooks, FakeWorker


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
