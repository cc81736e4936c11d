"""The replay pipeline: `run(config, workdir)`.

Data flow (PAPER.md): rollout workers sample groups with the newest published weights -> rewards and
group-relative advantages -> `ReplayBuffer` (FIFO, capacity N) -> the trainer samples B rollouts per
step (uniformly, without removing them) -> `collate` -> jitted sharded `train_step` -> every
`refresh_every` steps the weights are handed to the workers. The on-policy baseline is the same code
with `buffer.on_policy=True` (a queue: each rollout used once, workers wait when it is full).

`run` builds the parts (`jaxreplay.run.build`), and runs a `Pipeline` under one of two schedules side by
side (`jaxreplay.run.schedules`): "simulated" (W workers and T trainer devices in virtual time,
deterministic bit for bit) or "async" (a pool of real workers next to the trainer loop).

Outputs in `workdir`: metrics.jsonl, tb/ (TensorBoard), checkpoints/ (orbax: train state + buffer +
prompt cursor + counters, saved together), hf/ (latest HF export), run_config.json.
Re-running the same command resumes from the newest complete checkpoint.

Evaluation (`Pipeline.evaluate`) samples where config.eval.backend says: "trainer", a `JaxSampler`
on the trainer devices loaded with the current params; "engines", the rollout workers through the
schedule (`run_jobs`: the local worker, or the async pool's free runners between requests) at the
current step's weights. Both count their generate calls (`eval_calls` in the host state), from which
the JAX samplers draw their eval noise, so a resumed simulated run evaluates as the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from jaxreplay.config import resolve as resolve_lib
from jaxreplay.config import validation
from jaxreplay.run import build as build_lib
from jaxreplay.data import collate as collate_lib
from jaxreplay.run import evaluation
from jaxreplay.run import eval_grid as eval_grid_lib
from jaxreplay.infra import compilation_cache
from jaxreplay.infra import metric_writers as metrics_lib
from jaxreplay.models import hf_io
from jaxreplay.models import lora as lora_lib
from jaxreplay.infra import safety
from jaxreplay.run import schedules
from jaxreplay.infra import sharding
from jaxreplay.learner import trainer
from jaxreplay.rollout.base import Weights


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What `train_step` hands to `publish_if_due` and `finish_step`: the step number reached and
  its metrics (train step metrics, batch/reward_mean, time/virtual), and the batch's rollouts
  (named in the report of a non-finite update)."""
  step: int
  metrics: dict[str, float]
  rollouts: tuple = ()


