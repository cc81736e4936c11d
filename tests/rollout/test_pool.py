"""Tests of the rollout worker pool: version tags, refresh between requests, worker death and
replacement, bounded stop, a pool of real JAX samplers refreshed through FilePublisher, weights
still being written (served at the held version) or superseded (the newest loaded), and partial
rollouts (requests in chunks, continued across a refresh, refilled as they finish)."""
import itertools
import time

import chex
import jax
import numpy as np
import pytest

from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout.base import SamplingParams, StaleWeights, Weights, WorkerDied
from jaxreplay.rollout.pool import PromptBatch, WorkerPool
from jaxreplay.rollout.base import PoolStopped
from tests.helpers.pool_fakes import (SAMPLING, STOP, ChunkWorker, FakeWorker, LengthSource,
                                      Recorder, check_complete, make_pool)


def test_groups_reach_sink_tagged_and_refresh_between_requests():
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers).start()
  try:
    pool.wait_ready(10)
    rec.wait_for(lambda ds: len(ds) >= 6)
    pool.refresh(Weights(1, hf_dir="/weights/v1"))
    pool.wait_for_version(1, 10)
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 6)
    pool.raise_if_failed()
  finally:
    pool.stop(5)
  ds = list(rec.deliveries)
  for d in ds:
    check_complete(d)
  assert {d.policy_version for d in ds[:6]} == {0}
  assert {d.policy_version for d in ds[mark:]} == {1}  # nothing old arrives after wait_for_version
  assert {d.worker_index for d in ds} == {0, 1}
  for i in (0, 1):
    assert len(workers[i]) == 1 and workers[i][0].updates == [("/weights/v1", 1)]
  metas = [d.batch.meta for d in ds]
  assert len(set(metas)) == len(metas)  # each batch delivered once
  m = pool.metrics()
  assert m["requests"] == len(ds) and m["groups"] == 2 * len(ds) and m["completions"] == 6 * len(ds)
  assert m["tokens"] == 6 * SAMPLING.max_tokens * len(ds)
  assert m["restarts"] == 0 and m["refreshes"] == 2 and m["target_version"] == 1
  assert m["live_threads"] == 0 and not m["failed"]
  assert all(w.closed for ws in workers.values() for w in ws)


class SizedSource(Recorder):
  """A Recorder whose source hands out batches only while `available` > 0 (None otherwise), with
  n alternating 3, 3, 2 when `mixed` (two sampling runs in one take)."""

  def __init__(self, available=10**9, mixed=False):
    super().__init__()
    self.available, self.mixed = available, mixed

  def source(self, index):
    if self.available <= 0:
      return None
    self.available -= 1
    batch = super().source(index)
    if self.mixed and batch.meta % 3 == 2:
      batch.n = 2
    return batch


def test_a_worker_generates_several_requests_in_one_call_and_delivers_each():
  rec, workers = SizedSource(available=9), {}
  pool = make_pool(rec, workers, num_workers=1, requests_per_call=3,
                   worker_kwargs={"delay": 0.05}).start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 9)
    pool.raise_if_failed()
    m = pool.metrics()
  finally:
    pool.stop(5)
  assert workers[0][0].call_sizes == [(6, 3)] * 3  # 3 requests x 2 prompts per call
  assert [d.batch.meta for d in rec.deliveries] == list(range(9))  # one delivery per request
  for d in rec.deliveries:
    check_complete(d)
    for i, (g, p) in enumerate(zip(d.groups, d.batch.prompts)):
      np.testing.assert_array_equal(g.prompt_tokens, p)  # each request gets its own groups back
      assert g.prompt_index == i
  assert m["requests"] == 9 and m["calls"] == 3 and m["groups"] == 18
  # A call's seconds are split over its requests (by tokens): the sum is the worker's busy time.
  chex.assert_trees_all_close(sum(d.generate_seconds for d in rec.deliveries),
                              m["generate_seconds"], rtol=1e-9)


