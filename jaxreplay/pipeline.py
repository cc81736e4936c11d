"""The replay pipeline: `run(config, workdir)`.

Data flow (PAPER.md): rollout workers sample groups with the newest published weights -> rewards and
group-relative advantages -> `ReplayBuffer` (FIFO, capacity N) -> the trainer samples B rollouts per
step (uniformly, without removing them) -> `collate` -> jitted sharded `train_step` -> every
`refresh_every` steps the weights are converted to HF format and published to the workers.
The on-policy baseline is the same code with `buffer.on_policy=True` (a queue: each rollout used once,
workers wait when it is full).

Schedules (`jaxreplay.schedulers`): "simulated" runs W workers and T trainer devices in virtual time
(deterministic, bit for bit); "async" runs real worker threads / vLLM processes next to the trainer.

Outputs in `workdir`: metrics.jsonl, tb/ (TensorBoard), checkpoints/ (orbax: train state + buffer +
prompt cursor + counters, saved together), hf/ (latest HF export), run_config.json.
Re-running the same command resumes from the newest complete checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from jaxreplay import collate as collate_lib
from jaxreplay import evaluation
from jaxreplay import metrics as metrics_lib
from jaxreplay import models
from jaxreplay import schedulers
from jaxreplay import setup as setup_lib
from jaxreplay import sharding
from jaxreplay.experience import groups_to_rollouts
from jaxreplay.rollout.base import SamplingParams


@dataclasses.dataclass
class Request:
  """One worker request in flight: the prompts handed out and the groups they produced."""
  indices: list[int]
  problems: list[Any]
  groups: list[Any]
  seconds: float


class Pipeline:
  """Owns the run's parts and implements `schedulers.PipelineHooks`."""

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    self.parts = setup_lib.build(config, workdir)
    p = self.parts
    self.step = int(jax.device_get(p.state.step))
    self.sampling = SamplingParams(
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        top_k=config.rollout.top_k, max_tokens=config.rollout.max_tokens,
        stop_token_ids=tuple(p.codec.stop_ids), seed=config.seed)
    self.request_rollouts = config.rollout.prompts_per_request * config.rollout.group_size
    self.published_version = -1
    self.next_group_id = 0
    self.fresh_rewards: list[np.ndarray] = []
    self.last_eval: dict[str, float] = {}
    self.timing = {"sample_s": 0.0, "collate_s": 0.0, "step_s": 0.0, "publish_s": 0.0}
    self.mismatch: dict[str, float] = {}
    self._step_metrics: dict[str, float] = {}
    self._lock = threading.Lock()
    self._in_flight = 0
    self._t_start = time.monotonic()
    self.progress = metrics_lib.ProgressLogger(config.total_steps, every_s=config.log.every_s,
                                               start_step=self.step)

  # ---- PipelineHooks ------------------------------------------------------------------------

  def steps_done(self) -> int:
    return self.step

  def may_start_request(self, in_flight_rollouts: int) -> bool:
    if not self.config.buffer.on_policy:
      return True
    return len(self.parts.buffer) + in_flight_rollouts + self.request_rollouts <= \
        self.parts.buffer.capacity

  def start_request(self, worker_id: int) -> Request:
    """Generates with the sampler's (newest published) weights; used by the simulated schedule."""
    del worker_id
    items = self.parts.prompts.take(self.config.rollout.prompts_per_request)
    prompts = [self.parts.codec.encode_prompt(p.prompt) for _, p in items]
    t0 = time.perf_counter()
    groups = self.parts.sampler.generate(prompts, self.config.rollout.group_size, self.sampling)
    seconds = time.perf_counter() - t0
    self._account_generation(groups, seconds)
    if groups and groups[0].policy_version == self.step:
      self._maybe_check_mismatch(groups)
    return Request([i for i, _ in items], [p for _, p in items], groups, seconds)

  def finish_request(self, handle: Request, now: float) -> None:
    del now
    self.deliver(handle.indices, handle.problems, handle.groups)

  def can_train(self) -> bool:
    return len(self.parts.buffer) >= self.config.buffer.batch_size

  def train_step(self, now: float) -> None:
    p, c = self.parts, self.config
    t0 = time.perf_counter()
    rollouts = p.buffer.sample(c.buffer.batch_size, current_version=self.step)
    t1 = time.perf_counter()
    batch = collate_lib.collate(rollouts, buckets=p.buckets, pad_id=p.codec.pad_id,
                                batch_size=c.buffer.batch_size)
    t2 = time.perf_counter()
    if c.scheduler.kind == "async":
      fresh = batch.policy_version == self.step
      if fresh.any() and self.step % max(c.log.mismatch_every, 1) == 0:
        self._mismatch_on_batch(batch, fresh)
    if jax.process_count() > 1:  # lockstep host pipelines: cheap check that they still agree
      sharding.assert_same_on_all_processes(
          np.array([self.step, batch.tokens.sum(), batch.tokens.shape[1],
                    int(np.round(batch.advantages.sum() * 1e4))], np.int64), "the training batch")
    p.state, step_metrics = p.train_step(p.state, batch)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    t3 = time.perf_counter()
    self.step += 1
    self.timing.update(sample_s=t1 - t0, collate_s=t2 - t1, step_s=t3 - t2)
    tokens = int(np.sum(batch.segment_ids > 0))
    p.accountant.add_training((t3 - t2) * c.trainer.num_devices, tokens,
                              seq_len=int(batch.tokens.shape[1]))
    stats = p.buffer.last_batch_stats or {}
    self._step_metrics = dict(step_metrics)
    self._step_metrics["batch/reward_mean"] = float(np.mean([r.reward for r in rollouts]))
    for key in ("staleness_mean", "staleness_max"):
      if key in stats:
        self._step_metrics[f"buffer/{key}"] = float(stats[key])
    self._step_metrics["time/virtual"] = float(now)

  def finish_step(self, now: float) -> None:
    c = self.config
    if self.step % c.rollout.refresh_every == 0 or self.step == c.total_steps:
      self.publish()
    row = self._metrics_row(now)
    if (c.eval.every and self.step % c.eval.every == 0) or self.step == c.total_steps:
      self.last_eval = self.evaluate()
      row.update(self.last_eval)
    self.parts.writer.write(self.step, row)
    self.progress.update(self.step, row)
    if (c.checkpoint.every and self.step % c.checkpoint.every == 0) or self.step == c.total_steps:
      self.checkpoint()

  # ---- the async schedule's worker side (called from pool threads) --------------------------

  def next_prompts(self, worker_index: int):
    """The next request for a pool worker, or None while an on-policy queue is full."""
    del worker_index
    from jaxreplay.rollout.pool import PromptBatch  # pylint: disable=g-import-not-at-top
    with self._lock:
      if not self.may_start_request(self._in_flight):
        return None
      self._in_flight += self.request_rollouts
    items = self.parts.prompts.take(self.config.rollout.prompts_per_request)
    prompts = [self.parts.codec.encode_prompt(p.prompt) for _, p in items]
    return PromptBatch(prompts, self.config.rollout.group_size, self.sampling, meta=items)

  def deliver_async(self, delivery) -> None:
    items = delivery.batch.meta
    self._account_generation(delivery.groups, delivery.generate_seconds)
    try:
      self.deliver([i for i, _ in items], [p for _, p in items], delivery.groups)
    finally:
      with self._lock:
        self._in_flight -= self.request_rollouts

  def dropped(self, batch, error) -> None:
    """A worker died mid-request: its prompts are handed out again, nothing reached the buffer."""
    logging.warning("rollout request dropped (%s); re-queueing its %d prompts", error,
                    len(batch.meta))
    self.parts.prompts.dropped([i for i, _ in batch.meta])
    with self._lock:
      self._in_flight -= self.request_rollouts

  # ---- parts of a step ----------------------------------------------------------------------

  def deliver(self, indices, problems, groups) -> None:
    """Scores groups and adds their rollouts to the buffer (all or nothing)."""
    p = self.parts
    with self._lock:
      ids = list(range(self.next_group_id, self.next_group_id + len(groups)))
      self.next_group_id += len(groups)
    rollouts, rewards = groups_to_rollouts(groups, problems, p.task, p.codec, p.advantage_fn, ids)
    p.buffer.add(rollouts)
    p.prompts.delivered(indices)
    with self._lock:
      self.fresh_rewards.append(rewards.reshape(-1))

  def _account_generation(self, groups, seconds: float) -> None:
    tokens = sum(len(g.prompt_tokens) + len(c.tokens) for g in groups for c in g.completions)
    n = sum(len(g.completions) for g in groups)
    self.parts.accountant.add_generation(seconds, tokens, seq_len=max(tokens // max(n, 1), 1))

  def publish(self) -> None:
    """Hands the current weights to the rollout workers (one batched HF-format write)."""
    t0 = time.perf_counter()
    self.parts.publish(self.parts.state.params, self.step)
    self.published_version = self.step
    self.timing["publish_s"] = time.perf_counter() - t0

  def _maybe_check_mismatch(self, groups) -> None:
    """Trainer vs sampler log-probs of the same tokens at the same policy version."""
    if self.step % max(self.config.log.mismatch_every, 1):
      return
    rollouts, _ = groups_to_rollouts(groups, [None] * len(groups), _NoTask(), self.parts.codec,
                                     lambda r: np.zeros_like(r), [0] * len(groups))
    batch = collate_lib.collate(rollouts, buckets=self.parts.buckets,
                                pad_id=self.parts.codec.pad_id)
    self._mismatch_on_batch(batch, np.ones(batch.tokens.shape[0], bool))

  def _mismatch_on_batch(self, batch, rows: np.ndarray) -> None:
    p = self.parts
    trainer_lp = np.asarray(sharding.host_local(p.logprob_fn(p.state.params, batch)))
    mask = (batch.completion_mask > 0) & rows[:, None]
    if not mask.any():
      return
    diff = np.abs(trainer_lp - batch.behaviour_logprobs)[mask]
    self.mismatch = {"mismatch/logprob_abs_diff": float(diff.mean()),
                     "mismatch/exp_abs_diff": float(np.exp(diff).mean()),
                     "mismatch/logprob_abs_diff_max": float(diff.max()),
                     "mismatch/tokens": float(mask.sum())}

  def evaluate(self) -> dict[str, float]:
    p, c = self.parts, self.config
    p.eval_sampler.set_params(sharding.local_params(p.state.params), self.step)
    return evaluation.evaluate(
        p.eval_sampler.generate, p.task, p.eval_problems, p.codec, n_samples=c.eval.n_samples,
        ks=tuple(c.eval.ks), temperature_pass1=c.eval.temperature_pass1, n_pass1=4,
        temperature_passk=c.eval.temperature_passk, max_tokens=c.rollout.max_tokens,
        seed=c.seed + 7919)

  def _metrics_row(self, now: float) -> dict[str, Any]:
    p = self.parts
    with self._lock:
      fresh = np.concatenate(self.fresh_rewards) if self.fresh_rewards else np.zeros(0)
      self.fresh_rewards = []
    row = {"policy_version": self.step, "published_version": self.published_version}
    row.update(self._step_metrics)
    row["reward_mean"] = float(fresh.mean()) if fresh.size else float("nan")
    row["fresh_rollouts"] = float(fresh.size)
    row.update(p.buffer.metrics(current_version=self.step))
    if "buffer/staleness_mean" in self._step_metrics:
      row["buffer/staleness_mean"] = self._step_metrics["buffer/staleness_mean"]
    row.update(p.accountant.metrics())
    row["compute/measured_seconds"] = row["compute_seconds"]
    sim = p.sim_compute_metrics()
    row.update(sim)
    if sim:  # the x-axis of accuracy-vs-compute: the modelled hardware's device-seconds
      row["compute_seconds"] = sim["sim/compute_seconds"]
    row.update({f"time/{k}": v for k, v in self.timing.items()})
    row["time/wall_s"] = time.monotonic() - self._t_start
    row.update(self.mismatch)
    row.update({k: float(v) for k, v in p.task.reward_metrics().items()})
    if p.workers is not None:
      row.update(p.workers.pool_metrics())
    return row

  # ---- checkpoints ------------------------------------------------------------------------

  def host_state(self) -> dict[str, Any]:
    return {"buffer": self.parts.buffer.state_dict(), "prompts": self.parts.prompts.state_dict(),
            "accountant": self.parts.accountant.state_dict(),
            "sim": dataclasses.asdict(self.parts.sim_state), "next_group_id": self.next_group_id,
            "published_version": self.published_version}

  def checkpoint(self) -> None:
    p = self.parts
    if self.step in p.checkpointer.all_steps():
      return
    p.checkpointer.save(self.step, p.state, self.host_state())
    p.checkpointer.wait()
    params = sharding.host_local(p.state.params)  # collective when multi-process
    if jax.process_index() == 0:
      models.save_hf(p.model_cfg, params, os.path.join(self.workdir, "hf"),
                     tokenizer_dir=p.tokenizer_dir)

  def restore_host_state(self, host: dict[str, Any]) -> None:
    p = self.parts
    p.buffer.load_state_dict(host["buffer"])
    p.prompts.load_state_dict(host["prompts"])
    p.accountant.load_state_dict(host["accountant"])
    for k, v in host["sim"].items():
      setattr(p.sim_state, k, v)
    self.next_group_id = int(host["next_group_id"])

  # ---- the run ------------------------------------------------------------------------------

  def run(self) -> dict[str, Any]:
    c, p = self.config, self.parts
    if p.resumed_host is not None:
      self.restore_host_state(p.resumed_host)
      logging.info("resumed at step %d (buffer %d rollouts)", self.step, len(p.buffer))
    if self.step >= c.total_steps:
      logging.info("nothing to do: step %d >= total_steps %d", self.step, c.total_steps)
      return self.summary()
    self.publish()
    if self.step == 0:
      row = {"policy_version": 0, **self.evaluate()} if c.eval.every else {"policy_version": 0}
      row.update(p.sim_compute_metrics())
      row["compute_seconds"] = 0.0
      self.last_eval = row
      p.writer.write(0, row)
    try:
      if c.scheduler.kind == "simulated":
        sched = schedulers.SimulatedScheduler(
            c.rollout.num_workers, c.trainer.num_devices, self.request_rollouts,
            p.gen_seconds_per_rollout, c.scheduler.train_seconds_per_step, state=p.sim_state)
        sched.run(self, c.total_steps)
      else:
        p.run_async(self)
    finally:
      p.close()
    return self.summary()

  def summary(self) -> dict[str, Any]:
    return {"step": self.step, **{k: v for k, v in self.last_eval.items() if k.startswith("eval/")}}


class _NoTask:
  """Scores nothing (for log-prob comparisons of unscored groups)."""

  def score_batch(self, texts, problems):
    del problems
    return np.zeros(len(texts), np.float32)


def run(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the experiment in `workdir`; returns the final step and eval metrics."""
  os.makedirs(workdir, exist_ok=True)
  setup_lib.resolve_backend(config)  # run_config.json records the backend actually used
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "run_config.json"), "w") as f:
      json.dump(config.to_dict(), f, indent=1, default=str)
  return Pipeline(config, workdir).run()
