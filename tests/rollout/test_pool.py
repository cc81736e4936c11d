"""Tests of the rollout worker pool: version tags, refresh between requests, worker death and
replacement, bounded stop, and a pool of real JAX samplers refreshed through FilePublisher."""
import fcntl
import itertools
import os
import subprocess
import sys
import threading
import time

import chex
import jax
import numpy as np
import pytest

from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout.base import Completion, Group, SamplingParams, Weights, WorkerDied
from jaxreplay.rollout.pool import Delivery, PromptBatch, WorkerPool

SAMPLING = SamplingParams(max_tokens=4)


class FakeWorker:
  """Completions of `max_tokens` copies of the policy version; `generate` takes `delay` seconds
  and dies (WorkerDied) part-way when `die` is set. It fails loudly if a refresh overlaps a request."""

  def __init__(self, index, delay=0.02, version=0):
    self.index = index
    self.delay = delay
    self.policy_version = version
    self.die = threading.Event()
    self.in_generate = threading.Event()
    self.updates = []
    self.requests = 0
    self.call_sizes = []  # (prompts, n) of each generate call
    self.closed = False

  def generate(self, prompts, n, sampling):
    if self.closed:
      raise WorkerDied("closed")
    self.call_sizes.append((len(prompts), n))
    self.in_generate.set()
    try:
      version = self.policy_version
      groups = []
      for i, p in enumerate(prompts):  # Built prompt by prompt: a death leaves a half-made list.
        if self.die.wait(self.delay / len(prompts)):
          raise WorkerDied(f"fake worker {self.index} killed mid-request")
        comps = [Completion(np.full(sampling.max_tokens, version, np.int32),
                            np.full(sampling.max_tokens, -1.0, np.float32), "length") for _ in range(n)]
        groups.append(Group(np.asarray(p), comps, version, i))
      self.requests += 1
      return groups
    finally:
      self.in_generate.clear()

  def load_weights(self, weights):
    if self.in_generate.is_set():
      raise AssertionError("load_weights ran during a request")
    if self.die.is_set():
      raise WorkerDied("dead")
    self.updates.append((weights.hf_dir, weights.version))
    self.policy_version = weights.version

  def kill(self):
    self.die.set()

  def close(self):
    self.closed = True


class Recorder:
  """Prompt source (numbered batches of 2 prompts, n=3) and sink, with a condition to wait on."""

  def __init__(self):
    self.counter = itertools.count()
    self.deliveries = []
    self.drops = []
    self.cond = threading.Condition()

  def source(self, index):
    k = next(self.counter)
    return PromptBatch(prompts=[np.array([1, k % 50 + 3]), np.array([1, 2, 3])], n=3,
                       sampling=SAMPLING, meta=k)

  def sink(self, delivery):
    with self.cond:
      self.deliveries.append(delivery)
      self.cond.notify_all()

  def on_drop(self, batch, reason):
    self.drops.append((batch.meta, reason))

  def wait_for(self, predicate, timeout=20.0):
    with self.cond:
      assert self.cond.wait_for(lambda: predicate(self.deliveries), timeout), "timed out"
      return len(self.deliveries)


def check_complete(d: Delivery):
  assert len(d.groups) == len(d.batch.prompts) == 2
  for g in d.groups:
    assert g.policy_version == d.policy_version
    assert len(g.completions) == d.batch.n
    for c in g.completions:
      assert len(c.tokens) == SAMPLING.max_tokens
      np.testing.assert_array_equal(c.tokens, d.policy_version)  # made with that version's weights


def make_pool(rec, workers, num_workers=2, worker_kwargs=None, **kwargs):
  def make_worker(i):
    w = FakeWorker(i, **(worker_kwargs or {}))
    workers.setdefault(i, []).append(w)
    return w
  return WorkerPool(make_worker, num_workers, rec.source, rec.sink, on_drop=rec.on_drop,
                    restart_backoff_s=0.01, idle_sleep_s=0.01, **kwargs)


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


# ---- weight publisher and imports ---------------------------------------------------------------


