"""Who runs when: the simulated (virtual-time) and the asynchronous (real threads) schedules.

Both drive the same `Hooks` (implemented by `jaxreplay.run.pipeline.Pipeline`) and the same request
intake (`jaxreplay.data.experience.Intake`), so the replay run and the on-policy baseline differ only by
the buffer settings, never by a second code path. `pipeline.run` picks one of the two.

Virtual costs (`GenerationCost`). A request's generation takes device-seconds that follow what it
generated: a fixed part per rollout (prefill) plus a part per generated token (decode), calibrated
so that B rollouts of the reference completion length cost mu gradient steps (the paper's mu, the
generation / training cost per update). Longer completions cost more, as on real hardware, so
workers desynchronise by themselves.

Simulated schedule (`SimulatedScheduler`). W workers and T trainer devices in virtual time:
  - a worker request runs for its generation cost on one worker device; the worker samples with the
    newest published weights at the moment the request starts, and its rollouts enter the buffer
    when the request ends;
  - a gradient step takes `train_device_seconds / T` virtual seconds; its weights are published
    (every `refresh_every` steps) when the step ends.
Events at equal times are processed trainer first, then workers by index; work is then started
workers first (so they sample with the weights just published), then the trainer. The real
computation runs in that order on this machine (one local worker generates for every virtual one),
so the buffer sees exactly the staleness pattern of the real pipeline on the modelled hardware, and
the same seed gives the same run bit for bit, whatever this machine's speed.

Synchronous schedule (`SyncScheduler`): the theory's setting (PAPER.md, Section 4). Each step
generates R = `rollouts_per_step` rollouts with the current policy into the buffer (a FIFO of N),
then samples B and takes one gradient step: N/R and B/R are exact knobs, and N = B = R is on-policy.

Asynchronous schedule (`AsyncScheduler`). A `WorkerPool` of W real workers (threads driving
in-process JAX samplers or vLLM engine processes) fills the buffer while this thread trains as soon
as a batch can be served, and hands each new `Weights` handle to the pool. With several trainer
processes (jax.distributed), process 0 runs it and owns the one buffer and the workers; every step
it sends the batch's rollouts to the others (`step_channel.StepChannel`), which run
`FollowerScheduler`: they take the same steps on the same batch and generate nothing.

Jobs on the workers (`run_jobs(hooks, weights, fns)`, every schedule): the pipeline evaluates on the
rollout engines through it (config.eval.backend="engines"). The simulated and sync schedules run
the jobs on their local worker, brought to `weights` (the next request reloads the newest weights);
the asynchronous one queues them on its pool (`WorkerPool.run_jobs`: free runners take them between
two requests while the others keep generating) and waits. `job_parallelism` is how many workers may
run jobs at once; `close()` releases the workers (also when `run` never started).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from absl import logging
import numpy as np

from jaxreplay.rollout.base import Completion, Group, RolloutWorker, Weights
from jaxreplay.rollout.base import Delivery
from jaxreplay.rollout.pool import WorkerPool

MakeWorker = Callable[[int, Weights], RolloutWorker]  # (worker index, weights) -> a new worker
Job = Callable[[RolloutWorker], Any]  # runs on one worker between two requests


class Hooks(Protocol):
  """The pipeline's side of a schedule."""

  intake: Any  # `jaxreplay.data.experience.Intake`: next_request / score / deliver / dropped

  def done(self) -> bool:
    """Whether the run has finished (total_steps, or the compute budget, reached at a step end)."""

  def latest_weights(self) -> Weights:
    """The newest published weights (workers sample with these)."""

  def generated(self, groups: list[Group], seconds: float) -> None:
    """Accounts one generate call (measured seconds); may compare sampler and trainer log-probs."""

  def can_train(self) -> bool:
    """Whether the buffer holds enough rollouts for a batch."""

  def train_step(self, now: float) -> Any:
    """Samples a batch and takes one gradient step; returns a handle for `finish_step`."""

  def sample_rollouts(self) -> list:
    """The next batch's rollouts, sampled from the buffer (`train_step` = `train_on` of these)."""

  def train_on(self, rollouts: list, now: float) -> Any:
    """One gradient step on the batch of `rollouts`; returns a handle for `finish_step`."""

  def publish_if_due(self, handle: Any) -> Optional[Weights]:
    """Publishes the new weights when a refresh is due; returns them (None when not due)."""

  def finish_step(self, handle: Any, now: float) -> None:
    """Evaluates, logs the metrics row and checkpoints when due."""