def test_a_call_takes_what_the_source_has_and_splits_runs_of_different_sampling():
  rec, workers = SizedSource(available=2), {}
  pool = make_pool(rec, workers, num_workers=1, requests_per_call=4).start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 2)
  finally:
    pool.stop(5)
  assert workers[0][0].call_sizes == [(4, 3)]  # 2 requests available, not 4: no waiting for more
  rec, workers = SizedSource(available=6, mixed=True), {}
  pool = make_pool(rec, workers, num_workers=1, requests_per_call=3).start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 6)
  finally:
    pool.stop(5)
  # Requests 0,1 (n=3) in one call, request 2 (n=2) in its own; likewise 3,4 and 5.
  assert workers[0][0].call_sizes == [(4, 3), (2, 2), (4, 3), (2, 2)]
  assert sorted(d.batch.meta for d in rec.deliveries) == list(range(6))
  assert all(len(g.completions) == d.batch.n for d in rec.deliveries for g in d.groups)
  with pytest.raises(ValueError, match="requests_per_call"):
    make_pool(rec, {}, requests_per_call=0)


def test_a_death_mid_call_drops_every_request_of_the_call():
  rec, workers = SizedSource(available=3), {}
  pool = make_pool(rec, workers, num_workers=1, requests_per_call=3,
                   worker_kwargs={"delay": 2.0}).start()
  try:
    pool.wait_ready(10)
    deadline = time.monotonic() + 10
    while not workers[0][0].in_generate.is_set() and time.monotonic() < deadline:
      time.sleep(0.005)
    workers[0][0].kill()
    deadline = time.monotonic() + 10
    while len(rec.drops) < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    pool.stop(5)
  assert sorted(meta for meta, _ in rec.drops) == [0, 1, 2]
  assert all(isinstance(reason, WorkerDied) for _, reason in rec.drops)
  assert not rec.deliveries  # nothing of a half-made call reaches the sink
  assert workers[0][0].call_sizes == [(6, 3)]


def test_refresh_must_not_go_back():
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, initial_weights=Weights(3, hf_dir="/w/v3"))
  with pytest.raises(ValueError, match="older"):
    pool.refresh(Weights(2, hf_dir="/w/v2"))
  with pytest.raises(ValueError, match="num_workers"):
    WorkerPool(FakeWorker, 0, rec.source, rec.sink)


def test_killed_worker_is_replaced_refreshed_and_nothing_partial_is_delivered():
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, worker_kwargs={"delay": 0.2}).start()
  try:
    pool.wait_ready(10)
    pool.refresh(Weights(3, hf_dir="/weights/v3"))
    pool.wait_for_version(3, 10)
    victim = workers[0][0]
    assert victim.in_generate.wait(5)
    victim.kill()  # dies part-way through building its groups
    deadline = time.monotonic() + 10
    while not rec.drops and time.monotonic() < deadline:
      time.sleep(0.01)
    killed_meta = rec.drops[0][0]
    # The pool keeps producing, from the new worker 0 too.
    rec.wait_for(lambda ds: sum(d.worker_index == 0 and d.batch.meta > killed_meta for d in ds) >= 2)
    pool.raise_if_failed()
  finally:
    pool.stop(5)
  assert len(workers[0]) == 2 and len(workers[1]) == 1
  replacement = workers[0][1]
  assert replacement.updates == [("/weights/v3", 3)]  # refreshed to the current weights first
  assert victim.closed
  assert isinstance(rec.drops[0][1], WorkerDied)
  delivered = [d.batch.meta for d in rec.deliveries]
  assert killed_meta not in delivered  # the killed request never reached the sink
  assert all(d.policy_version == 3 for d in rec.deliveries if d.batch.meta > killed_meta)
  for d in rec.deliveries:
    check_complete(d)
  m = pool.metrics()
  assert m["restarts"] == 1 and m["per_worker"][0]["restarts"] == 1
  assert m["per_worker"][1]["restarts"] == 0


def test_stop_is_bounded_and_kills_stuck_workers():
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, worker_kwargs={"delay": 60.0}).start()
  pool.wait_ready(10)
  assert workers[0][0].in_generate.wait(5) and workers[1][0].in_generate.wait(5)
  start = time.monotonic()
  pool.stop(timeout_s=0.5)
  elapsed = time.monotonic() - start
  assert elapsed < 3.0, elapsed
  m = pool.metrics()
  assert m["live_threads"] == 0 and m["restarts"] == 0 and m["requests"] == 0
  assert rec.deliveries == []
  assert all(w.closed for ws in workers.values() for w in ws)


