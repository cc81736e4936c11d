"""A pool of W rollout workers, each driven by its own host thread.

Each thread loops: apply the newest weights if its worker is behind, take up to `requests_per_call`
`PromptBatch`es that the prompt source has, `generate` them in one call (an engine then batches all
their sequences: 4 prompts x 16 samples leave three quarters of a 256-sequence vLLM engine idle;
multi-turn requests of one episode runner: all their trajectories, `base.generate_request`),
run the optional `prepare` stage on each request's `Delivery` (in this thread, concurrently with
the other threads: e.g. scoring the completions) and hand each `Delivery` (the groups, tagged with
the policy version that produced them, and what `prepare` returned) to the sink, one at a time.
Weight refreshes are applied by the worker's own thread between two calls, so no request straddles
a refresh; while the newest weights are still being written by their publisher (`Weights.ready`,
the shared-memory transport) a worker that holds weights serves its next call at the version it
holds (each group is tagged with it) instead of waiting.

Jobs (`submit`, `run_jobs`): a job is a function of a worker (e.g. an evaluation request,
`evaluation.engine_jobs`) with the `Weights` it must run at. The next runner that is between two
calls takes it, loads those weights when its worker holds another version, runs it on its own
thread (so never concurrently with a generate on that worker) and returns to the newest weights
before its next call. The caller waits on a `concurrent.futures.Future`; a job's own exception
is set on its future (the pool goes on), a worker death during a job re-queues it for the
replacement worker, and a pool that stops or fails fails its pending jobs.

Partial rollouts (`partial_chunk_tokens` C > 0, config `rollout.partial="continue"`): a thread
holds its requests in flight (`rollout.partial.InFlight`, up to `requests_per_call` requests'
rows) and advances them by at most C tokens per `generate` call, each sequence's context its
prompt plus what it generated so far. Between two such calls it runs jobs, loads the newest
weights (so a refresh reaches a request within C tokens; each token keeps the version that
sampled it) and refills the rows of the requests that finished, which are delivered as they
finish, tagged with their oldest token's version. A dead worker's requests in flight are dropped
whole (`on_drop`), as are those in flight when the pool stops.

Worker failure: when a worker dies (`WorkerDied` from generate or load_weights) its in-flight
requests are dropped (the sink never sees any of it; `on_drop` does), the worker is replaced by
`make_worker(i)`, the new worker is refreshed to the newest weights, and the thread goes on. Any
other exception (from a worker, the source, `prepare` or the sink) is a bug: the pool stops and
`raise_if_failed()` re-raises it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from jaxreplay.rollout import partial as partial_lib
from jaxreplay.rollout.base import (Delivery, Group, PoolStopped, PromptBatch, RolloutWorker,  # noqa: F401  (re-exported)
                                    SamplingParams, StaleWeights, Weights, WorkerDied,
                                    generate_request)


@dataclasses.dataclass
class _Job:
  """A queued `submit`: run `fn(worker)` at `weights`; the result goes to `future`."""
  weights: Weights
  fn: Callable[[RolloutWorker], Any]
  future: concurrent.futures.Future
  attempts: int = 0


PromptSource = Callable[[int], Optional[PromptBatch]]  # worker index -> a batch, or None (none now)
Sink = Callable[[Delivery], None]
Prepare = Callable[[Delivery], Any]
DropHandler = Callable[[PromptBatch, BaseException], None]


class _WorkerRunner:
  """Slot `index` of the pool: one thread, the worker it drives, and its counters."""

  def __init__(self, pool: "WorkerPool", index: int):
    self.pool = pool
    self.index = index
    self.worker: Optional[RolloutWorker] = None
    self.requests = 0
    self.calls = 0
    self.groups = 0
    self.completions = 0
    self.tokens = 0
    self.restarts = 0
    self.failed_starts = 0
    self.dropped = 0
    self.refreshes = 0
    self.refresh_seconds = 0.0  # in load_weights of refreshes (not of a worker's start)
    self.deferred_refreshes = 0  # calls served at the held version while the newest was written
    self.superseded_loads = 0  # loads refused because newer versions had reused the target's slot
    self.generate_seconds = 0.0
    self.jobs = 0  # jobs run to the end (`WorkerPool.submit`)
    # Partial rollouts (pool.partial_chunk_tokens > 0): the requests in flight, the sequences
    # continued across a refresh, and the distinct versions summed over delivered completions.
    self.in_flight = (partial_lib.InFlight(pool.partial_chunk_tokens, pool.requests_per_call)
                      if pool.partial_chunk_tokens else None)
    self.continued = 0
    self.versions_sum = 0
    self._chunk_version: Optional[int] = None  # the version the last chunk ran at
    self.thread = threading.Thread(target=self._run, name=f"rollout-worker-{index}", daemon=True)

  @property
  def version(self) -> Optional[int]:
    worker = self.worker
    return None if worker is None else worker.policy_version

  def _run(self) -> None:
    pool = self.pool
    try:
      while not pool.stopping:
        if self.worker is None and not self._start_worker():
          continue
        job = pool._next_job()  # pylint: disable=protected-access
        if job is not None:
          self._run_job(job)
          continue
        if not self._refresh_if_behind():
          continue
        if self.in_flight is not None:
          self._serve_chunk()
          continue
        batches = self._take()
        if not batches:
          pool._stop.wait(pool.idle_sleep_s)  # pylint: disable=protected-access
          continue
        self._serve(batches)
    except BaseException as e:  # pylint: disable=broad-except
      pool._fail(self.index, e)  # pylint: disable=protected-access
    finally:
      if self.in_flight is not None:
        self._drop_in_flight(PoolStopped("the pool stopped before this request finished"))
      worker, self.worker = self.worker, None
      if worker is not None:
        _close_quietly(worker)

  def _start_worker(self) -> bool:
    """Makes a worker (first start or replacement) at the newest weights; False to retry later."""
    pool = self.pool
    worker = None
    try:
      worker = pool.make_worker(self.index)
      target = pool.target
      if target is not None and worker.policy_version != target.version:
        self._load_newest(worker, target)
    except (WorkerDied, TimeoutError):  # A start-up crash or timeout: retry, a bounded number of times.
      if worker is not None:
        _close_quietly(worker)
      self.failed_starts += 1
      if self.failed_starts > pool.max_restarts:
        raise
      pool._stop.wait(pool.restart_backoff_s)  # pylint: disable=protected-access
      return False
    if pool.stopping:
      _close_quietly(worker)
      return False
    self.worker = worker
    return True

  def _refresh_if_behind(self) -> bool:
    target = self.pool.target
    if target is None or self.worker.policy_version == target.version:
      return True
    if not target.is_ready():  # still being written: serve this call at the version held
      self.deferred_refreshes += 1
      return True
    start = time.perf_counter()
    try:
      self._load_newest(self.worker, target)
    except WorkerDied as e:
      self._replace(e)
      return False
    self.refresh_seconds += time.perf_counter() - start
    self.refreshes += 1
    if self.in_flight is not None and self.worker.policy_version != self._chunk_version:
      self.continued += self.in_flight.started_rows()  # they continue under the new weights
    return True

  def _load_newest(self, worker: RolloutWorker, target: Weights) -> None:
    """`worker.load_weights(target)`; when the engine refuses it as superseded (`StaleWeights`:
    the trainer published `keep` newer versions meanwhile and reused its shared-memory slot; the
    engine's weights are untouched), loads the pool's newest target instead."""
    while True:
      try:
        worker.load_weights(target)
        return
      except StaleWeights:
        newest = self.pool.target
        if newest is None or newest.version == target.version:
          raise
        self.superseded_loads += 1
        target = newest

  def _take(self) -> list[PromptBatch]:
    """Up to `pool.requests_per_call` requests that the source has now (none when it has none)."""
    batches = []
    while len(batches) < self.pool.requests_per_call:
      batch = self.pool._next_batch(self.index)  # pylint: disable=protected-access
      if batch is None:
        break
      batches.append(batch)
    return batches

  def _serve(self, batches: list[PromptBatch]) -> None:
    """Generates the requests in one `generate` call per run of equal (n, sampling), so that the
    engine batches all their sequences, then delivers each request on its own."""
    pending = list(batches)
    while pending:
      same = [b for b in pending if _call_key(b) == _call_key(pending[0])]
      pending = [b for b in pending if all(b is not s for s in same)]
      reason = self._serve_together(same)
      if reason is not None:
        for b in pending:
          self._drop(b, reason)
        return

  def _serve_together(self, batches: list[PromptBatch]) -> Optional[BaseException]:
    """One `generate` call for `batches` (same n and sampling). Returns None when they were
    delivered, else why they were dropped (the worker died, or the pool stops)."""
    pool = self.pool
    version = self.worker.policy_version
    prompts = [p for b in batches for p in b.prompts]
    n, sampling = batches[0].n, batches[0].sampling
    episodes = batches[0].episodes  # multi-turn requests: one call for all their episodes
    if episodes is not None:  # (`_call_key`: a call's requests all have episodes, or none)
      for b in batches[1:]:
        episodes = episodes + b.episodes
    start = time.perf_counter()
    try:
      groups = generate_request(self.worker, prompts, n, sampling, episodes)
    except WorkerDied as e:
      for b in batches:
        self._drop(b, e)
      self._replace(e)
      return e
    seconds = time.perf_counter() - start
    _check_groups(groups, len(prompts), n, version)
    if pool.stopping:
      stopped = PoolStopped("the pool stopped before this request was delivered")
      for b in batches:
        self._drop(b, stopped)
      return stopped
    total_tokens = max(sum(c.policy_tokens for g in groups for c in g.completions), 1)
    offset = 0
    for b in batches:
      mine = [dataclasses.replace(g, prompt_index=i)
              for i, g in enumerate(groups[offset:offset + len(b.prompts)])]
      offset += len(b.prompts)
      tokens = sum(c.policy_tokens for g in mine for c in g.completions)
      share = seconds * tokens / total_tokens if len(batches) > 1 else seconds
      delivery = Delivery(groups=mine, batch=b, worker_index=self.index, policy_version=version,
                          generate_seconds=share, num_tokens=tokens)
      if pool.prepare is not None:
        delivery.prepared = pool.prepare(delivery)  # no lock: the threads prepare in parallel
      pool._deliver(delivery)  # pylint: disable=protected-access
      self.requests += 1
      self.groups += len(mine)
      self.completions += sum(len(g.completions) for g in mine)
      self.tokens += tokens
    self.calls += 1
    self.generate_seconds += seconds
    return None

  def _serve_chunk(self) -> None:
    """Partial rollouts: refills the requests in flight, advances them by one chunk (one
    `generate` call per sampling setting) and delivers those that finished."""
    pool, held = self.pool, self.in_flight
    while held.has_room():
      batch = pool._next_batch(self.index)  # pylint: disable=protected-access
      if batch is None:
        break
      held.add(batch)
    if not held.rows:
      pool._stop.wait(pool.idle_sleep_s)  # pylint: disable=protected-access
      return
    version = self._chunk_version = self.worker.policy_version
    for chunk in held.chunks():
      start = time.perf_counter()
      try:
        groups = self.worker.generate(chunk.contexts, 1, chunk.sampling)
      except WorkerDied as e:
        self._replace(e)  # drops the requests in flight
        return
      seconds = time.perf_counter() - start
      held.absorb(chunk, groups, version, seconds)
      self.calls += 1
      self.generate_seconds += seconds
    if pool.stopping:
      self._drop_in_flight(PoolStopped("the pool stopped before this request was delivered"))
      return
    for done in held.pop_finished():
      delivery = Delivery(groups=done.groups, batch=done.batch, worker_index=self.index,
                          policy_version=done.policy_version, generate_seconds=done.seconds,
                          num_tokens=done.num_tokens)
      if pool.prepare is not None:
        delivery.prepared = pool.prepare(delivery)
      pool._deliver(delivery)  # pylint: disable=protected-access
      self.requests += 1
      self.groups += len(done.groups)
      self.completions += sum(len(g.completions) for g in done.groups)
      self.tokens += done.num_tokens
      self.versions_sum += partial_lib.distinct_versions(done.groups)

  def _drop_in_flight(self, reason: BaseException) -> None:
    for batch in self.in_flight.drain():
      self._drop(batch, reason)

  def _run_job(self, job: _Job) -> None:
    """Runs `job` on this runner's worker at `job.weights` (between two requests)."""
    if job.future.cancelled():
      return
    job.attempts += 1
    try:
      if self.worker.policy_version != job.weights.version:
        self.worker.load_weights(job.weights)
      result = job.fn(self.worker)
    except WorkerDied as e:
      self.pool._requeue(job)  # pylint: disable=protected-access
      self._replace(e)
      return
    except Exception as e:  # pylint: disable=broad-except
      _settle(job.future, error=e)  # the job's own error: its caller re-raises it
      return
    self.jobs += 1
    _settle(job.future, result=result)

  def _drop(self, batch: PromptBatch, reason: BaseException) -> None:
    self.dropped += 1
    if self.pool.on_drop is not None:
      self.pool.on_drop(batch, reason)

  def _replace(self, reason: BaseException) -> None:
    if self.in_flight is not None:  # a dead worker's partial requests start again elsewhere
      self._drop_in_flight(reason)
    worker, self.worker = self.worker, None
    if not self.pool.stopping:
      logging.getLogger(__name__).warning("rollout worker %d: %s; starting a replacement",
                                          self.index, reason)
    if worker is not None:
      _close_quietly(worker)
    if self.pool.stopping:
      return
    self.restarts += 1
    if self.restarts > self.pool.max_restarts:
      raise WorkerDied(f"rollout worker {self.index} died {self.restarts} times "
                       f"(max_restarts={self.pool.max_restarts})")


def _call_key(batch: PromptBatch) -> tuple:
  """Requests with equal keys are generated in one call: same n and settings, and (multi-turn)
  the same episode runner."""
  runner = None if batch.episodes is None else id(batch.episodes.runner)
  return batch.n, batch.sampling, runner


def _check_groups(groups: list[Group], num_prompts: int, n: int, version: int) -> None:
  if len(groups) != num_prompts:
    raise RuntimeError(f"worker returned {len(groups)} groups for {num_prompts} prompts")
  for g in groups:
    if g.policy_version != version:
      raise RuntimeError(f"a group is tagged version {g.policy_version}, but the worker held "
                         f"version {version} for the whole request")
    if len(g.completions) != n:
      raise RuntimeError(f"a group has {len(g.completions)} completions, expected n={n}")


def _settle(future: concurrent.futures.Future, result: Any = None,
            error: Optional[BaseException] = None) -> None:
  """Sets `future`'s result or error unless it is already done (cancelled, or failed by a stop)."""
  try:
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass


def _close_quietly(worker: RolloutWorker, timeout_s: float = 10.0) -> None:
  """Closes `worker` in a helper thread, waiting at most `timeout_s` (a stuck close is abandoned)."""
  def close():
    try:
      worker.close()
    except Exception:  # pylint: disable=broad-except
      pass  # A dead worker may fail to close; it is gone either way.
  t = threading.Thread(target=close, name="rollout-worker-close", daemon=True)
  t.start()
  t.join(timeout_s)


class WorkerPool:
  """W rollout workers driven concurrently; see the module docstring.

  Args:
    make_worker: index -> a new `RolloutWorker` (called again to replace a dead one).
    num_workers: W.
    source: worker index -> `PromptBatch`, or None when there is no work right now (the thread
      then waits `idle_sleep_s`). Called under a lock (one call at a time); it should not block
      long, or `stop` waits for it.
    sink: receives each `Delivery`; called under a lock (one call at a time).
    prepare: optional; Delivery -> anything, called in the worker's thread before the sink and
      outside its lock (several at once: it must be thread-safe), its result in
      `Delivery.prepared`. The slow, parallel part of a delivery (scoring rewards) goes here.
    initial_weights: the `Weights` new workers are brought to before their first request.
    max_restarts: per worker slot, for deaths and for failed starts; beyond it the pool fails.
    on_drop: called with each dropped request (its worker died, or the pool stopped) so that the
      caller may re-queue its prompts.
    requests_per_call: a worker takes up to this many requests that the source has at once and
      generates them in one call (so that an engine batches all their sequences); each is still
      delivered on its own, tagged with the one version that generated the whole call.
    partial_chunk_tokens: C > 0: partial rollouts (module docstring): requests advance C tokens
      per call and continue across refreshes, up to `requests_per_call` requests' rows held in
      flight per worker; 0 (default): each call generates whole requests.
  """

  def __init__(self, make_worker: Callable[[int], RolloutWorker], num_workers: int,
               source: PromptSource, sink: Sink, *,
               initial_weights: Optional[Weights] = None, max_restarts: int = 5,
               restart_backoff_s: float = 1.0, idle_sleep_s: float = 0.05,
               on_drop: Optional[DropHandler] = None, prepare: Optional[Prepare] = None,
               requests_per_call: int = 1, partial_chunk_tokens: int = 0):
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1")
    if requests_per_call < 1:
      raise ValueError(f"requests_per_call={requests_per_call} must be >= 1 (set "
                       "rollout.prompts_in_flight to 0 or a multiple of prompts_per_request)")
    self.requests_per_call = int(requests_per_call)
    if partial_chunk_tokens < 0:
      raise ValueError(f"partial_chunk_tokens={partial_chunk_tokens} must be >= 0 (0: whole "
                       "requests per call)")
    self.partial_chunk_tokens = int(partial_chunk_tokens)
    self.make_worker = make_worker
    self.num_workers = int(num_workers)
    self.source = source
    self.sink = sink
    self.max_restarts = int(max_restarts)
    self.restart_backoff_s = float(restart_backoff_s)
    self.idle_sleep_s = float(idle_sleep_s)
    self.on_drop = on_drop
    self.prepare = prepare
    self._target: Optional[Weights] = initial_weights
    self._stop = threading.Event()
    self._state_lock = threading.Lock()
    self._source_lock = threading.Lock()
    self._sink_lock = threading.Lock()
    self._error: Optional[BaseException] = None
    self._error_worker: Optional[int] = None
    self._jobs: collections.deque[_Job] = collections.deque()  # guarded by _state_lock
    self._started_at: Optional[float] = None
    self._runners = [_WorkerRunner(self, i) for i in range(self.num_workers)]

  # ---- control ------------------------------------------------------------------------------

  def start(self) -> "WorkerPool":
    """Starts the W threads (each makes its worker, so the engines start concurrently)."""
    if self._started_at is not None:
      raise RuntimeError("this WorkerPool was already started")
    self._started_at = time.perf_counter()
    for r in self._runners:
      r.thread.start()
    return self

  def refresh(self, weights: Weights) -> None:
    """Makes `weights` the newest; each worker loads them before its next request."""
    with self._state_lock:
      if self._target is not None and weights.version < self._target.version:
        raise ValueError(f"refresh to version {weights.version} is older than the current target "
                         f"{self._target.version}; versions must not decrease")
      self._target = weights

  def submit(self, weights: Weights, fn: Callable[[RolloutWorker], Any]
             ) -> concurrent.futures.Future:
    """Queues the job `fn(worker)`, to run at `weights` by the next runner between two requests
    (see the module docstring); returns the future of its result. Jobs start in submission order.
    Raises PoolStopped (or the pool's error) when the pool has stopped."""
    self.raise_if_failed()
    job = _Job(weights, fn, concurrent.futures.Future())
    with self._state_lock:
      if self.stopping:
        raise PoolStopped("submit: the pool has stopped; start a new WorkerPool")
      self._jobs.append(job)
    return job.future

  def run_jobs(self, weights: Weights, fns: list[Callable[[RolloutWorker], Any]],
               poll_s: float = 0.05) -> list[Any]:
    """Submits every job of `fns` at `weights` (free runners take them in parallel) and waits for
    all of them; returns their results in order. Re-raises a job's error, or the pool's when it
    fails (PoolStopped when it is stopped meanwhile)."""
    futures = [self.submit(weights, fn) for fn in fns]
    while True:
      _, pending = concurrent.futures.wait(futures, timeout=poll_s)
      if not pending:
        break
      if any(f.done() and f.exception() is not None for f in futures):
        break  # a job failed: report it now
      self.raise_if_failed()
      if self.stopping:
        raise PoolStopped(f"the pool stopped with {len(pending)} of {len(futures)} jobs unfinished")
    for f in futures:
      if f.done() and f.exception() is not None:
        for other in futures:
          other.cancel()  # not started yet: skip them
        raise f.exception()
    return [f.result() for f in futures]

  @property
  def target(self) -> Optional[Weights]:
    """The newest `Weights` given to `refresh` (or `initial_weights`)."""
    return self._target

  @property
  def stopping(self) -> bool:
    return self._stop.is_set()

  def wait_ready(self, timeout_s: float = 300.0) -> None:
    """Blocks until every slot holds a worker; raises the pool's error, or TimeoutError."""
    self._wait(lambda: all(r.worker is not None for r in self._runners), timeout_s, "workers to start")

  def wait_for_version(self, version: int, timeout_s: float = 300.0) -> None:
    """Blocks until every worker holds weights of at least `version`, or raises TimeoutError."""
    def done():
      return all(r.version is not None and r.version >= version for r in self._runners)
    self._wait(done, timeout_s, f"all workers to load version {version}")

  def raise_if_failed(self) -> None:
    """Re-raises the exception that stopped the pool, if any."""
    if self._error is not None:
      raise RuntimeError(f"the rollout pool failed in worker {self._error_worker}: "
                         f"{self._error!r}") from self._error

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops every thread and closes every worker. Returns within about timeout_s + 5 s.

    Threads finish their current request (its result is dropped, not delivered). Workers still
    busy at the deadline are killed when they support `kill()` (`VllmWorkerProcess`); an
    in-process engine cannot be interrupted, and its daemon thread is abandoned (see metrics).
    """
    self._stop.set()
    self._fail_jobs(PoolStopped("the pool stopped before this job ran"))
    deadline = time.monotonic() + timeout_s
    for r in self._runners:
      if r.thread.is_alive():
        r.thread.join(max(0.0, deadline - time.monotonic()))
    for r in self._runners:
      worker = r.worker
      if r.thread.is_alive() and worker is not None and hasattr(worker, "kill"):
        worker.kill()
    grace = time.monotonic() + 5.0
    for r in self._runners:
      if r.thread.is_alive():
        r.thread.join(max(0.0, grace - time.monotonic()))
    self._fail_jobs(PoolStopped("the pool stopped before this job ran"))

  def __enter__(self) -> "WorkerPool":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def metrics(self) -> dict[str, Any]:
    """Totals and per-worker counters; tokens_per_second is over the pool's wall time."""
    wall = 0.0 if self._started_at is None else time.perf_counter() - self._started_at
    keys = ("requests", "calls", "groups", "completions", "tokens", "restarts", "failed_starts", "dropped",
            "refreshes", "refresh_seconds", "deferred_refreshes", "superseded_loads",
            "generate_seconds")
    per_worker = [dict({k: getattr(r, k) for k in keys}, index=r.index, version=r.version,
                       alive=r.thread.is_alive()) for r in self._runners]
    totals = {k: sum(w[k] for w in per_worker) for k in keys}
    totals["jobs"] = sum(r.jobs for r in self._runners)
    with self._state_lock:
      totals["queued_jobs"] = len(self._jobs)
    if self.partial_chunk_tokens:  # partial rollouts: sequences continued across refreshes
      totals["continued"] = sum(r.continued for r in self._runners)
      totals["versions_per_rollout_mean"] = (sum(r.versions_sum for r in self._runners)
                                             / max(totals["completions"], 1))
      totals["in_flight_requests"] = sum(r.in_flight.requests for r in self._runners)
    target = self._target
    return dict(totals, num_workers=self.num_workers, wall_seconds=wall,
                tokens_per_second=totals["tokens"] / wall if wall > 0 else 0.0,
                target_version=None if target is None else target.version,
                live_threads=sum(w["alive"] for w in per_worker),
                failed=self._error is not None, per_worker=per_worker)

  # ---- called by the runners ----------------------------------------------------------------

  def _next_batch(self, index: int) -> Optional[PromptBatch]:
    with self._source_lock:
      if self.stopping:
        return None
      batch = self.source(index)
    if batch is not None and not isinstance(batch, PromptBatch):
      raise TypeError(f"the prompt source returned {type(batch).__name__}; "
                      "expected a PromptBatch or None")
    return batch

  def _next_job(self) -> Optional[_Job]:
    with self._state_lock:
      if self.stopping or not self._jobs:
        return None
      return self._jobs.popleft()

  def _requeue(self, job: _Job) -> None:
    """Puts back a job whose worker died, first in line; fails it beyond max_restarts attempts."""
    if job.attempts > self.max_restarts:
      _settle(job.future, error=WorkerDied(f"a job's worker died {job.attempts} times "
                                           f"(max_restarts={self.max_restarts})"))
      return
    with self._state_lock:
      if not self.stopping:
        self._jobs.appendleft(job)
        return
    _settle(job.future, error=PoolStopped("the pool stopped before this job ran"))

  def _fail_jobs(self, error: BaseException) -> None:
    with self._state_lock:
      jobs, self._jobs = list(self._jobs), collections.deque()
    for job in jobs:
      _settle(job.future, error=error)

  def _deliver(self, delivery: Delivery) -> None:
    with self._sink_lock:
      self.sink(delivery)

  def _fail(self, index: int, error: BaseException) -> None:
    with self._state_lock:
      if self._error is None:
        self._error = error
        self._error_worker = index
    self._stop.set()
    self._fail_jobs(RuntimeError(f"the rollout pool failed in worker {index}: {error!r}"))

  def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
      self.raise_if_failed()
      if self.stopping:
        raise RuntimeError(f"the pool stopped while waiting for {what}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
      time.sleep(0.01)
    self.raise_if_failed()