@dataclasses.dataclass
class SimState:
  """The virtual clock; saved with checkpoints so a resumed run continues its timeline."""
  clock: float = 0.0
  generation_device_seconds: float = 0.0
  training_device_seconds: float = 0.0
  requests: int = 0
  reference_tokens: float = 0.0  # the calibration length of `GenerationCost` (0 = not yet set)


class GenerationCost:
  """Virtual device-seconds of generating groups: a prefill part per rollout, a decode part per token.

    seconds = g * (prefill_fraction * n + (1 - prefill_fraction) * tokens / L)
  for n rollouts holding `tokens` generated tokens in all; g = `seconds_per_rollout` is the cost of a
  rollout of the reference length L, so B rollouts of length L cost mu training steps when
  g = mu * train_seconds_per_step / B. L is `state.reference_tokens`; when it is 0 (not given) the
  first call sets it to the mean completion length of its groups (saved with the clock, so a resumed
  run keeps it).
  """

  def __init__(self, seconds_per_rollout: float, prefill_fraction: float, state: SimState):
    if seconds_per_rollout <= 0:
      raise ValueError("simulated costs must be > 0: set config.scheduler.mu and "
                       "config.scheduler.train_seconds_per_step")
    if not 0.0 <= prefill_fraction < 1.0:
      raise ValueError(f"prefill_fraction={prefill_fraction} must be in [0, 1)")
    self.seconds_per_rollout, self.prefill_fraction, self.state = (
        float(seconds_per_rollout), float(prefill_fraction), state)

  def __call__(self, groups: list[Group]) -> float:
    n = sum(len(g.completions) for g in groups)
    tokens = sum(len(c.tokens) for g in groups for c in g.completions)
    if self.state.reference_tokens <= 0:
      self.state.reference_tokens = max(tokens / max(n, 1), 1.0)
    f = self.prefill_fraction
    return self.seconds_per_rollout * (f * n + (1.0 - f) * tokens / self.state.reference_tokens)


def encode_group(group: Group) -> dict[str, Any]:
  """A `Group` as checkpoint host state (numpy arrays, ints, strings)."""
  return {"prompt_tokens": np.asarray(group.prompt_tokens),
          "tokens": [np.asarray(c.tokens) for c in group.completions],
          "logprobs": [np.asarray(c.logprobs) for c in group.completions],
          "finish_reasons": [str(c.finish_reason) for c in group.completions],
          "policy_version": int(group.policy_version), "prompt_index": int(group.prompt_index)}


def decode_group(state: dict[str, Any]) -> Group:
  """Inverse of `encode_group`."""
  completions = [Completion(np.asarray(t), np.asarray(lp), str(f)) for t, lp, f in
                 zip(state["tokens"], state["logprobs"], state["finish_reasons"])]
  return Group(np.asarray(state["prompt_tokens"]), completions, int(state["policy_version"]),
               int(state["prompt_index"]))