def test_a_worker_that_keeps_dying_fails_the_pool():
  rec = Recorder()

  def make_worker(i):
    w = FakeWorker(i)
    w.die.set()
    return w

  pool = WorkerPool(make_worker, 1, rec.source, rec.sink, max_restarts=2, restart_backoff_s=0.0)
  pool.start()
  with pytest.raises(RuntimeError, match="died 3 times"):
    pool.wait_ready(10)
    pool._wait(lambda: False, 10, "failure")  # pylint: disable=protected-access
  pool.stop(2)
  assert pool.metrics()["restarts"] == 3 and pool.metrics()["failed"]


def test_a_sink_error_stops_the_pool_and_is_raised():
  rec = Recorder()

  def bad_sink(delivery):
    raise ValueError("reward function broke")

  pool = WorkerPool(lambda i: FakeWorker(i), 2, rec.source, bad_sink).start()
  deadline = time.monotonic() + 10
  while not pool.stopping and time.monotonic() < deadline:
    time.sleep(0.01)
  with pytest.raises(RuntimeError, match="reward function broke") as info:
    pool.raise_if_failed()
  assert isinstance(info.value.__cause__, ValueError)
  pool.stop(2)
  assert pool.metrics()["live_threads"] == 0


def test_source_returning_none_idles_and_wrong_type_fails():
  rec = Recorder()
  calls = []

  def source(i):
    calls.append(i)
    return None if len(calls) < 5 else "not a batch"

  pool = WorkerPool(lambda i: FakeWorker(i), 1, source, rec.sink, idle_sleep_s=0.001).start()
  deadline = time.monotonic() + 10
  while not pool.stopping and time.monotonic() < deadline:
    time.sleep(0.01)
  with pytest.raises(RuntimeError, match="PromptBatch"):
    pool.raise_if_failed()
  pool.stop(2)
  assert len(calls) == 5 and rec.deliveries == []


def test_pool_of_jax_samplers_refreshed_in_memory_and_through_file_publisher(tmp_path):
  """Two real JAX samplers: after a refresh their log-probs are those of the new params, whether
  the handle carries device arrays (in-process) or an HF directory (FilePublisher)."""
  from jaxreplay.models.hf_io import save_hf
  from jaxreplay.rollout.jax_sampler import JaxSampler
  from jaxreplay.rollout.weights.file_publisher import FilePublisher

  cfg = presets.tiny()
  p0 = transformer.init_params(cfg, jax.random.key(0))
  p1 = transformer.init_params(cfg, jax.random.key(1))
  save_hf(cfg, p0, str(tmp_path / "v0"))
  sampling = SamplingParams(max_tokens=6)
  batches = itertools.count()

  def source(i):
    return PromptBatch([np.array([1, 5, 6, 7], np.int32), np.array([1, 9], np.int32)], 2, sampling,
                       meta=next(batches))

  rec = Recorder()
  pool = WorkerPool(lambda i: JaxSampler.from_hf(str(tmp_path / "v0"), max_len=16, batch_size=4,
                                                 seed=i),
                    2, source, rec.sink, initial_weights=Weights(0, hf_dir=str(tmp_path / "v0")))
  marks = {}
  with FilePublisher(cfg, root=str(tmp_path / "pub")) as publisher:
    pool.start()
    try:
      pool.wait_ready(120)
      rec.wait_for(lambda ds: len(ds) >= 2, timeout=120)
      for version, weights in ((1, Weights(1, params=p1, cfg=cfg)),
                               (2, publisher.publish(p0, version=2))):
        pool.refresh(weights)
        pool.wait_for_version(version, 120)
        marks[version] = len(rec.deliveries)
        rec.wait_for(lambda ds, m=marks[version]: len(ds) >= m + 2, timeout=120)
      pool.raise_if_failed()
    finally:
      pool.stop(30)
  for version, params in ((1, p1), (2, p0)):
    for d in rec.deliveries[marks[version]:marks[version] + 2]:
      assert d.policy_version == version
      for g in d.groups:
        for c in g.completions:
          toks = np.concatenate([g.prompt_tokens, c.tokens])
          lp = np.asarray(logprobs_lib.token_logprobs(cfg, params, toks[None, :-1], toks[None, 1:]))[0]
          np.testing.assert_allclose(c.logprobs, lp[len(g.prompt_tokens) - 1:], atol=2e-4)
  assert {d.policy_version for d in rec.deliveries[:2]} == {0}


