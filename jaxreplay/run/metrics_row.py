"""The run's metrics: one row per gradient step (metrics.jsonl, TensorBoard); the log-prob probe.

Keys of a row, by source (units in brackets):
  step, policy_version           updates applied; published_version: newest weights the workers have
  loss, grad_norm, param_norm, learning_rate, entropy, tokens, seq_tokens, and the loss's aux
                                 statistics (`jaxreplay.learner.losses.AUX_KINDS`): the train step
  dual_clip_fraction             with trainer.dual_clip only: the fraction of valid tokens where
                                 the dual-clip bound c * A (A < 0) binds
  tis_*, mis_*, m2po_*,          the off-policy correction of trainer.off_policy (with it only,
  decoupled_*                    its row of `learner.corrections.CORRECTIONS`): the fraction of
                                 valid tokens it truncates (tis_truncated_fraction) or masks
                                 (mis_masked_fraction, m2po_masked_fraction,
                                 decoupled_masked_fraction;
                                 mis_masked_sequence_fraction: of sequences), tis_weight_mean,
                                 decoupled_weight_mean, m2po_second_moment (mean squared
                                 log-ratio before masking [nats^2])
  batch/reward_mean              mean reward of the rollouts of this step's batch
  reward_mean, fresh_rollouts    mean reward and count of rollouts delivered since the last row
                                 (reward_mean is NaN on rows without fresh rollouts)
  buffer/*                       `ReplayBuffer.metrics`: size, replay ratio, use counts, and the
                                 staleness of this step's batch (buffer/staleness_mean, _max, _min:
                                 computed once, when the batch is sampled); with the samplers of
                                 issue 27: buffer/retired (buffer.max_uses > 0: rollouts removed
                                 after their last use), buffer/zero_variance_fraction and
                                 buffer/batch_zero_variance_fraction (buffer.replace_zero_variance:
                                 share of held / batch rollouts whose group's rewards are all equal)
  compute_seconds                THE x-axis of accuracy vs compute [device-seconds]: under
                                 scheduler.kind="simulated" the modelled hardware's virtual
                                 device-seconds (= sim/compute_seconds, + the charged
                                 diagnostics); under "async" the measured ones (=
                                 compute/measured_seconds)
  compute/diagnostics_device_seconds  the regime diagnostics charged to the run's compute so far
                                 (log.charge_diagnostics, `run.regime`: auto = when the design
                                 reads them, buffer.reuse_control adaptive): priced passes under
                                 "simulated" / "sync", measured under "async"; absent when none
  compute/mu, compute/gamma      THE run's mu and gamma: under "simulated" and "sync" the modelled
                                 ones (= sim/mu, sim/gamma), under "async" the measured ones
  compute/*                      otherwise measured on this machine by `ComputeAccountant`
                                 [device-seconds, tokens, FLOPs], incl. compute/measured_mu (per
                                 token, from measured seconds) and compute/measured_gamma
  sim/*                          the virtual clock and costs of "simulated" / "sync": sim/mu is
                                 config.scheduler.mu; sim/gamma the compute per update relative to
                                 on-policy, (1 + W/T) / (1 + mu) ("simulated", the paper's Table 1;
                                 1 for the on-policy queue, charged (1 + mu) C per update as in the
                                 paper; with buffer.reuse_control the spent compute per update over
                                 (1 + mu)) or (B + mu R) / ((1 + mu) B) ("sync"); sim/reference_tokens the
                                 completion length the generation cost is calibrated at;
                                 sim/speculative_rows, sim/speculative_discarded (only with
                                 scheduler.generation_batch > 1, once it generated ahead): rollouts
                                 generated before their request started, and those of them thrown
                                 away (newer weights at the start); neither is virtual compute
  time/*                         wall seconds of this step's phases (sample, collate, step,
                                 publish), time/virtual (the schedule's clock when the step
                                 started), time/wall_s (since the run started, over resumes)
  time/publish_s                 the trainer's stall for the weight refresh of this step [s] (0 when
                                 none was due): vllm + rollout.weight_transport="shm", the device ->
                                 host copy of the params only (the segment is written in the
                                 background, `rollout.weights.shm_publisher`); "file", the whole HF
                                 directory write; jax, the device copy
  mismatch/*                     trainer vs sampler log-probs of the same tokens at one version
  reward/*                       the reward runner's counters (calls, errors, timeouts,
                                 memory_errors, restarts), cumulative over resumes
  data/skipped_rows,             dataset rows dropped when the task was built (prompt over the
  data/skipped_eval_rows         context or untokenizable; `tasks.prompt_check`): training and
                                 held-out rows, read once from the task (0 for procedural tasks)
  pool/*                         the async schedule's worker-pool counters (counts and seconds
                                 cumulative over resumes: requests, calls (a call generates up to
                                 rollout.prompts_in_flight prompts), refresh_seconds (workers'
                                 load_weights), deferred_refreshes (calls served at the held
                                 version while the newest weights were still being written),
                                 superseded_loads (refreshes retried at a newer version: the
                                 shared-memory slot of the one asked for had been reused),
                                 generate_seconds; tokens_per_second and
                                 live_threads of this process)
  time/trainer_wait_s            async: seconds the trainer loop waited for the buffer to serve a
                                 batch (its idle time), cumulative over resumes
  rollout/partial_continued      rollout.partial="continue" only: sequences in flight continued
                                 under newer weights at a refresh (cumulative over resumes)
  rollout/versions_per_rollout_mean  rollout.partial="continue" only: distinct policy versions
                                 among the tokens of a delivered rollout (this process's pool)
  buffer/token_staleness_mean,   with per-token versions in the batch (rollout.partial="continue"):
  buffer/token_staleness_max,    the batch's staleness per completion token, and its rollouts'
  buffer/versions_per_rollout_mean  distinct versions (buffer/staleness_* is then per rollout, by
                                 its oldest token)
  buffer/stale_dropped,          buffer.max_staleness > 0 only: rollouts that left the buffer
  buffer/stale_dropped_unused    because even their newest token was too stale (of them, never
                                 used)
  batch/stale_masked_fraction    buffer.max_staleness > 0 only: share of this batch's completion
                                 tokens masked out as more than max_staleness versions old
  controller/*                   the reuse controller (`jaxreplay.data.reuse`, buffer.reuse_control):
                                 controller/reuse_target (uses per rollout it paces to) every step;
                                 at its decisions controller/signal (batch / noise scale),
                                 controller/optimal (rho* = sqrt(mu ESS signal)),
                                 controller/staleness_bound (the update KL's bound on rho,
                                 when measured), controller/guards_fired, controller/newest_unused (1 while
                                 rho = 1: updates take the newest unused rollouts),
                                 controller/reason (words)
  batch_reuse/*                  several updates per fresh batch (`jaxreplay.data.batch_reuse`:
                                 trainer.ppo_epochs / ppo_minibatches, buffer.reuse_control
                                 gradient_gate): batch_reuse/index (the update's number on its
                                 batch, from 1), batch_reuse/epoch (ppo, from 0); on the row that
                                 ends a batch batch_reuse/updates (updates applied to it) and
                                 batch_reuse/epochs (epochs taken); every row
                                 batch_reuse/replay_ratio (uses per rollout of the fresh
                                 batches so far, which buffer/replay_ratio does not count). The buffer's last-sample keys
                                 (`buffer_keys.LAST_SAMPLE_KEYS`: the batch's use counts and
                                 staleness when sampled) are on the row of the batch's first update
                                 only: the later ones sample nothing
  gate/*                         the gradient gate (gradient_gate): gate/lm_head_grad_energy
                                 (squared norm of the LM head's unclipped gradient), gate/fired (1:
                                 update intercepted, the batch ends), gate/bound (the energy that
                                 fires; inf when it may not), gate/zscore (of the energy's increment
                                 against the window, once armed)
  diag/*                         regime diagnostics (`jaxreplay.run.regime`), every
                                 log.diagnostics_every steps: diag/noise_scale (smoothed B_simple
                                 [rollouts]), diag/noise_scale_raw, diag/batch_over_noise_scale,
                                 diag/grad_sq, diag/grad_var_trace, diag/update_kl [nats/token],
                                 diag/behaviour_kl_k3 [nats/token], diag/ratio_p05 / p50 / p95,
                                 diag/ratio_outside_clip, diag/is_ess; on every row with fresh
                                 rollouts diag/zero_variance_fraction (delivered groups whose
                                 rewards are all equal: no GRPO signal)
  nonfinite_skipped              1 when the train step skipped its update (non-finite loss,
                                 gradient or parameters), else 0
  env/*                          multi-turn tasks only (`rollout.multiturn`): cumulative over
                                 resumes env/episodes, env/errors (an environment raised or
                                 returned a malformed value), env/timeouts (over
                                 task.env_step_timeout_s), env/budget_cuts (trajectories cut by
                                 the token budget), env/tool_calls; over the trajectories
                                 delivered since the last row (NaN without): env/turns_mean,
                                 env/tool_calls_mean, env/tool_correct (correct tool calls /
                                 calls), env/{stop,max_turns,length,budget,env_error,
                                 env_timeout}_fraction (how trajectories ended)
  eval/*                         held-out evaluation (`jaxreplay.run.evaluation.evaluate`), when due;
                                 multi-turn tasks add eval/env/turns_mean, eval/env/tool_calls_mean,
                                 eval/env/tool_correct, ... of the pass@1 trajectories
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import numpy as np

from jaxreplay.run import accounting
from jaxreplay.run import schedules
from jaxreplay.data import buffer_keys
from jaxreplay.data import collate as collate_lib
from jaxreplay.infra import sharding
from jaxreplay.data.experience import to_rollouts
from jaxreplay.rollout.base import Group


class MismatchProbe:
  """Trainer vs sampler log-probs of the same tokens at the same policy version.

  Even at equal weights an inference engine and the trainer compute slightly different
  probabilities; peers accept a mean exp(|diff|) <= 1.05. `latest` holds the newest comparison as
  mismatch/logprob_abs_diff, mismatch/exp_abs_diff, mismatch/logprob_abs_diff_max, mismatch/tokens.

  Args:
    logprob_fn: (params, batch) -> trainer log-probs float32 [B, T] (`trainer.make_logprob_fn`).
    pad_id: the collate padding id; buckets: the collate length buckets.
    every: compare on steps that are multiples of this.
    warn_above: a comparison whose mean exp(|diff|) exceeds this logs a WARNING: the sampler does
      not run the trainer's weights (e.g. a weight refresh that loaded nothing, or a layout bug),
      which a refresh's own log would not show.
  """

  def __init__(self, logprob_fn: Callable, pad_id: int, buckets: Sequence[int], every: int,
               warn_above: float = 1.5):
    self.logprob_fn, self.pad_id, self.buckets = logprob_fn, pad_id, tuple(buckets)
    self.every = max(int(every), 1)
    self.warn_above = float(warn_above)
    self.latest: dict[str, float] = {}
    self.warnings = 0

  def due(self, step: int) -> bool:
    return step % self.every == 0

  def check_groups(self, params, groups: Sequence[Group]) -> None:
    """Compares on freshly generated groups (unscored: rewards and advantages are not needed)."""
    zeros = np.zeros((len(groups), len(groups[0].completions)), np.float32)
    rollouts = to_rollouts(groups, zeros, zeros, [0] * len(groups))
    batch = collate_lib.collate(rollouts, buckets=self.buckets, pad_id=self.pad_id)
    self.check_batch(params, batch, np.ones(batch.tokens.shape[0], bool))

  def check_batch(self, params, batch, rows: np.ndarray) -> None:
    """Compares on the rows of `batch` selected by `rows` (bool [B]; or [B, T], the tokens, for a
    packed batch)."""
    trainer_lp = np.asarray(sharding.host_local(self.logprob_fn(params, batch)))
    mask = (batch.completion_mask > 0) & (rows if rows.ndim == 2 else rows[:, None])
    if not mask.any():
      return
    diff = np.abs(trainer_lp - batch.behaviour_logprobs)[mask]
    self.latest = {"mismatch/logprob_abs_diff": float(diff.mean()),
                   "mismatch/exp_abs_diff": float(np.exp(diff).mean()),
                   "mismatch/logprob_abs_diff_max": float(diff.max()),
                   "mismatch/tokens": float(mask.sum())}
    if self.latest["mismatch/exp_abs_diff"] > self.warn_above:
      self.warnings += 1
      logging.warning(
          "the sampler's log-probs differ from the trainer's at the same policy version: mean "
          "exp(|diff|) %.3f > %.2f over %d tokens (max |diff| %.3g). The workers are likely not "
          "running the published weights (a failed weight refresh, or a parameter layout bug)",
          self.latest["mismatch/exp_abs_diff"], self.warn_above, int(mask.sum()),
          self.latest["mismatch/logprob_abs_diff_max"])


sync_gamma = accounting.sync_gamma  # (moved; the sync schedule asks accounting)


def sim_compute_metrics(sim_state, mu: float, gamma: float) -> dict[str, float]:
  """The modelled hardware's compute under the simulated / sync schedules (device-seconds)."""
  s = sim_state
  out = {"sim/clock": s.clock, "sim/generation_device_seconds": s.generation_device_seconds,
         "sim/training_device_seconds": s.training_device_seconds,
         "sim/compute_seconds": s.generation_device_seconds + s.training_device_seconds,
         "sim/reference_tokens": s.reference_tokens, "sim/mu": mu, "sim/gamma": gamma}
  if s.speculative_rows:  # scheduler.generation_batch > 1, once rollouts were generated ahead
    out["sim/speculative_rows"] = float(s.speculative_rows)
    out["sim/speculative_discarded"] = float(s.speculative_discarded)
  return out