class LocalWorker:
  """The one in-process worker that generates for every virtual worker, at the newest weights.

  A worker that counts its calls (`call_count`, the JAX sampler's noise stream) starts at
  `state.requests`, so a resumed run draws the noise the uninterrupted run would have drawn.
  """

  def __init__(self, make_worker: MakeWorker, state: Optional["SimState"] = None):
    self.make_worker = make_worker
    self.state = state
    self._worker: Optional[RolloutWorker] = None

  def _at(self, weights: Weights) -> RolloutWorker:
    """The worker, made (on first use) or refreshed to hold `weights`."""
    if self._worker is None:
      self._worker = self.make_worker(0, weights)
      if self._worker.policy_version != weights.version:  # started without them (superseded)
        self._worker.load_weights(weights)
      if self.state is not None and hasattr(self._worker, "call_count"):
        self._worker.call_count = self.state.requests
      logging.info("started the rollout worker")
    elif self._worker.policy_version != weights.version:
      self._worker.load_weights(weights)
    return self._worker

  def generate(self, hooks: Hooks, batch) -> list[Group]:
    """Generates one request with the newest weights; the measured seconds go to the hooks."""
    worker = self._at(hooks.latest_weights())
    t0 = time.perf_counter()
    groups = worker.generate(batch.prompts, batch.n, batch.sampling)
    hooks.generated(groups, time.perf_counter() - t0)
    return groups

  def run_jobs(self, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Runs each job on the worker at `weights`, in order (the next request reloads the newest)."""
    worker = self._at(weights)
    return [fn(worker) for fn in fns]

  def close(self) -> None:
    if self._worker is not None:
      self._worker.close()
      self._worker = None


class _LocalJobs:
  """Jobs (engine evaluation) of a schedule with one in-process `LocalWorker` (`self.worker`)."""

  worker: LocalWorker
  job_parallelism = 1  # jobs run on the one local worker

  def run_jobs(self, hooks: Hooks, weights: Weights, fns: Sequence[Job]) -> list[Any]:
    """Runs the jobs on the local worker at `weights` (no virtual time passes)."""
    del hooks
    return self.worker.run_jobs(weights, fns)

  def close(self) -> None:
    self.worker.close()


class SimulatedScheduler(_LocalJobs):
  """Deterministic event schedule of W rollout workers and T trainer devices in virtual time.

  Args:
    make_worker: builds the one local worker that generates for every virtual worker (on the first
      request, with the newest weights; it then loads each newer version before a request).
    num_workers: W. num_trainer_devices: T.
    cost: the virtual device-seconds of a request's groups (`GenerationCost`).
    train_device_seconds: virtual device-seconds of one gradient step (over all T devices).
    state: the virtual clock to continue from (a resumed run's); `cost.state` must be this one.
  """

  def __init__(self, make_worker: MakeWorker, num_workers: int, num_trainer_devices: int,
               cost: GenerationCost, train_device_seconds: float, state: SimState):
    if num_workers < 1 or num_trainer_devices < 1:
      raise ValueError(f"need W >= 1 and T >= 1, got W={num_workers}, T={num_trainer_devices}")
    if train_device_seconds <= 0:
      raise ValueError("simulated costs must be > 0: set config.scheduler.train_seconds_per_step")
    self.worker = LocalWorker(make_worker, state)
    self.num_workers, self.num_trainer_devices = num_workers, num_trainer_devices
    self.cost = cost
    self.step_seconds = train_device_seconds / num_trainer_devices
    self.train_device_seconds = train_device_seconds
    self.state = state
    # Requests in flight: per virtual worker, when it ends and (request, groups) or None.
    self._done_at: list[Optional[float]] = [None] * num_workers
    self._request: list[Any] = [None] * num_workers
    self._restored: Optional[list[Any]] = None

  # -- the in-flight requests, saved with checkpoints (exact resume) --
  def state_dict(self) -> dict[str, Any]:
    """The requests in flight (their completions were generated when they started): per worker
    None or {"done_at", "indices", "groups"}. Saved in the checkpoint's host state, so a resumed
    run delivers them at their virtual times instead of generating (and counting) them again."""
    workers = []
    for done_at, request in zip(self._done_at, self._request):
      if done_at is None:
        workers.append(None)
        continue
      batch, groups = request
      workers.append({"done_at": float(done_at), "indices": [int(i) for i, _ in batch.meta],
                      "groups": [encode_group(g) for g in groups]})
    return {"workers": workers}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`; the requests are rebuilt through the intake when `run` starts."""
    workers = list(state["workers"])
    if len(workers) != self.num_workers:  # another W: its requests are generated again
      logging.warning("the checkpoint holds %d simulated workers' requests and this run has "
                      "rollout.num_workers=%d: their prompts are generated again (the resumed run "
                      "is not the uninterrupted one)", len(workers), self.num_workers)
      return
    self._restored = workers

  def run(self, hooks: Hooks) -> None:
    """Runs events until `hooks.done()`. Requests in flight at the end stay in `state_dict()`
    (their generation cost was counted when they started)."""
    try:
      self._run(hooks)
    finally:
      self.worker.close()

  def _restore(self, hooks: Hooks) -> None:
    for i, w in enumerate(self._restored or ()):
      if w is None:
        continue
      batch = hooks.intake.restore_request(w["indices"])
      groups = [decode_group(g) for g in w["groups"]]
      if len(groups) != len(batch.prompts) or not all(
          np.array_equal(g.prompt_tokens, p) for g, p in zip(groups, batch.prompts)):
        # The prompt behind an index changed (other data, tokenizer or length limits): scoring
        # the saved completions against it would be wrong. Generate these prompts again.
        hooks.intake.dropped(batch, RuntimeError(
            "the saved in-flight request's prompts differ from this run's prompts at the same "
            "indices (dataset, tokenizer or length limits changed since the checkpoint)"))
        continue
      self._request[i] = (batch, groups)
      self._done_at[i] = float(w["done_at"])
    self._restored = None

  def _deliver_due(self, hooks: Hooks) -> None:
    """Workers by index: requests ending by now go into the buffer."""
    for i in range(self.num_workers):
      if self._done_at[i] is not None and self._done_at[i] <= self.state.clock:
        self._done_at[i] = None
        (batch, groups), self._request[i] = self._request[i], None
        hooks.intake.deliver(batch, groups)

  def _run(self, hooks: Hooks) -> None:
    st = self.state
    worker_done_at, worker_request = self._done_at, self._request
    trainer_done_at: Optional[float] = None
    step_handle = None
    self._restore(hooks)
    self._deliver_due(hooks)  # a checkpoint is taken at a step's end, before that time's deliveries
    while True:
      # 1. Start work: idle workers by index, then the trainer.
      for i in range(self.num_workers):
        batch = hooks.intake.next_request() if worker_done_at[i] is None else None
        if batch is not None:
          groups = self.worker.generate(hooks, batch)
          seconds = self.cost(groups)
          worker_request[i] = (batch, groups)
          worker_done_at[i] = st.clock + seconds
          st.generation_device_seconds += seconds
          st.requests += 1
      if trainer_done_at is None and not hooks.done() and hooks.can_train():
        step_handle = hooks.train_step(st.clock)
        st.training_device_seconds += self.train_device_seconds
        trainer_done_at = st.clock + self.step_seconds
      # 2. Advance to the next event.
      pending = [t for t in worker_done_at if t is not None]
      if trainer_done_at is not None:
        pending.append(trainer_done_at)
      if not pending:
        if hooks.done():
          return
        raise RuntimeError(
            "simulated pipeline is stuck: no worker may start and the trainer cannot train; "
            "check that buffer.batch_size <= buffer.size and that a request fits the buffer")
      st.clock = min(pending)
      if trainer_done_at is not None and trainer_done_at <= st.clock:
        trainer_done_at = None
        hooks.publish_if_due(step_handle)
        hooks.finish_step(step_handle, st.clock)
        if hooks.done():
          return
      self._deliver_due(hooks)


class SyncScheduler(_LocalJobs):
  """The synchronous loop of the theory: generate R rollouts, add them, sample B, one step.

  Each step first generates `rollouts_per_step` rollouts with the current weights (whole requests,
  so R is a multiple of the request size) and delivers them to the buffer; then, once the buffer
  can serve a batch, takes one gradient step and publishes the weights. Virtual time: generation
  runs on W workers in parallel, then training on T devices (`state.clock`); compute is their
  device-seconds, so a step costs train_device_seconds + R generated rollouts (B + mu R in the
  paper's units).

  Args:
    make_worker, num_workers, num_trainer_devices, cost, train_device_seconds, state: as for
      `SimulatedScheduler`.
    rollouts_per_step: R.
  """

  def __init__(self, make_worker: MakeWorker, num_workers: int, num_trainer_devices: int,
               rollouts_per_step: int, cost: GenerationCost, train_device_seconds: float,
               state: SimState):
    if rollouts_per_step < 1:
      raise ValueError(f"rollouts_per_step={rollouts_per_step} must be >= 1")
    self.worker = LocalWorker(make_worker, state)
    self.num_workers, self.num_trainer_devices = num_workers, num_trainer_devices
    self.rollouts_per_step = int(rollouts_per_step)
    self.cost, self.train_device_seconds, self.state = cost, train_device_seconds, state

  def run(self, hooks: Hooks) -> None:
    try:
      self._run(hooks)
    finally:
      self.worker.close()

  def _run(self, hooks: Hooks) -> None:
    st = self.state
    while not hooks.done():
      generated, seconds = 0, 0.0
      while generated < self.rollouts_per_step:
        batch = hooks.intake.next_request()
        if batch is None:
          raise RuntimeError("sync schedule is stuck: the on-policy queue cannot take this step's "
                             "rollouts; set buffer.size >= scheduler.rollouts_per_step")
        groups = self.worker.generate(hooks, batch)
        cost = self.cost(groups)
        seconds += cost
        st.generation_device_seconds += cost
        st.requests += 1
        hooks.intake.deliver(batch, groups)
        generated += sum(len(g.completions) for g in groups)
      st.clock += seconds / self.num_workers
      if not hooks.can_train():
        continue  # the buffer fills up to one batch first
      handle = hooks.train_step(st.clock)
      st.training_device_seconds += self.train_device_seconds
      st.clock += self.train_device_seconds / self.num_trainer_devices
      hooks.publish_if_due(handle)
      hooks.finish_step(handle, st.clock)


class AsyncScheduler:
  """The asynchronous pipeline: a `WorkerPool` of W workers next to this thread's trainer loop.

  Pool threads take requests from the intake, generate with the newest weights they have loaded,
  and deliver scored rollouts into the buffer; this loop trains whenever the buffer can serve a
  batch and hands every newly published `Weights` to the pool (workers load it between requests,
  so no request straddles two versions). It stops when `hooks.done()`, when `stop` is set, or when
  the pool fails (its error is re-raised here).

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
  """

  def __init__(self, make_worker: MakeWorker, num_workers: int, poll_seconds: float = 0.01,
               requests_per_call: int = 1, channel=None, max_restarts: int = 5):
    self.channel = channel
    self._aborted = False  # the followers were told that process 0 stops
    self.max_restarts = int(max_restarts)
    self.requests_per_call = requests_per_call
    self.make_worker = make_worker
    self.num_workers = num_workers
    self.poll_seconds = poll_seconds
    self.stop = threading.Event()
    self.wait_seconds = 0.0
    self.pool: Optional[WorkerPool] = None

  def pool_metrics(self) -> dict[str, float]:
    """The pool's counters as metrics ("pool/restarts", ...); {} before the pool starts."""
    if self.pool is None:
      return {}
    m = self.pool.metrics()
    keys = ("requests", "calls", "completions", "tokens", "restarts", "failed_starts", "dropped",
            "refreshes", "refresh_seconds", "deferred_refreshes", "superseded_loads",
            "generate_seconds", "tokens_per_second", "live_threads")
    return {f"pool/{k}": float(m[k]) for k in keys}

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
                           max_restarts=self.max_restarts)
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


class FollowerScheduler:
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

  def close(self) -> None:
    pass