class LoggingWorker(FakeWorker):
  """A FakeWorker that logs ("gen_start" | "gen_end" | "load", version) into a shared list."""

  def __init__(self, index, log, **kwargs):
    super().__init__(index, **kwargs)
    self.log = log

  def generate(self, prompts, n, sampling):
    self.log.append((self.index, "gen_start", self.policy_version))
    try:
      return super().generate(prompts, n, sampling)
    finally:
      self.log.append((self.index, "gen_end", self.policy_version))

  def load_weights(self, weights):
    super().load_weights(weights)
    self.log.append((self.index, "load", weights.version))


def test_jobs_run_between_requests_at_their_version_then_the_target_again():
  rec, log, workers = Recorder(), [], {}

  def make_worker(i):
    w = LoggingWorker(i, log, delay=0.03)
    workers.setdefault(i, []).append(w)
    return w

  pool = WorkerPool(make_worker, 2, rec.source, rec.sink, initial_weights=Weights(1, hf_dir="/w/v1"),
                    idle_sleep_s=0.01).start()

  def job(tag):
    def fn(worker):
      assert not worker.in_generate.is_set(), "a job overlapped a request"
      log.append((worker.index, "job", worker.policy_version))
      time.sleep(0.02)
      return tag, worker.index, worker.policy_version, worker.in_generate.is_set()
    return fn

  try:
    pool.wait_for_version(1, 10)
    rec.wait_for(lambda ds: len(ds) >= 4)
    results = pool.run_jobs(Weights(5, hf_dir="/w/v5"), [job(t) for t in range(4)])
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 4)  # rollouts go on at the target version
    pool.raise_if_failed()
  finally:
    pool.stop(5)
  assert [r[0] for r in results] == [0, 1, 2, 3]  # in submission order
  assert all(r[2] == 5 and not r[3] for r in results)
  assert {r[1] for r in results} <= {0, 1}
  for d in rec.deliveries:
    check_complete(d)
    assert d.policy_version == 1  # eval weights never reach the rollouts
  m = pool.metrics()
  assert m["jobs"] == 4 and m["queued_jobs"] == 0 and m["target_version"] == 1
  # Per worker: a job sits between two requests, right after a load of its version (or a job
  # before it), and the next request comes after a load back to the target.
  for i in (0, 1):
    events = [(e, v) for w, e, v in log if w == i]
    busy = False
    for k, (event, version) in enumerate(events):
      if event == "gen_start":
        assert not busy and version == 1
        busy = True
      elif event == "gen_end":
        busy = False
      elif event == "job":
        assert not busy and version == 5
        assert events[k - 1] in (("load", 5), ("job", 5))
    starts = [k for k, (e, _) in enumerate(events) if e == "gen_start"]
    jobs = [k for k, (e, _) in enumerate(events) if e == "job"]
    if jobs:
      after = [k for k in starts if k > jobs[-1]]
      assert after and ("load", 1) in events[jobs[-1]:after[0]]


def test_job_errors_reach_the_caller_and_a_dead_workers_job_runs_on_its_replacement():
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, num_workers=1, initial_weights=Weights(0, hf_dir="/w/v0")).start()
  deaths = []

  def dies_once(worker):
    if not deaths:
      deaths.append(worker)
      raise WorkerDied("engine crashed during the eval")
    return worker

  def broken(worker):
    raise ValueError("bad eval request")

  try:
    pool.wait_ready(10)
    with pytest.raises(ValueError, match="bad eval request"):
      pool.run_jobs(Weights(2, hf_dir="/w/v2"), [broken])
    assert not pool.stopping  # a job's own error does not fail the pool
    [survivor] = pool.run_jobs(Weights(2, hf_dir="/w/v2"), [dies_once])
    rec.wait_for(lambda ds: len(ds) >= 2)
    pool.raise_if_failed()
  finally:
    pool.stop(5)
  assert survivor is workers[0][1] and deaths == [workers[0][0]]
  assert ("/w/v2", 2) in survivor.updates  # the replacement loaded the job's weights
  assert pool.metrics()["restarts"] == 1 and pool.metrics()["jobs"] == 1
  with pytest.raises(Exception, match="stopped"):
    pool.submit(Weights(3), lambda w: None)


