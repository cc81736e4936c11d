"""The synchronous schedule (`SyncScheduler`): the theory's loop (PAPER.md, Section 4), R rollouts
generated with the current policy, then one gradient step on B sampled from the buffer."""
from __future__ import annotations

from jaxreplay.run import accounting
from jaxreplay.run.schedules.base import (GenerationCost, Hooks, LocalWorker, MakeWorker, SimState,
                                          _LocalJobs, virtual_costs)


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

  kind = "sync"
  virtual_time = True
  mismatch_at_generation = True

  @classmethod
  def gamma(cls, config, sim_state: SimState) -> float:
    """(B + mu R) / ((1 + mu) B) (`accounting.sync_gamma`)."""
    del sim_state
    return accounting.sync_gamma(config.buffer.batch_size, config.scheduler.rollouts_per_step,
                                 config.scheduler.mu)

  @classmethod
  def from_parts(cls, parts) -> "SyncScheduler":
    c = parts.config
    return cls(parts.generation.rollouts.make_worker, c.rollout.num_workers, c.trainer.num_devices,
               c.scheduler.rollouts_per_step, **virtual_costs(parts))

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
