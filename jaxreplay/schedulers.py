"""Who runs when: the simulated (virtual-time) and the asynchronous (real threads) schedules.

Both drive the same `PipelineHooks` (implemented by `jaxreplay.pipeline.Pipeline`), so the replay
run and the on-policy baseline differ only by the buffer settings, never by a second code path.

Simulated schedule. W workers and T trainer devices in virtual time:
  - a worker request of `request_rollouts` rollouts takes `request_rollouts * gen_seconds_per_rollout`
    virtual seconds on one worker device; the worker samples with the newest published weights at the
    moment the request starts, and its rollouts enter the buffer when the request ends;
  - a gradient step takes `train_device_seconds / T` virtual seconds; its weights are published
    (every `refresh_every` steps) when the step ends.
Events at equal times are processed trainer first, then workers by index; work is then started
workers first (so they sample with the weights just published), then the trainer. The real computation runs in that order on this machine, so
the buffer sees exactly the staleness pattern of the real pipeline on the modelled hardware, and the
same seed gives the same run bit for bit, whatever this machine's speed.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Optional, Protocol


class PipelineHooks(Protocol):
  """The pipeline's side of a schedule."""

  def steps_done(self) -> int:
    """Gradient steps completed so far."""

  def may_start_request(self, in_flight_rollouts: int) -> bool:
    """Whether a worker may start a request now (a full on-policy queue makes workers wait)."""

  def start_request(self, worker_id: int) -> Any:
    """Generates one request's groups with the newest published weights; returns a handle."""

  def finish_request(self, handle: Any, now: float) -> None:
    """Scores the handle's groups and adds their rollouts to the buffer."""

  def can_train(self) -> bool:
    """Whether the buffer holds enough rollouts for a batch."""

  def train_step(self, now: float) -> None:
    """Samples a batch and takes one gradient step (weights are not yet published)."""

  def finish_step(self, now: float) -> None:
    """Publishes weights when due, evaluates, checkpoints, logs."""


@dataclasses.dataclass
class SimState:
  """The virtual clock; saved with checkpoints so a resumed run continues its timeline."""
  clock: float = 0.0
  generation_device_seconds: float = 0.0
  training_device_seconds: float = 0.0
  requests: int = 0


class SimulatedScheduler:
  """Deterministic event schedule of W rollout workers and T trainer devices in virtual time."""

  def __init__(self, num_workers: int, num_trainer_devices: int, request_rollouts: int,
               gen_seconds_per_rollout: float, train_device_seconds: float,
               state: Optional[SimState] = None):
    if num_workers < 1 or num_trainer_devices < 1:
      raise ValueError(f"need W >= 1 and T >= 1, got W={num_workers}, T={num_trainer_devices}")
    if gen_seconds_per_rollout <= 0 or train_device_seconds <= 0:
      raise ValueError("simulated costs must be > 0: set config.scheduler.mu and "
                       "config.scheduler.train_seconds_per_step")
    self.num_workers = num_workers
    self.num_trainer_devices = num_trainer_devices
    self.request_rollouts = request_rollouts
    self.request_seconds = request_rollouts * gen_seconds_per_rollout
    self.step_seconds = train_device_seconds / num_trainer_devices
    self.train_device_seconds = train_device_seconds
    self.state = state or SimState()

  def run(self, hooks: PipelineHooks, total_steps: int) -> None:
    """Runs events until `total_steps` gradient steps are done. In-flight requests at the end are
    dropped (their generation cost was already counted when they started)."""
    st = self.state
    worker_done_at: list[Optional[float]] = [None] * self.num_workers
    worker_handle: list[Any] = [None] * self.num_workers
    trainer_done_at: Optional[float] = None
    while True:
      # 1. Start work: idle workers by index, then the trainer.
      for i in range(self.num_workers):
        if worker_done_at[i] is None:
          in_flight = sum(self.request_rollouts for d in worker_done_at if d is not None)
          if hooks.may_start_request(in_flight):
            worker_handle[i] = hooks.start_request(i)
            worker_done_at[i] = st.clock + self.request_seconds
            st.generation_device_seconds += self.request_seconds
            st.requests += 1
      if trainer_done_at is None and hooks.steps_done() < total_steps and hooks.can_train():
        hooks.train_step(st.clock)
        st.training_device_seconds += self.train_device_seconds
        trainer_done_at = st.clock + self.step_seconds
      # 2. Advance to the next event.
      pending = [t for t in worker_done_at if t is not None]
      if trainer_done_at is not None:
        pending.append(trainer_done_at)
      if not pending:
        if hooks.steps_done() >= total_steps:
          return
        raise RuntimeError(
            "simulated pipeline is stuck: no worker may start and the trainer cannot train; "
            "check that buffer.batch_size <= buffer.size and that a request fits the buffer")
      st.clock = min(pending)
      if trainer_done_at is not None and trainer_done_at <= st.clock:
        trainer_done_at = None
        hooks.finish_step(st.clock)
        if hooks.steps_done() >= total_steps:
          return
      for i in range(self.num_workers):
        if worker_done_at[i] is not None and worker_done_at[i] <= st.clock:
          worker_done_at[i] = None
          handle, worker_handle[i] = worker_handle[i], None
          hooks.finish_request(handle, st.clock)


class AsyncTrainerLoop:
  """The trainer side of the asynchronous pipeline: real threads, real time.

  Rollout workers run in a `jaxreplay.rollout.WorkerPool` (their own threads / processes) and add to
  the buffer through the pipeline; this loop takes gradient steps as soon as the buffer can serve a
  batch, and publishes weights when due. It stops at `total_steps` or when `stop` is set.
  """

  def __init__(self, poll_seconds: float = 0.01):
    self.poll_seconds = poll_seconds
    self.stop = threading.Event()
    self.wait_seconds = 0.0

  def run(self, hooks: PipelineHooks, total_steps: int, clock_offset: float = 0.0,
          raise_if_failed=lambda: None) -> None:
    start = time.monotonic()
    while hooks.steps_done() < total_steps and not self.stop.is_set():
      raise_if_failed()
      if not hooks.can_train():
        t0 = time.monotonic()
        self.stop.wait(self.poll_seconds)
        self.wait_seconds += time.monotonic() - t0
        continue
      now = clock_offset + time.monotonic() - start
      hooks.train_step(now)
      hooks.finish_step(clock_offset + time.monotonic() - start)