def test_file_publisher_writes_versions_atomically_and_keeps_the_newest(tmp_path):
  from jaxreplay.models.hf_io import load_hf
  from jaxreplay.rollout.weights.file_publisher import FilePublisher

  cfg = presets.tiny()
  params = [transformer.init_params(cfg, jax.random.key(s)) for s in range(3)]
  root = tmp_path / "pub"
  with FilePublisher(cfg, root=str(root), keep=2) as pub:
    handles = [pub.publish(p, version=v) for v, p in zip((0, 4, 7), params)]
    assert [w.version for w in handles] == [0, 4, 7] and all(w.cfg == cfg for w in handles)
    dirs = [w.hf_dir for w in handles]
    assert dirs == [str(root / f"v{v}") for v in (0, 4, 7)]
    assert sorted(os.listdir(root)) == ["v4", "v7"]  # only the newest 2; no temporary dirs left
    loaded_cfg, loaded = load_hf(dirs[-1])
    assert loaded_cfg == cfg
    chex.assert_trees_all_close(loaded, params[2], atol=0, rtol=0)
    rec = pub.latest
    assert rec.version == 7 and rec.location == dirs[-1]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params[2]))
    assert rec.nbytes == 4 * n_params  # float32, one safetensors file
    assert rec.stall_s > rec.write_s > 0 and len(pub.history) == 3  # stall_s: transfer + write
    with pytest.raises(ValueError, match="newer"):
      pub.publish(params[0], version=7)
  assert os.path.isdir(root) and os.listdir(root) == []  # a given root stays; its versions go


def test_file_publisher_default_root_and_fallback(monkeypatch):
  from jaxreplay.rollout.weights import file_publisher
  from jaxreplay.rollout.weights import publisher

  cfg = presets.tiny()
  pub, other = file_publisher.FilePublisher(cfg), file_publisher.FilePublisher(cfg)
  try:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
      assert pub.root.startswith(f"/dev/shm/jaxreplay-{os.getpid()}-")
    assert os.path.isdir(pub.root) and other.root != pub.root
  finally:
    pub.close()
  assert not os.path.exists(pub.root) and os.path.isdir(other.root)  # closing one spares the other
  other.close()
  monkeypatch.setattr(publisher.os.path, "isdir",
                      lambda p: False if p == "/dev/shm" else os.path.lexists(p))
  root = publisher.default_root()
  try:
    assert not root.startswith("/dev/shm") and os.path.isdir(root)
  finally:
    os.rmdir(root)
  with pytest.raises(ValueError, match="keep"):
    file_publisher.FilePublisher(cfg, keep=0)


def test_importing_rollout_does_not_import_vllm_torch_or_jax():
  code = ("import sys, jaxreplay.rollout.vllm.engine;"
          "from jaxreplay.rollout import base, pool;"
          "assert base.SamplingParams and base.WorkerDied and pool.WorkerPool;"
          "bad = [m for m in ('vllm', 'torch', 'jax') if m in sys.modules];"
          "assert not bad, bad")
  env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
  subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_stale_weight_roots_of_dead_processes_are_removed(tmp_path):
  """A run killed with -9 leaves /dev/shm/jaxreplay-<pid>-*; the next publisher removes those of
  dead pids and keeps live ones (another run on the machine) and unrelated names."""
  from jaxreplay.rollout.weights import publisher  # pylint: disable=g-import-not-at-top
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = tmp_path / f"jaxreplay-{dead.pid}-abc"
  (stale / "v3").mkdir(parents=True)
  (stale / "v3" / "model.safetensors").write_bytes(b"x" * 10)
  live = tmp_path / f"jaxreplay-{os.getppid()}-def"
  live.mkdir()
  mine = tmp_path / f"jaxreplay-{os.getpid()}-ghi"
  mine.mkdir()
  other = tmp_path / "jaxreplay-notapid-x"
  other.mkdir()
  # A live publisher whose pid is dead in this namespace (another container): its flock counts.
  elsewhere = tmp_path / f"jaxreplay-{dead.pid}-live"
  elsewhere.mkdir()
  fd = os.open(str(elsewhere / publisher.OWNER_FILE), os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_SH)  # as a publisher holds it
  removed = publisher.remove_stale_roots(str(tmp_path))
  assert removed == [str(stale)] and elsewhere.exists()
  assert not stale.exists() and live.exists() and mine.exists() and other.exists()
  os.close(fd)  # its publisher closed or died: stale now
  assert publisher.remove_stale_roots(str(tmp_path)) == [str(elsewhere)]


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
