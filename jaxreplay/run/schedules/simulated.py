"""The simulated schedule (`SimulatedScheduler`): W workers and T trainer devices in virtual time,
deterministic bit for bit (the package docstring has its event rules)."""
from __future__ import annotations

import math
from typing import Any, Optional

from absl import logging
import numpy as np

from jaxreplay.run import accounting
from jaxreplay.run.schedules.base import (GenerationCost, Hooks, LocalWorker, MakeWorker, SimState,
                                          _LocalJobs, decode_group, encode_group, virtual_costs)


class SimulatedScheduler(_LocalJobs):
  """Deterministic event schedule of W rollout workers and T trainer devices in virtual time.

  Args:
    make_worker: builds the one local worker that generates for every virtual worker (on the first
      request, with the newest weights; it then loads each newer version before a request).
    num_workers: W. num_trainer_devices: T.
    cost: the virtual device-seconds of a request's groups (`GenerationCost`).
    train_device_seconds: virtual device-seconds of one gradient step (over all T devices).
    state: the virtual clock to continue from (a resumed run's); `cost.state` must be this one.
    generation_batch: K, requests the local worker generates in one call (`LocalWorker`: the
      next K - 1 expected requests ahead, at the same weights; 1 = one request per call).
  """

  kind = "simulated"
  virtual_time = True
  mismatch_at_generation = True

  @classmethod
  def gamma(cls, config, sim_state: SimState) -> float:
    """1 on-policy (each update pays its B rollouts' generation); under paced generation
    (buffer.reuse_control fixed / adaptive) or several updates per fresh batch (ppo_epochs, the
    gradient gate) the compute spent per update over the on-policy (1 + mu); else the replay
    pipeline's gamma(W, T, mu)."""
    c, mu, s = config, config.scheduler.mu, sim_state
    minibatches = int(c.trainer.get("ppo_minibatches", 1))
    reused = (c.buffer.get("reuse_control", "off") == "gradient_gate"
              or int(c.trainer.get("ppo_epochs", 1)) * minibatches > 1)
    if c.buffer.on_policy and not reused:
      return 1.0
    if c.buffer.get("reuse_control", "off") != "off" or reused:
      # updates = training seconds / (train_seconds_per_step / m): each costs B / m of a step
      return ((s.generation_device_seconds + s.training_device_seconds)
              / ((1.0 + mu) * s.training_device_seconds * minibatches)
              ) if s.training_device_seconds else 1.0
    return accounting.gamma(c.rollout.num_workers, c.trainer.num_devices, mu)

  @classmethod
  def from_parts(cls, parts) -> "SimulatedScheduler":
    c = parts.config
    return cls(parts.generation.rollouts.make_worker, c.rollout.num_workers, c.trainer.num_devices,
               generation_batch=resolve_generation_batch(c), **virtual_costs(parts))

  def __init__(self, make_worker: MakeWorker, num_workers: int, num_trainer_devices: int,
               cost: GenerationCost, train_device_seconds: float, state: SimState,
               generation_batch: int = 1):
    if num_workers < 1 or num_trainer_devices < 1:
      raise ValueError(f"need W >= 1 and T >= 1, got W={num_workers}, T={num_trainer_devices}")
    if train_device_seconds <= 0:
      raise ValueError("simulated costs must be > 0: set config.scheduler.train_seconds_per_step")
    self.worker = LocalWorker(make_worker, state, generation_batch)
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
    run delivers them at their virtual times instead of generating (and counting) them again.
    With generation_batch > 1 also "ahead": the requests generated before they started
    (`LocalWorker.state_dict`)."""
    workers = []
    for done_at, request in zip(self._done_at, self._request):
      if done_at is None:
        workers.append(None)
        continue
      batch, groups = request
      workers.append({"done_at": float(done_at), "indices": [int(i) for i, _ in batch.meta],
                      "groups": [encode_group(g) for g in groups]})
    if self.worker.generation_batch > 1:
      return {"workers": workers, **self.worker.state_dict()}
    return {"workers": workers}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`; the requests are rebuilt through the intake when `run` starts."""
    if self.worker.generation_batch > 1 and "ahead" in state:
      self.worker.load_state_dict(state)
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
        share = hooks.train_share(step_handle)  # 1, or a ppo minibatch's B / m of B
        st.training_device_seconds += self.train_device_seconds * share
        trainer_done_at = st.clock + self.step_seconds * share
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


def resolve_generation_batch(config) -> int:
  """K of `scheduler.generation_batch`, with 0 (auto) resolved to the fewest requests whose rows
  fill whole sampler batches: lcm(P G, rollout.sampler_batch_size) / (P G) (4 for requests of
  8 rollouts and batches of 32). Beyond full batches the sampler's cost per row falls little
  while more of the requests generated ahead are thrown away at a weights refresh
  (bench/bench_sim_run.py, on-policy at B = 512: K = 64 = B / (P G) spent 3.3 CPU s on 1.35x
  the rows (28% of those ahead thrown away), K = 4 3.0 s (3%))."""
  k = int(config.scheduler.get("generation_batch", 1))
  if k:
    return k
  request = config.rollout.prompts_per_request * config.rollout.group_size
  return math.lcm(request, config.rollout.sampler_batch_size) // request
