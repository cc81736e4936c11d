"""The trainer side of a run: batches from the buffer, gradient steps, published weights.

`Training` samples B rollouts from the replay buffer, collates them, takes one jitted step on the
train state and hands new weights to the rollout backend. The train state has one owner,
`parts.learner.state` (`build.LearnerParts`): `Training.train_on` is the only code that replaces
it (the step donates the old buffers), and every reader (evaluation, checkpoints, exports, the
mismatch probe) reads it there.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from jaxreplay.data import collate as collate_lib
from jaxreplay.infra import safety
from jaxreplay.run import accounting
from jaxreplay.run import regime as regime_lib
from jaxreplay.infra import sharding
from jaxreplay.learner import trainer
from jaxreplay.rollout.base import Weights


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What `Training.train_on` hands to the schedule (and it to `publish_if_due` and
  `finish_step`): the step number reached and its metrics (train step metrics, batch/reward_mean,
  time/virtual), the batch's rollouts (named in the report of a non-finite update), and the
  update's share of a full step's training cost (its rollouts / B: 1, or 1 / ppo_minibatches)."""
  step: int
  metrics: dict[str, float]
  rollouts: tuple = ()
  train_share: float = 1.0


class Training:
  """One run's gradient steps and weight publishing over its `build.Parts`.

  Args:
    parts: the run's parts (learner, data, generation, telemetry groups).
    mismatch_at_generation: the schedule's fact (`Schedule.mismatch_at_generation`): the sampler /
      trainer log-prob comparison checks fresh groups as they are generated (True) or the fresh
      rows of each training batch (False).
    virtual_time: the schedule's fact (`Schedule.virtual_time`): compute is the simulated clock's
      device-seconds (charged diagnostics are priced), else measured.
  With several updates per fresh batch (`data.batch_reuse`: trainer.ppo_epochs /
  ppo_minibatches, buffer.reuse_control="gradient_gate") `sample_rollouts` takes a fresh batch
  from the on-policy queue only when the held one is done, and `can_train` holds while it has
  updates left. With log.charge_diagnostics on (auto: the design reads them) the regime
  diagnostics' passes are added to the run's compute (`regime.charges_diagnostics`).
  """

  def __init__(self, parts, mismatch_at_generation: bool, virtual_time: bool = True):
    self.parts, self.config = parts, parts.config
    self.learner = parts.learner
    self.mismatch_at_generation = bool(mismatch_at_generation)
    self.virtual_time = bool(virtual_time)
    self.charge_diagnostics = regime_lib.charges_diagnostics(parts.config)
    self.step = int(jax.device_get(self.learner.state.step))
    self.weights: Optional[Weights] = None  # the newest published
    self._sample_seconds = 0.0  # the last `sample_rollouts` call's

  def policy_params(self):
    """The policy's params (LoRA: the base with the adapters attached)."""
    return self.parts.model_params(self.learner.state.params)

  # ---- generation side ---------------------------------------------------------------------------

  def generated(self, groups, seconds: float) -> None:
    """Accounts one generate call; under a schedule that interleaves generation and training on
    this thread, compares fresh groups' log-probs with the trainer's."""
    tokens = sum(len(g.prompt_tokens) + len(c.tokens) for g in groups for c in g.completions)
    n = sum(len(g.completions) for g in groups)
    self.parts.telemetry.accountant.add_generation(seconds, tokens,
                                                   seq_len=max(tokens // max(n, 1), 1))
    probe = self.parts.telemetry.metrics.mismatch
    if (self.mismatch_at_generation and groups and groups[0].policy_version == self.step
        and probe.due(self.step)):
      probe.check_groups(self.learner.state.params, groups)

  def can_train(self) -> bool:
    data = self.parts.data
    if data.batch_reuse.active and not data.batch_reuse.wants_fresh():
      return True  # the held fresh batch has updates left (ppo_epochs, the gradient gate)
    if data.reuse is not None and not data.reuse.may_train(data.buffer.total_added):
      return False  # the reuse controller waits for fresh rollouts
    return len(data.buffer) >= self.config.buffer.batch_size

  # ---- the step ----------------------------------------------------------------------------------

  def sample_rollouts(self) -> list:
    """The next batch's B rollouts, sampled from the buffer (the time it took goes to the step's
    timing). Under the multi-process async schedule only process 0 calls it and sends them on."""
    t0 = time.perf_counter()
    data = self.parts.data
    if data.batch_reuse.active:  # several updates per fresh batch (`data.batch_reuse`)
      if data.batch_reuse.wants_fresh():
        data.batch_reuse.begin(data.buffer.sample(self.config.buffer.batch_size,
                                                  current_version=self.step))
      rollouts = data.batch_reuse.next_rollouts()
    else:
      rollouts = data.buffer.sample(self.config.buffer.batch_size, current_version=self.step)
    self._sample_seconds = time.perf_counter() - t0
    return rollouts

  def train_on(self, rollouts, now: float) -> StepResult:
    """Collates `rollouts` (B of them; B / m for a minibatch of trainer.ppo_minibatches) and takes
    one gradient step at virtual or wall time `now` [s] (with the gradient gate's bound when
    buffer.reuse_control="gradient_gate"); the new train state replaces `parts.learner.state`."""
    c, data, tel, learner = self.config, self.parts.data, self.parts.telemetry, self.learner
    rollouts = list(rollouts)
    sample_s, self._sample_seconds = self._sample_seconds, 0.0
    plan = data.batch_reuse
    rows = len(rollouts) if plan.active else c.buffer.batch_size  # a ppo minibatch: B / m
    t1 = time.perf_counter()
    batch = collate_lib.collate(rollouts, buckets=data.buckets, pad_id=data.codec.pad_id,
                                batch_size=rows, pack=c.trainer.pack,
                                row_multiple=sharding.batch_size_multiple(learner.mesh) *
                                c.trainer.num_microbatches,
                                same_bucket=c.trainer.aggregation == "constant")
    t2 = time.perf_counter()
    if not self.mismatch_at_generation and tel.metrics.mismatch.due(self.step):
      fresh = batch.policy_version == self.step  # [B], or [B, T] when packed
      if fresh.any():
        tel.metrics.mismatch.check_batch(learner.state.params, batch, fresh)
    if jax.process_count() > 1:  # every process must take the step on the same batch
      sharding.assert_same_on_all_processes(
          np.array([self.step, batch.tokens.sum(), batch.tokens.shape[1],
                    int(np.round(batch.advantages.sum() * 1e4))], np.int64), "the training batch")
    diag, t_step = {}, t2
    regime, reuse = tel.regime, data.reuse
    if regime is not None and regime.due(self.step):  # measured before the donating step
      diag = regime.before_update(learner.state.params, learner.state.ref_params, batch, rollouts)
      t_step = time.perf_counter()  # not part of the step's time (nor of its compute)
    if plan.gate is not None:  # Dynamic Gradient Gating: the step intercepts above the bound
      learner.state, step_metrics = learner.train_step(learner.state, batch,
                                                       np.float32(plan.bound()))
    else:
      learner.state, step_metrics = learner.train_step(learner.state, batch)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    t3 = time.perf_counter()
    if diag:
      diag.update(regime.after_update(learner.state.params))
      diag["time/diagnostics_s"] = time.perf_counter() - t3 + t_step - t2
      step_metrics.update(diag)
      if self.charge_diagnostics:  # the design reads them: their passes are its compute
        self._charge(diag["time/diagnostics_s"])
    if reuse is not None and reuse.active:
      step_metrics.update(reuse.decide(diag, self.step) if diag else
                          {"controller/reuse_target": reuse.rho})
      reuse.stepped()
    if plan.active:
      step_metrics.update(plan.record(step_metrics, self.step))
    self.step += 1
    tel.metrics.timing.update(sample_s=sample_s, collate_s=t2 - t1, step_s=t3 - t_step)
    tel.accountant.add_training((t3 - t_step) * c.trainer.num_devices,
                                int(np.sum(batch.segment_ids > 0)),
                                seq_len=int(batch.tokens.shape[1]))
    step_metrics["batch/reward_mean"] = float(np.mean([r.reward for r in rollouts]))
    step_metrics["time/virtual"] = float(now)
    share = len(rollouts) / c.buffer.batch_size if plan.active else 1.0
    return StepResult(self.step, step_metrics, tuple(rollouts), train_share=share)

  def _charge(self, measured_seconds: float) -> None:
    """Charges the regime diagnostics just taken to the run's compute: under virtual time their
    passes priced like training (`regime.RegimeDiagnostics.pass_rollouts`,
    `accounting.diagnostics_device_seconds`), else the measured seconds on the T trainer devices."""
    c, tel = self.config, self.parts.telemetry
    if self.virtual_time:
      seconds = accounting.diagnostics_device_seconds(
          tel.regime.pass_rollouts, c.buffer.batch_size, c.scheduler.train_seconds_per_step)
      self.parts.generation.sim_state.diagnostics_device_seconds += seconds
    else:
      tel.accountant.add_diagnostics(measured_seconds * c.trainer.num_devices)

  # ---- weights -----------------------------------------------------------------------------------

  def publish(self) -> Weights:
    """Hands the current weights to the rollout backend; returns the new handle."""
    t0 = time.perf_counter()
    self.weights = self.parts.generation.rollouts.publish(self.learner.state.params, self.step)
    self.parts.telemetry.metrics.timing["publish_s"] = time.perf_counter() - t0
    return self.weights

  def skip_publish(self) -> None:
    """A step without a refresh: no publish time in its row."""
    self.parts.telemetry.metrics.timing["publish_s"] = 0.0

  def eval_weights(self) -> Weights:
    """This step's weights as the workers load them: the published ones when this step was
    published, else an eval-only copy (`RolloutBackend.publish_eval`: jax, a device copy; vllm, a
    segment or HF dir of its own publisher, so the rollout publisher's versions are never pushed
    out)."""
    if self.weights is not None and self.weights.version == self.step:
      return self.weights
    # gathers host copies with several processes
    return self.parts.generation.rollouts.publish_eval(self.learner.state.params, self.step)

  def check_finite(self, what: str) -> None:
    """Nothing non-finite is ever written: the train step skips such updates, this is the backstop."""
    if not trainer.all_finite(self.learner.state.params):
      raise safety.NonFiniteUpdates(
          f"step {self.step}: the parameters hold NaN/inf; the {what} is not written, so the last "
          "checkpoint stays the newest finite one. Lower trainer.learning_rate or check the data, "
          "then rerun the same command to resume from it")