def test_pending_jobs_fail_when_the_pool_stops_or_fails():
  rec = Recorder()
  pool = WorkerPool(lambda i: FakeWorker(i), 1, rec.source, rec.sink)  # never started
  future = pool.submit(Weights(1), lambda w: "never")
  pool.stop(1)
  with pytest.raises(Exception, match="stopped before this job ran"):
    future.result(timeout=5)

  def bad_sink(delivery):
    raise ValueError("reward function broke")

  pool = WorkerPool(lambda i: FakeWorker(i, delay=0.05), 1, rec.source, bad_sink,
                    idle_sleep_s=0.001).start()
  with pytest.raises(RuntimeError, match="reward function broke"):
    for _ in range(200):  # a job queued while the first request fails the pool
      pool.run_jobs(Weights(1), [lambda w: time.sleep(0.01)])
  pool.stop(2)


def test_pool_serves_at_the_held_version_until_the_newest_is_written():
  from concurrent.futures import Future  # pylint: disable=g-import-not-at-top
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, num_workers=1).start()
  try:
    pool.wait_ready(10)
    pending = Future()
    pool.refresh(Weights(1, shm_path="/dev/shm/none", ready=pending))
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 4)
    assert workers[0][0].updates == []  # never waited for (nor loaded) the unwritten version
    assert all(d.policy_version == 0 for d in rec.deliveries)
    assert pool.metrics()["deferred_refreshes"] >= 4
    pending.set_result("/dev/shm/none")
    pool.wait_for_version(1, 10)
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 2)
    for d in rec.deliveries:
      check_complete(d)
    assert rec.deliveries[-1].policy_version == 1
    pool.raise_if_failed()
  finally:
    pool.stop()


def test_pool_retries_a_superseded_load_at_the_newest_version():
  """A worker asked for version 1 whose slot was reused by 4 (the trainer published `keep` newer
  versions meanwhile) gets StaleWeights from its engine; it must load the newest, not fail."""
  rec, workers, pool_box = Recorder(), {}, []

  class Superseded(FakeWorker):
    def load_weights(self, weights):
      if weights.version == 1:
        pool_box[0].refresh(Weights(4, hf_dir="/weights/v4"))  # published while this one loaded
        raise StaleWeights("slot of version 1 holds version 4")
      super().load_weights(weights)

  def make_worker(i):
    workers.setdefault(i, []).append(Superseded(i))
    return workers[i][-1]
  pool = WorkerPool(make_worker, 1, rec.source, rec.sink, on_drop=rec.on_drop,
                    restart_backoff_s=0.01, idle_sleep_s=0.01)
  pool_box.append(pool)
  pool.start()
  try:
    pool.wait_ready(10)
    pool.refresh(Weights(1, hf_dir="/weights/v1"))
    pool.wait_for_version(4, 10)
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 2)
    for d in rec.deliveries:
      check_complete(d)
    assert workers[0][0].updates == [("/weights/v4", 4)]
    assert rec.deliveries[-1].policy_version == 4
    assert pool.metrics()["superseded_loads"] == 1
    pool.raise_if_failed()
  finally:
    pool.stop()


# ---- partial rollouts (partial_chunk_tokens > 0) ------------------------------------------------

def _chunk_pool(rec, workers, worker_kwargs=None, **kwargs):
  def make_worker(i):
    w = ChunkWorker(i, **(worker_kwargs or {}))
    workers.setdefault(i, []).append(w)
    return w
  return WorkerPool(make_worker, 1, rec.source, rec.sink, on_drop=rec.on_drop,
                    restart_backoff_s=0.01, idle_sleep_s=0.01, **kwargs)