class Pipeline:
  """One run's trainer side over its `Parts`: the schedule hooks (`schedules.Hooks`)."""

  def __init__(self, parts: build_lib.Parts, stop: Optional[safety.StopSignals] = None):
    self.parts, self.config = parts, parts.config
    self.stop = stop  # a SIGTERM / SIGINT ends the run after the current step
    self.scheduler = None  # set by `run`: its state (in-flight requests) goes into checkpoints
    self.schedule = schedules.schedule_class(parts.config.scheduler.kind)  # what it is
    self.guard = safety.NonFiniteGuard(parts.config.trainer.max_nonfinite_skips)
    self.intake = parts.intake
    self.state = parts.state
    self.step = int(jax.device_get(self.state.step))
    self.weights: Optional[Weights] = None
    self.last_eval: dict[str, float] = {}
    self.eval_calls = 0  # generate calls of evaluations on the engines (eval.backend="engines")
    self.finished = self.step >= parts.config.total_steps
    self.stopped = False  # a stop signal, honoured at a step's end (agreed by all processes)
    self.eval_grid = eval_grid_lib.EvalGrid.from_config(parts.config.eval)  # when to evaluate
    self._eval_decision = (-1, False)  # (step, whether it is evaluated), from `_end_of_step`
    self._sample_seconds = 0.0  # the last `sample_rollouts` call's
    c = self.config
    self.progress = metrics_lib.ProgressLogger(c.total_steps, every_s=c.log.every_s,
                                               start_step=self.step)

  # ---- schedules.Hooks -------------------------------------------------------------------------

  def done(self) -> bool:
    return self.finished or self.stopped

  def stop_requested(self) -> bool:
    """Whether a stop signal reached this process (it takes effect at the next step's end)."""
    return self.stop is not None and self.stop.requested is not None

  def latest_weights(self) -> Weights:
    return self.weights

  def generated(self, groups, seconds: float) -> None:
    tokens = sum(len(g.prompt_tokens) + len(c.tokens) for g in groups for c in g.completions)
    n = sum(len(g.completions) for g in groups)
    self.parts.accountant.add_generation(seconds, tokens, seq_len=max(tokens // max(n, 1), 1))
    probe = self.parts.metrics.mismatch
    # Under the simulated schedule generation and training interleave on this thread, so fresh
    # groups are compared at once; the async schedule compares fresh rows of a batch instead.
    if (self.schedule.mismatch_at_generation and groups
        and groups[0].policy_version == self.step and probe.due(self.step)):
      probe.check_groups(self.state.params, groups)

  def can_train(self) -> bool:
    p = self.parts
    if p.reuse is not None and not p.reuse.may_train(p.buffer.total_added):
      return False  # the reuse controller waits for fresh rollouts
    return len(p.buffer) >= self.config.buffer.batch_size

  def train_step(self, now: float) -> StepResult:
    """Samples a batch from the buffer and takes one gradient step on it."""
    return self.train_on(self.sample_rollouts(), now)

  def sample_rollouts(self) -> list:
    """The next batch's B rollouts, sampled from the buffer (the time it took goes to the step's
    timing). Under the multi-process async schedule only process 0 calls it and sends them on."""
    t0 = time.perf_counter()
    rollouts = self.parts.buffer.sample(self.config.buffer.batch_size, current_version=self.step)
    self._sample_seconds = time.perf_counter() - t0
    return rollouts

  def train_on(self, rollouts, now: float) -> StepResult:
    """Collates `rollouts` (B of them, from `sample_rollouts` here or on process 0) and takes one
    gradient step at virtual or wall time `now` [s]."""
    p, c = self.parts, self.config
    rollouts = list(rollouts)
    sample_s, self._sample_seconds = self._sample_seconds, 0.0
    t1 = time.perf_counter()
    batch = collate_lib.collate(rollouts, buckets=p.buckets, pad_id=p.codec.pad_id,
                                batch_size=c.buffer.batch_size, pack=c.trainer.pack,
                                row_multiple=sharding.batch_size_multiple(p.mesh) *
                                c.trainer.num_microbatches,
                                same_bucket=c.trainer.aggregation == "constant")
    t2 = time.perf_counter()
    if not self.schedule.mismatch_at_generation and p.metrics.mismatch.due(self.step):
      fresh = batch.policy_version == self.step  # [B], or [B, T] when packed
      if fresh.any():
        p.metrics.mismatch.check_batch(self.state.params, batch, fresh)
    if jax.process_count() > 1:  # every process must take the step on the same batch
      sharding.assert_same_on_all_processes(
          np.array([self.step, batch.tokens.sum(), batch.tokens.shape[1],
                    int(np.round(batch.advantages.sum() * 1e4))], np.int64), "the training batch")
    diag, t_step = {}, t2
    if p.regime is not None and p.regime.due(self.step):  # measured before the donating step
      diag = p.regime.before_update(self.state.params, self.state.ref_params, batch, rollouts)
      t_step = time.perf_counter()  # not part of the step's time (nor of its compute)
    self.state, step_metrics = p.train_step(self.state, batch)
    step_metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    t3 = time.perf_counter()
    if diag:
      diag.update(p.regime.after_update(self.state.params))
      diag["time/diagnostics_s"] = time.perf_counter() - t3 + t_step - t2
      step_metrics.update(diag)
    if p.reuse is not None and p.reuse.active:
      step_metrics.update(p.reuse.decide(diag, self.step) if diag else
                          {"controller/reuse_target": p.reuse.rho})
      p.reuse.stepped()
    self.step += 1
    p.metrics.timing.update(sample_s=sample_s, collate_s=t2 - t1, step_s=t3 - t_step)
    p.accountant.add_training((t3 - t_step) * c.trainer.num_devices, int(np.sum(batch.segment_ids > 0)),
                              seq_len=int(batch.tokens.shape[1]))
    step_metrics["batch/reward_mean"] = float(np.mean([r.reward for r in rollouts]))
    step_metrics["time/virtual"] = float(now)
    return StepResult(self.step, step_metrics, tuple(rollouts))

  def _end_of_step(self) -> None:
    """Decides at the end of each step (once) whether it is the run's last one, whether it is
    evaluated, and whether a stop signal ends the run here. A stop takes effect only at a step's
    end, so its checkpoint holds the same kind of state as a periodic one. With several trainer
    processes they agree (one allgather): all stop after the same step if any got a signal, and
    process 0 decides the end and the evaluations (under the async schedule only it accounts the
    generation compute they depend on)."""
    grid = self.eval_grid
    grid.compute_at_step_end = self.parts.metrics.compute_seconds()
    self._decide_finished(grid.compute_at_step_end)
    eval_due = self._eval_due(self.step)
    stop = self.stop_requested()
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      flags = np.asarray(multihost_utils.process_allgather(
          np.array([stop, self.finished, eval_due, grid.passk_due], np.int32))).reshape(-1, 4)
      stop = bool(flags[:, 0].any())
      self.finished, eval_due, grid.passk_due = (bool(x) for x in flags[0, 1:])
    self.stopped = stop and not self.finished
    self._eval_decision = (self.step, eval_due)

  def _decide_finished(self, compute: float) -> None:
    c = self.config
    budget_spent = c.compute_budget > 0 and compute >= c.compute_budget
    self.finished = self.step >= c.total_steps or budget_spent

  def publish_if_due(self, result: StepResult) -> Optional[Weights]:
    self._end_of_step()
    if result.step % self.config.rollout.refresh_every == 0 or self.finished:
      return self.publish()
    self.parts.metrics.timing["publish_s"] = 0.0
    return None

  def _eval_due(self, step: int) -> bool:
    return self.eval_grid.due(step, self.finished, self.parts.metrics.compute_seconds)

  def finish_step(self, result: StepResult, now: float) -> None:
    del now
    c, step = self.config, result.step
    row = self.parts.metrics.row(step, self.weights.version, result.metrics)
    decided_step, eval_due = self._eval_decision
    if decided_step != step:  # publish_if_due was not called for this step
      eval_due = self._eval_due(step)
    if eval_due:
      self.last_eval = self.evaluate()
      row.update(self.last_eval)
    self.parts.writer.write(step, row)
    self.progress.update(step, row, force=self.finished)
    self.guard.update(step, bool(result.metrics.get("nonfinite_skipped", 0.0)), result.rollouts,
                      result.metrics)
    if (c.checkpoint.every and step % c.checkpoint.every == 0) or self.finished:
      self.checkpoint()
    if c.export_hf_every and (step % c.export_hf_every == 0 or self.finished):
      self.export_hf()

  # ---- weights, evaluation, checkpoints ---------------------------------------------------------

  def publish(self) -> Weights:
    """Hands the current weights to the rollout backend; returns the new handle."""
    t0 = time.perf_counter()
    self.weights = self.parts.rollouts.publish(self.state.params, self.step)
    self.parts.metrics.timing["publish_s"] = time.perf_counter() - t0
    return self.weights

  def evaluate(self) -> dict[str, float]:
    """Evaluates the current params on the held-out problems (`evaluation.evaluate`), on the
    trainer's JAX sampler or on the rollout engines (config.eval.backend)."""
    p, c = self.parts, self.config
    n_samples = c.eval.n_samples if self.eval_grid.passk_due else 0  # eval.passk_grid: pass@1 only
    problems = p.eval_problems
    if not n_samples and c.eval.get("pass1_problems", 0):  # pass@1-only points: a subset
      problems = problems[:int(c.eval.pass1_problems)]
    settings = dict(n_samples=n_samples, ks=tuple(c.eval.ks),
                    temperature_pass1=c.eval.temperature_pass1, n_pass1=4,
                    temperature_passk=c.eval.temperature_passk, max_tokens=c.rollout.max_tokens,
                    top_p=c.eval.top_p, seed=c.seed + 7919)
    if p.eval_sampler is not None:  # eval.backend="trainer"
      params = p.model_params(self.state.params)  # LoRA: the base with the adapters attached
      p.eval_sampler.load_weights(Weights(self.step, params=sharding.local_params(params)))
      return evaluation.evaluate(p.eval_sampler.generate, p.task, problems, p.codec, **settings)
    return self._evaluate_on_engines(settings, problems)

  def _evaluate_on_engines(self, settings: dict[str, Any], problems: list) -> dict[str, float]:
    """eval.backend="engines": the requests run as jobs on the schedule's rollout workers at this
    step's weights; with several workers (async) the problems are split into one chunk each."""
    if self.scheduler is None or not hasattr(self.scheduler, "run_jobs"):
      raise RuntimeError("eval.backend='engines' evaluates through the schedule's workers, but this "
                         "Pipeline has no scheduler: set pipeline.scheduler = make_scheduler(parts) "
                         "before start() (pipeline.run does), or use eval.backend='trainer'")
    p = self.parts
    weights = self._eval_weights()
    first_call = self.eval_calls

    def generate_many(requests):
      out = self.scheduler.run_jobs(self, weights, evaluation.engine_jobs(requests, first_call))
      self.eval_calls = first_call + len(requests)
      return out

    parallel = max(int(self.scheduler.job_parallelism), 1)
    batch_size = -(-len(problems) // parallel) if parallel > 1 else None
    return evaluation.evaluate(None, p.task, problems, p.codec, batch_size=batch_size,
                               generate_many=generate_many, **settings)

  def _eval_weights(self) -> Weights:
    """This step's weights as the workers load them: the published ones when this step was
    published, else an eval-only copy (`RolloutBackend.publish_eval`: jax, a device copy; vllm, a
    segment or HF dir of its own publisher, so the rollout publisher's versions are never pushed
    out)."""
    if self.weights is not None and self.weights.version == self.step:
      return self.weights
    p = self.parts
    params = self.state.params
    return p.rollouts.publish_eval(params, self.step)  # gathers host copies with several processes

  def close(self) -> None:
    """Nothing of its own to release: the rollout backend owns the eval-only publisher (closed
    with the backend, after the schedule's workers)."""

  def host_state(self) -> dict[str, Any]:
    p = self.parts
    with self.intake.snapshot_lock:  # the async workers' deliveries wait for this snapshot
      buffer_state, intake_state = p.buffer.state_dict(), self.intake.state_dict()
    host = {"buffer": buffer_state, **intake_state,
            "accountant": p.accountant.state_dict(), "sim": dataclasses.asdict(p.sim_state),
            "published_version": self.weights.version,
            "eval_calls": (p.eval_sampler.call_count if p.eval_sampler is not None
                           else self.eval_calls),
            "counters": p.metrics.counters(),
            "regime": p.regime.state_dict() if p.regime is not None else None,
            "reuse": p.reuse.state_dict() if p.reuse is not None else None,
            "nonfinite": {"consecutive": self.guard.consecutive, "total": self.guard.total},
            "eval_grid": self.eval_grid.state_dict()}
    if hasattr(self.scheduler, "state_dict"):
      host["scheduler"] = self.scheduler.state_dict()
    if p.lora is not None:  # the base the adapters belong to: path and content hash (not the base)
      host["lora"] = p.lora.identity()
    return host

  def _check_finite(self, what: str) -> None:
    """Nothing non-finite is ever written: the train step skips such updates, this is the backstop."""
    if not trainer.all_finite(self.state.params):
      raise safety.NonFiniteUpdates(
          f"step {self.step}: the parameters hold NaN/inf; the {what} is not written, so the last "
          "checkpoint stays the newest finite one. Lower trainer.learning_rate or check the data, "
          "then rerun the same command to resume from it")

  def checkpoint(self) -> None:
    """Starts an asynchronous save of this step's train and host state (the host state is encoded
    now and the device arrays copied to host before `save` returns, so the next, donating step may
    run at once); with export_hf_every=0 the HF export goes with it."""
    p = self.parts
    if self.step in p.checkpointer.all_steps():
      return
    self._check_finite("checkpoint")
    p.checkpointer.save(self.step, self.state, self.host_state())
    if not self.config.export_hf_every:
      self.export_hf()

  def export_hf(self) -> None:
    """WORKDIR/hf: the policy as an HF model; with LoRA the merged model, and the adapters in
    PEFT's format in WORKDIR/hf_adapter (`lora.save_peft`)."""
    self._check_finite("HF export")
    p = self.parts
    params = sharding.host_local(self.state.params)  # a collective when multi-process
    if jax.process_index() != 0:
      return
    if p.lora is not None:
      lora_lib.save_peft(os.path.join(p.workdir, "hf_adapter"), p.model_cfg, p.lora.spec, params,
                         base_model_name_or_path=p.lora.path)
      params = lora_lib.merge(p.model_cfg, sharding.host_local(p.lora.params), params, p.lora.spec)
    hf_io.save_hf(p.model_cfg, params, os.path.join(p.workdir, "hf"), tokenizer_dir=p.tokenizer_dir)

  def restore_host_state(self, host: dict[str, Any]) -> None:
    p = self.parts
    p.buffer.load_state_dict(host["buffer"])
    self.intake.load_state_dict(host)
    p.accountant.load_state_dict(host["accountant"])
    for k, v in host["sim"].items():
      setattr(p.sim_state, k, v)
    if "eval_calls" in host:  # checkpoints written before these keys existed resume without them
      if p.eval_sampler is not None:
        p.eval_sampler.call_count = int(host["eval_calls"])
      else:
        self.eval_calls = int(host["eval_calls"])
    if "counters" in host:
      p.metrics.restore_counters(host["counters"])
    if host.get("regime") and p.regime is not None:
      p.regime.load_state_dict(host["regime"])
    if host.get("reuse") and p.reuse is not None:
      p.reuse.load_state_dict(host["reuse"])
    if "nonfinite" in host:
      self.guard.consecutive = int(host["nonfinite"]["consecutive"])
      self.guard.total = int(host["nonfinite"]["total"])
    if "eval_grid" in host:
      self.eval_grid.load_state_dict(host["eval_grid"])

  def resume(self) -> None:
    """Restores the host state of a resumed run and decides whether it has finished already."""
    p, c = self.parts, self.config
    if p.resumed_host is not None:
      self.restore_host_state(p.resumed_host)
      logging.info("resumed at step %d (buffer %d rollouts)", self.step, len(p.buffer))
    if c.scheduler.reference_tokens > 0:
      p.sim_state.reference_tokens = float(c.scheduler.reference_tokens)
    if p.resumed_host is not None and "eval_grid" in p.resumed_host:
      compute = self.eval_grid.compute_at_step_end  # saved: async compute moves on after it
    else:  # a fresh run, or a checkpoint from before the eval_grid key
      compute = p.metrics.compute_seconds()
      self.eval_grid.skip_evaluated(compute)  # the evaluated ones
    if self.step > 0:
      self._decide_finished(compute)

  def start(self) -> None:
    """Publishes the first weights and evaluates the initial policy (step 0)."""
    p, c = self.parts, self.config
    self.publish()
    if self.step == 0:
      evaluate = self.eval_grid.start()
      self.last_eval = p.metrics.first_row(self.evaluate() if evaluate else {})
      p.writer.write(0, self.last_eval)

  def summary(self) -> dict[str, Any]:
    out = {"step": self.step, **{k: v for k, v in self.last_eval.items() if k.startswith("eval/")}}
    if self.stopped and not self.finished:
      out["stopped_by"] = self.stop.requested or "a stop on another trainer process"
    return out

  def stop_now(self) -> None:
    """After a stop signal, at a step's end: that step's checkpoint (unless saved already), so a
    rerun of the same command resumes exactly here."""
    logging.info("stopping at step %d (%s): saving a checkpoint", self.step, self.stop.requested)
    self.checkpoint()


def make_scheduler(parts: build_lib.Parts):
  """The config's schedule: `SimulatedScheduler`, `SyncScheduler` or `AsyncScheduler` (which owns
  the worker pool; on trainer processes other than 0 of a multi-process run, `FollowerScheduler`),
  built by its class (`schedules.schedule_class(kind).from_parts`)."""
  return schedules.schedule_class(parts.config.scheduler.kind).from_parts(parts)


def write_run_config(config, workdir: str) -> None:
  """WORKDIR/run_config.json, written atomically (a killed write leaves the previous one)."""
  path = os.path.join(workdir, "run_config.json")
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(config.to_dict(), f, indent=1, default=str)
  os.replace(tmp, path)


def check_resume_compatible(config, workdir: str) -> None:
  """Changes between the run that wrote `workdir` and this one that would silently change the
  training: a cosine schedule's total_steps or warmup (the learning rate would jump), LoRA turned
  on or off or its shape changed (the checkpoint holds the other kind of train state)."""
  path = os.path.join(workdir, "run_config.json")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  committed = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
  if not committed or not os.path.isfile(path):  # nothing to resume: any horizon is fine
    return
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    return
  lora_keys = ("lora_rank", "lora_targets", "lora_alpha", "lora_rslora", "lora_dtype")
  old_m = old.get("model", {})
  lora_changed = [f"model.{k} {old_m.get(k)} -> {config.model.get(k)}" for k in lora_keys
                  if k in old_m and _plain(old_m[k]) != _plain(config.model.get(k))]
  if lora_changed:
    raise ValueError(f"resuming {workdir} with changed LoRA settings ({', '.join(lora_changed)}): "
                     "its checkpoints hold the other train state. Resume with the original values, "
                     "or start a new workdir")
  t, old_t = config.trainer, old.get("trainer", {})
  if t.schedule != "cosine" or old_t.get("schedule") != "cosine":
    return
  changed = [f"{name} {old_v} -> {new_v}" for name, old_v, new_v in (
      ("total_steps", old.get("total_steps"), config.total_steps),
      ("trainer.warmup_steps", old_t.get("warmup_steps"), t.warmup_steps)) if old_v != new_v]
  if changed:
    raise ValueError(
        f"resuming {workdir} with a changed cosine schedule ({', '.join(changed)}): the learning "
        "rate would jump at the resumed step. Resume with the original values, or start a new "
        "workdir (or use trainer.schedule='constant', which has no horizon)")


def _plain(value):
  """A config value as run_config.json holds it (tuples as lists)."""
  return list(value) if isinstance(value, (tuple, list)) else value


def run(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the experiment in `workdir`; returns the final step and eval metrics.

  The run holds WORKDIR/.lock for its life (`safety.WorkdirLock`: a second run there fails at
  once); the config is validated, then resolved once into a frozen copy (`config.resolve`: the
  "auto" choices made) that everything reads and nothing mutates (`config` itself is untouched);
  run_config.json records it, written only once the run is built (the config is valid). A SIGTERM / SIGINT ends it
  after the current step with a checkpoint (the summary then has "stopped_by"); a second one
  exits at once.
  """
  os.makedirs(workdir, exist_ok=True)
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      stack.enter_context(safety.WorkdirLock(workdir))
    validation.validate_config(config)  # once: `build` trusts it
    config = resolve_lib.resolve(config)  # "auto" made (run_config.json records it), frozen
    compilation_cache.apply(config.trainer.get("compilation_cache", "auto"), workdir)  # 1st compile
    check_resume_compatible(config, workdir)
    stop = stack.enter_context(safety.StopSignals())
    parts = build_lib.build(config, workdir, stack)
    if jax.process_index() == 0:  # only a config that built (a rejected rerun leaves the old one)
      write_run_config(config, workdir)
    pipeline = Pipeline(parts, stop)
    stack.callback(pipeline.close)
    scheduler = make_scheduler(parts)
    stack.callback(scheduler.close)  # the workers, also when start() fails (eval on the engines)
    pipeline.scheduler = scheduler
    if parts.resumed_host is not None and "scheduler" in parts.resumed_host:
      if hasattr(scheduler, "load_state_dict"):
        scheduler.load_state_dict(parts.resumed_host["scheduler"])
      else:  # a simulated run resumed under another schedule: its in-flight prompts are re-issued
        logging.info("the checkpoint's in-flight simulated requests are generated again under "
                     "scheduler.kind=%r", config.scheduler.kind)
    pipeline.resume()
    if pipeline.finished:
      logging.info("nothing to do: the run in %s finished at step %d (total_steps %d, "
                   "compute_budget %g)", workdir, pipeline.step, config.total_steps,
                   config.compute_budget)
      return pipeline.summary()
    pipeline.start()
    scheduler.run(pipeline)
    if jax.process_index() == 0:
      m = parts.buffer.metrics()
      logging.info("replay buffer: %d rollouts added over the run (resumes included), %d sampled",
                   m["buffer/total_added"], m["buffer/total_sampled"])
    if pipeline.stopped and not pipeline.finished:
      pipeline.stop_now()
  return pipeline.summary()