def zero_variance_fraction(rewards: np.ndarray, group_size: int) -> float:
  """The fraction of groups (`rewards` float [n], consecutive runs of `group_size`) whose rewards
  are all equal (no group-relative signal); NaN without a whole group."""
  n = rewards.size // max(group_size, 1)
  if n == 0:
    return float("nan")
  groups = rewards[:n * group_size].reshape(n, group_size)
  return float(np.mean(np.all(groups == groups[:, :1], axis=1)))


class RunMetrics:
  """Builds each step's row from the run's parts (see the module docstring for the keys).

  Args:
    buffer, accountant, task, intake: the run's parts whose metrics enter the row.
    sim_state: the virtual clock of a schedule with virtual time (simulated, sync).
    mismatch: the log-prob probe whose latest comparison enters each row.
    group_size: rollouts per prompt (G), for diag/zero_variance_fraction.
    mu: the schedule's mu (scheduler.mu: generation over training cost per rollout).
    gamma: sim_state -> the compute per update over the on-policy baseline's, for a schedule with
      virtual time; None for one without (async: the compute is measured, no sim/* keys).
  `RunMetrics.from_config(config, ...)` reads group_size, mu and gamma off a run config.
  `pool_metrics` (() -> the worker pool's metrics) is set by the async schedule; `timing` holds the
  wall seconds of the current step's phases.
  """

  def __init__(self, buffer, accountant, task, intake, sim_state, mismatch: MismatchProbe, *,
               group_size: int, mu: float, gamma: Optional[Callable[[Any], float]]):
    self.buffer, self.accountant = buffer, accountant
    self.group_size, self.mu, self.gamma = int(group_size), float(mu), gamma
    self.task, self.intake, self.sim_state, self.mismatch = task, intake, sim_state, mismatch
    self.pool_metrics: Callable[[], dict[str, float]] = dict
    self.timing = {"sample_s": 0.0, "collate_s": 0.0, "step_s": 0.0, "publish_s": 0.0}
    self._t_start = time.monotonic()
    self._wall_offset = 0.0  # wall seconds of the runs before a resume
    self._offsets: dict[str, float] = {}  # reward/* and pool/* counts before a resume
    self._data = {"data/skipped_rows": float(getattr(task, "skipped_rows", 0)),
                  "data/skipped_eval_rows": float(getattr(task, "skipped_eval_rows", 0))}

  @classmethod
  def from_config(cls, config, buffer, accountant, task, intake, sim_state,
                  mismatch: MismatchProbe) -> "RunMetrics":
    """The row builder of a run with `config` (rollout.group_size, scheduler.kind and mu; the
    schedule's gamma reads the keys it needs)."""
    schedule = schedules.schedule_class(config.scheduler.kind)
    gamma = functools.partial(schedule.gamma, config) if schedule.virtual_time else None
    return cls(buffer, accountant, task, intake, sim_state, mismatch,
               group_size=config.rollout.group_size, mu=config.scheduler.mu, gamma=gamma)

  # Cumulative counters that continue across a resume (rates and gauges do not).
  CUMULATIVE_POOL = ("pool/requests", "pool/calls", "pool/completions", "pool/tokens",
                     "pool/restarts", "pool/failed_starts", "pool/dropped", "pool/refreshes",
                     "pool/refresh_seconds", "pool/deferred_refreshes", "pool/superseded_loads",
                     "pool/generate_seconds", "time/trainer_wait_s", "rollout/partial_continued")

  def _cumulative(self) -> dict[str, float]:
    now = {k: float(v) for k, v in self.task.reward_metrics().items()}
    now.update(self.intake.env_counts())
    pool = self.pool_metrics()
    now.update({k: float(pool[k]) for k in self.CUMULATIVE_POOL if k in pool})
    for k, v in self._offsets.items():
      now[k] = now.get(k, 0.0) + v
    return now

  def wall_seconds(self) -> float:
    """Wall seconds of the run, over all its resumes."""
    return self._wall_offset + time.monotonic() - self._t_start

  def counters(self) -> dict[str, Any]:
    """What must continue across a resume (saved with checkpoints): wall seconds, the reward/*
    and pool/* counts, the latest log-prob comparison."""
    return {"wall_s": self.wall_seconds(), "cumulative": self._cumulative(),
            "mismatch": dict(self.mismatch.latest)}

  def restore_counters(self, counters: Mapping[str, Any]) -> None:
    """A resumed run continues the counters of `counters()` (its own start from zero)."""
    self._wall_offset = float(counters["wall_s"])
    self._t_start = time.monotonic()
    self._offsets = {k: float(v) for k, v in counters["cumulative"].items()}
    self.mismatch.latest = {k: float(v) for k, v in counters["mismatch"].items()}

  def sim(self) -> dict[str, float]:
    """sim/* metrics under a schedule with virtual time (simulated, sync); {} under async."""
    if self.gamma is None:
      return {}
    return sim_compute_metrics(self.sim_state, self.mu, self.gamma(self.sim_state))

  def compute_seconds(self) -> float:
    """The run's compute axis now: virtual device-seconds (simulated, sync: generation + training
    + the charged diagnostics) or measured ones."""
    if self.gamma is not None:
      s = self.sim_state
      return s.generation_device_seconds + s.training_device_seconds + s.diagnostics_device_seconds
    return self.accountant.metrics()["compute_seconds"]

  def first_row(self, eval_metrics: Mapping[str, float]) -> dict[str, Any]:
    """The row of step 0: the initial policy's evaluation at zero compute."""
    row = {"policy_version": 0, **eval_metrics}
    row.update(self.sim())
    row.update(self._data)
    row["compute_seconds"] = 0.0
    return row

  def row(self, step: int, published_version: int,
          step_metrics: Mapping[str, float]) -> dict[str, Any]:
    """The row of `step` (evaluation metrics are added by the caller when due)."""
    fresh = self.intake.take_fresh_rewards()
    row = {"policy_version": step, "published_version": published_version}
    row.update(step_metrics)
    row["reward_mean"] = float(fresh.mean()) if fresh.size else float("nan")
    row["fresh_rollouts"] = float(fresh.size)
    row["diag/zero_variance_fraction"] = zero_variance_fraction(fresh, self.group_size)
    row.update(self.buffer.metrics(current_version=step))
    if step_metrics.get("batch_reuse/index", 1.0) > 1:  # a held batch's later update: no sample
      for key in buffer_keys.LAST_SAMPLE_KEYS:  # (so a resume mid-batch gives the same rows)
        row.pop(key, None)
    row.update(self.accountant.metrics())
    row["compute/measured_seconds"] = row["compute_seconds"]
    sim = self.sim()
    row.update(sim)
    if sim:
      charged = self.sim_state.diagnostics_device_seconds
      row["compute_seconds"] = sim["sim/compute_seconds"] + charged
      if charged:
        row["compute/diagnostics_device_seconds"] = charged
      row["compute/mu"], row["compute/gamma"] = sim["sim/mu"], sim["sim/gamma"]
    else:
      row["compute/mu"] = row["compute/measured_mu"]
      row["compute/gamma"] = row["compute/measured_gamma"]
    row.update({f"time/{k}": v for k, v in self.timing.items()})
    row["time/wall_s"] = self.wall_seconds()
    row.update(self.mismatch.latest)
    row.update(self.pool_metrics())
    row.update(self.intake.env_metrics())
    row.update(self._cumulative())
    row.update(self._data)
    return row