def test_a_request_continues_across_a_refresh_without_regenerating_its_prefix():
  rec, workers = LengthSource([10], n=2), {}
  pool = None

  def refresh_after_second_call(worker):
    if len(worker.calls) == 2:
      pool.refresh(Weights(1, hf_dir="/w/v1"))
  pool = _chunk_pool(rec, workers, {"on_call": refresh_after_second_call}, partial_chunk_tokens=3,
                     initial_weights=Weights(0, hf_dir="/w/v0"))
  pool.start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 1)
  finally:
    pool.stop(5)
  m = pool.metrics()  # after the stop: the runner's counters follow its delivery (no race)
  (d,) = rec.deliveries
  worker = workers[0][0]
  # Chunks of 3 tokens: two at version 0, the refresh, then 3 + the last (STOP) at version 1.
  assert [(len(ctx), max_tokens, v) for ctx, max_tokens, v in worker.calls] == [
      (2, 3, 0), (2, 3, 0), (2, 3, 1), (2, 3, 1)]
  assert worker.updates == [1]
  assert d.policy_version == 0 and len(d.groups) == 1 and d.groups[0].policy_version == 0
  for j, c in enumerate(d.groups[0].completions):
    np.testing.assert_array_equal(c.tokens, [1] * 6 + [11] * 3 + [STOP])
    np.testing.assert_array_equal(c.versions, [0] * 6 + [1] * 4)
    np.testing.assert_allclose(c.logprobs, [-0.1] * 6 + [-0.2] * 4, rtol=1e-6)
    assert c.finish_reason == "stop"
    # Nothing regenerated: each chunk's context is the prompt and exactly the tokens so far.
    for k, (contexts, _, _) in enumerate(worker.calls):
      np.testing.assert_array_equal(contexts[j], np.r_[[10, 0], c.tokens[:3 * k]])
  assert m["continued"] == 2  # both sequences were mid-way at the refresh
  assert m["versions_per_rollout_mean"] == 2.0 and m["calls"] == 4 and m["tokens"] == 20
  chex.assert_trees_all_close(d.generate_seconds, m["generate_seconds"], rtol=1e-9)


def test_finished_requests_leave_at_a_chunk_boundary_and_new_ones_fill_their_rows():
  rec, workers = LengthSource([12, 2, 2, 2], n=1), {}
  pool = _chunk_pool(rec, workers, partial_chunk_tokens=4, requests_per_call=2).start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 4)
  finally:
    pool.stop(5)
  # Two requests' rows per call: the long one stays while the short ones come and go.
  assert [len(ctx) for ctx, _, _ in workers[0][0].calls] == [2, 2, 2]
  assert [d.batch.meta for d in rec.deliveries] == [1, 2, 0, 3]
  assert [len(d.groups[0].completions[0].tokens) for d in rec.deliveries] == [2, 2, 12, 2]
  assert all(d.groups[0].completions[0].finish_reason == "stop" for d in rec.deliveries)


def test_max_tokens_ends_a_continued_sequence_with_length():
  rec, workers = LengthSource([50], n=1, max_tokens=7), {}
  pool = _chunk_pool(rec, workers, partial_chunk_tokens=3).start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 1)
  finally:
    pool.stop(5)
  assert [max_tokens for _, max_tokens, _ in workers[0][0].calls] == [3, 3, 1]
  (c,) = rec.deliveries[0].groups[0].completions
  assert len(c.tokens) == 7 and c.finish_reason == "length" and STOP not in c.tokens


def test_a_dead_or_stopped_worker_drops_its_requests_in_flight():
  rec, workers = LengthSource([30, 30], n=1), {}
  pool = _chunk_pool(rec, workers, {"die_on_call": 1}, partial_chunk_tokens=2,
                     requests_per_call=2).start()
  try:
    deadline = time.monotonic() + 10
    # The drops come first, then the replacement: wait for both (stopping in between would
    # leave the worker unreplaced, by design).
    while (len(rec.drops) < 2 or len(workers.get(0, ())) < 2) and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    pool.stop(5)
  assert sorted(meta for meta, _ in rec.drops) == [0, 1] and not rec.deliveries
  assert all(isinstance(reason, WorkerDied) for _, reason in rec.drops)
  assert len(workers[0]) >= 2  # replaced
  rec, workers = LengthSource([10**6], n=1, max_tokens=10**6), {}
  pool = _chunk_pool(rec, workers, {"on_call": lambda w: time.sleep(0.01)},
                     partial_chunk_tokens=1).start()
  try:
    deadline = time.monotonic() + 10
    while len(workers.get(0, [None])[0].calls if workers else ()) < 3 and (
        time.monotonic() < deadline):
      time.sleep(0.01)
  finally:
    pool.stop(5)
  assert [meta for meta, _ in rec.drops] == [0] and isinstance(rec.drops[0][1], PoolStopped)
  with pytest.raises(ValueError, match="partial_chunk_tokens"):
    _chunk_pool(rec, {}, partial_chunk_tokens=-1)
