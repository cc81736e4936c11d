"""The asynchronous schedule (`AsyncScheduler`): a `WorkerPool` of real workers beside the trainer
loop; with several trainer processes, `FollowerScheduler` on the processes other than 0."""
from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

from absl import logging
import jax

from jaxreplay.infra import step_channel
from jaxreplay.rollout.base import Delivery, Weights
from jaxreplay.rollout.pool import WorkerPool
from jaxreplay.run.schedules.base import Hooks, Job, MakeWorker, Schedule


class AsyncScheduler(Schedule):
  """The asynchronous pipeline: a `WorkerPool` of W workers next to this thread's trainer loop.

  Pool threads take requests from the intake, generate with the newest weights they have loaded,
  and deliver scored rollouts into the buffer; this loop trains whenever the buffer can serve a
  batch and hands every newly published `Weights` to the pool (workers load it between requests,
  so no request straddles two versions; with partial rollouts, `partial_chunk_tokens` > 0, between
  chunks of requests, which continue under the new weights: `rollout.partial`). It stops when
  `hooks.done()`, when `stop` is set, or when the pool fails (its error is re-raised here).

  Args:
    make_worker: (index, weights) -> a new worker (called again to replace a dead one).
    num_workers: W.
    poll_seconds: how long the trainer waits for rollouts before checking again.
    requests_per_call: requests a worker generates in one call (`WorkerPool`).
    max_restarts: deaths (and failed starts) per worker slot before the pool fails
      (`WorkerPool`); under Ray placement rollout.ray_max_restarts, so Ray's restarts are the cap.
    channel: with several trainer processes, this is process 0 (the one that owns the buffer and
      the workers): each step's rollouts and each engine evaluation's results are sent on this
      `step_channel.StepChannel` to the other processes (`FollowerScheduler`), which take the
      same steps. None: one trainer process.
    partial_chunk_tokens: rollout.partial="continue": the pool's chunk (`WorkerPool`); 0: off.
  """

  kind = "async"
  leader_owns_workers = True

  @classmethod
  def num_actors(cls, config) -> int:
    """The W workers of the pool, each its own engine."""
    return int(config.rollout.num_workers)

  @classmethod
  def from_parts(cls, parts) -> Schedule:
    """The pool's schedule; on trainer processes other than 0 of a multi-process run, a
    `FollowerScheduler` (process 0 owns the buffer and the workers)."""
    c = parts.config
    channel = None
    if jax.process_count() > 1:  # process 0 owns the buffer and the workers; the others follow
      channel = step_channel.StepChannel(jax.process_index(), jax.process_count())
      if not channel.is_leader:
        logging.info("trainer process %d follows trainer process 0, which owns the replay buffer "
                     "and the rollout workers", jax.process_index())
        return FollowerScheduler(channel, job_parallelism=c.rollout.num_workers)
    ray = c.rollout.get("placement", "local") == "ray"  # Ray's restarts cap the pool's too
    rollouts = parts.generation.rollouts
    partial = c.rollout.get("partial", "off") == "continue"
    scheduler = cls(rollouts.make_worker, c.rollout.num_workers,
                    requests_per_call=rollouts.requests_per_call, channel=channel,
                    max_restarts=c.rollout.ray_max_restarts if ray else 5,
                    partial_chunk_tokens=c.rollout.partial_chunk_tokens if partial else 0)
    parts.telemetry.metrics.pool_metrics = scheduler.pool_metrics
    return scheduler

  def __init__(self, make_worker: MakeWorker, num_workers: int, poll_seconds: float = 0.01,
               requests_per_call: int = 1, channel=None, max_restarts: int = 5,
               partial_chunk_tokens: int = 0):
    self.channel = channel
    self._aborted = False  # the followers were told that process 0 stops
    self.max_restarts = int(max_restarts)
    self.requests_per_call = requests_per_call
    self.partial_chunk_tokens = int(partial_chunk_tokens)
    self.make_worker = make_worker
    self.num_workers = num_workers
    self.poll_seconds = poll_seconds
    self.stop = threading.Event()
    self.wait_seconds = 0.0
    self.pool: Optional[WorkerPool] = None

  def pool_metrics(self) -> dict[str, float]:
    """The pool's counters as metrics ("pool/restarts", ...), the trainer's wait for rollouts
    (time/trainer_wait_s) and, with partial rollouts, rollout/partial_continued (sequences
    continued across a weight refresh) and rollout/versions_per_rollout_mean (distinct policy
    versions per delivered rollout); {} before the pool starts."""
    if self.pool is None:
      return {}
    m = self.pool.metrics()
    keys = ("requests", "calls", "completions", "tokens", "restarts", "failed_starts", "dropped",
            "refreshes", "refresh_seconds", "deferred_refreshes", "superseded_loads",
            "generate_seconds", "tokens_per_second", "live_threads")
    out = {f"pool/{k}": float(m[k]) for k in keys}
    out["time/trainer_wait_s"] = float(self.wait_seconds)
    if self.partial_chunk_tokens:
      out["rollout/partial_continued"] = float(m["continued"])
      out["rollout/versions_per_rollout_mean"] = float(m["versions_per_rollout_mean"])
    return out

  @property
  def job_parallelism(self) -> int:
    return self.num_workers  # every runner may take a job

  def _start_pool(self, hooks: Hooks) -> WorkerPool:
    """The pool, started (once) with the hooks' newest weights."""
    if self.pool is not None:
      return self.pool
    intake = hooks.intake

    def deliver(delivery: Delivery) -> None:
      hooks.generated(delivery.groups, delivery.generate_seconds)
      intake.deliver(delivery.batch, delivery.groups, rewards=delivery.prepared)

    # Scoring is the pool's `prepare` stage: the worker threads score in parallel, outside the
    # sink's lock; only the buffer insert is serialised.
    self.pool = WorkerPool(lambda i: self.make_worker(i, self.pool.target), self.num_workers,
                           lambda worker_index: intake.next_request(), deliver,
                           initial_weights=hooks.latest_weights(), on_drop=intake.dropped,
                           prepare=lambda d: intake.score(d.batch, d.groups),
                           requests_per_call=self.requests_per_call,
                           max_restarts=self.max_restarts,
                           partial_chunk_tokens=self.partial_chunk_tokens)
    self.pool.start()
    return self.pool

  def run_jobs(self, hooks: Hooks, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Queues the jobs on the pool (started now when `run` has not started it: the step-0
    evaluation) and waits for their results; the other runners keep generating meanwhile."""
    try:
      results = self._start_pool(hooks).run_jobs(weights, list(fns))
    except BaseException as e:
      self._abort_followers(e)
      raise
    if self.channel is not None:
      self.channel.send(("jobs", results))
    return results

  def close(self) -> None:
    if self.pool is not None:
      self.pool.stop()

  def run(self, hooks: Hooks) -> None:
    pool = self._start_pool(hooks)
    try:
      self._train(hooks)
      pool.raise_if_failed()
      if not hooks.done():  # `stop` was set: the followers wait for a step that will not come
        self._abort_followers(RuntimeError("the trainer loop was stopped"))
    except BaseException as e:
      self._abort_followers(e)
      raise
    finally:
      pool.stop()
      m = pool.metrics()
      logging.info("rollout pool stopped: %d requests, %d rollouts delivered, %d requests dropped "
                   "(re-queued), %d worker restarts", m["requests"], m["completions"],
                   m["dropped"], m["restarts"])
    pool.raise_if_failed()

  def _abort_followers(self, error: BaseException) -> None:
    """Tells the other trainer processes that process 0 stops here (they raise `LeaderStopped`)."""
    if self.channel is not None and not self._aborted:
      self._aborted = True
      try:
        self.channel.send(("abort", f"{type(error).__name__}: {error}"))
      except Exception:  # pylint: disable=broad-except
        logging.exception("could not tell the other trainer processes that process 0 stops")

  def _train(self, hooks: Hooks) -> None:
    start = time.monotonic()
    while not hooks.done() and not self.stop.is_set():
      self.pool.raise_if_failed()
      if not hooks.can_train():
        t0 = time.monotonic()
        self.stop.wait(self.poll_seconds)
        self.wait_seconds += time.monotonic() - t0
        continue
      now = time.monotonic() - start
      if self.channel is None:
        handle = hooks.train_step(now)
      else:  # process 0 of several: every process takes this step on these rollouts
        rollouts = hooks.sample_rollouts()
        self.channel.send(("step", now, rollouts))
        handle = hooks.train_on(rollouts, now)
      weights = hooks.publish_if_due(handle)
      if weights is not None:
        self.pool.refresh(weights)
      hooks.finish_step(handle, time.monotonic() - start)


class LeaderStopped(RuntimeError):
  """Trainer process 0 stopped the run (an error or a stop there); this process stops too."""


class FollowerScheduler(Schedule):
  """The asynchronous schedule on trainer processes other than 0: no buffer, no workers.

  Process 0 (`AsyncScheduler` with a channel) owns the replay buffer and the rollout workers, so
  generation is never duplicated; this process receives each step's rollouts on the
  `StepChannel` and takes the same step (the train step is one program over every process's
  devices), publishes at the same steps (the host copy of the weights is a collective; only
  process 0 hands them to workers) and receives the results of engine evaluations.

  Args:
    channel: the `step_channel.StepChannel` of this process (not process 0).
    job_parallelism: process 0's (its worker count): the evaluation is split into as many chunks,
      so the results received match this process's requests.
  """

  kind = "async"
  leader_owns_workers = True

  def __init__(self, channel, job_parallelism: int):
    self.channel = channel
    self.job_parallelism = int(job_parallelism)

  def pool_metrics(self) -> dict[str, float]:
    return {}

  def _receive(self, expected: str):
    message = self.channel.receive()
    kind = message[0]
    if kind == "abort":
      raise LeaderStopped(f"trainer process 0 stopped the run: {message[1]}")
    if kind != expected:
      raise RuntimeError(f"trainer process {self.channel.process_index} expected a {expected!r} "
                         f"message from process 0 and got {kind!r}: the processes' control flow "
                         "diverged (every process must run the same config and code)")
    return message[1:]

  def run_jobs(self, hooks: Hooks, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """The results of the same jobs, run by process 0's workers."""
    del hooks, weights
    (results,) = self._receive("jobs")
    if len(results) != len(fns):
      raise RuntimeError(f"process 0 ran {len(results)} jobs where this process has {len(fns)}")
    return results

  def run(self, hooks: Hooks) -> None:
    while not hooks.done():
      now, rollouts = self._receive("step")
      handle = hooks.train_on(rollouts, now)
      hooks.publish_if_due(handle)
      hooks.finish_step(handle, now)
