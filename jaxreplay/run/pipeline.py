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
import json
import os
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from jaxreplay.config import resolve as resolve_lib
from jaxreplay.config import validation
from jaxreplay.run import build as build_lib
from jaxreplay.run import checkpointing
from jaxreplay.run import evaluator as evaluator_lib
from jaxreplay.run import hooks as hooks_lib
from jaxreplay.run import training as training_lib
from jaxreplay.infra import compilation_cache
from jaxreplay.infra import metric_writers as metrics_lib
from jaxreplay.infra import safety
from jaxreplay.run import schedules
from jaxreplay.rollout.base import Weights


class Pipeline:
  """One run's trainer side over its `Parts`, in parts: the schedule's hooks (`schedules.Hooks`)
  here, the gradient steps and weights in `training.Training`, the evaluation in
  `evaluator.Evaluator`, checkpoint / resume / export in `checkpointing.RunCheckpoint`, and what
  runs at a step's end in `hooks.TrainerHooks` (evaluation, the metrics row, checkpoint, export).

  Args:
    parts: the run's parts (`build.build`).
    scheduler: its schedule (`make_scheduler(parts)`): the engine evaluation runs its jobs, its
      state goes into checkpoints.
    stop: the run's stop signals (a SIGTERM / SIGINT ends the run after the current step), or None.
  """

  def __init__(self, parts: build_lib.Parts, scheduler: schedules.Schedule,
               stop: Optional[safety.StopSignals] = None):
    self.parts, self.config = parts, parts.config
    self.scheduler, self.stop = scheduler, stop
    self.intake = parts.data.intake  # `schedules.Hooks.intake`
    self.training = training_lib.Training(parts, scheduler.mismatch_at_generation,
                                          scheduler.virtual_time)
    self.evaluator = evaluator_lib.Evaluator(parts)
    self.guard = safety.NonFiniteGuard(parts.config.trainer.max_nonfinite_skips)
    self.checkpoints = checkpointing.RunCheckpoint(parts, self.training, self.evaluator, self.guard,
                                                   scheduler)
    c = self.config
    self.hooks = hooks_lib.TrainerHooks()
    self.hooks.add_hook(self._evaluate_into_row, due=self.evaluator.due, name="evaluate")
    self.hooks.add_hook(self._write_row, every=1, name="write_row")
    self.hooks.add_hook(self.checkpoints.save, every=c.checkpoint.every, name="checkpoint")
    if c.export_hf_every:  # else the export goes with each checkpoint
      self.hooks.add_hook(self.checkpoints.export_hf, every=c.export_hf_every, name="export_hf")
    self.finished = self.training.step >= c.total_steps
    self.stopped = False  # a stop signal, honoured at a step's end (agreed by all processes)
    self._decision: Optional[hooks_lib.Decision] = None  # this step's, from `_end_of_step`
    self.progress = metrics_lib.ProgressLogger(c.total_steps, every_s=c.log.every_s,
                                               start_step=self.training.step)

  @property
  def step(self) -> int:
    return self.training.step

  # ---- schedules.Hooks ---------------------------------------------------------------------------

  def done(self) -> bool:
    return self.finished or self.stopped

  def stop_requested(self) -> bool:
    """Whether a stop signal reached this process (it takes effect at the next step's end)."""
    return self.stop is not None and self.stop.requested is not None

  def latest_weights(self) -> Weights:
    return self.training.weights

  def generated(self, groups, seconds: float) -> None:
    self.training.generated(groups, seconds)

  def can_train(self) -> bool:
    return self.training.can_train()

  def train_step(self, now: float) -> training_lib.StepResult:
    """Samples a batch from the buffer and takes one gradient step on it."""
    return self.training.train_on(self.training.sample_rollouts(), now)

  def sample_rollouts(self) -> list:
    return self.training.sample_rollouts()

  def train_share(self, result: training_lib.StepResult) -> float:
    return result.train_share

  def train_on(self, rollouts, now: float) -> training_lib.StepResult:
    return self.training.train_on(rollouts, now)

  def publish_if_due(self, result: training_lib.StepResult) -> Optional[Weights]:
    self._end_of_step()
    if result.step % self.config.rollout.refresh_every == 0 or self.finished:
      return self.training.publish()
    self.training.skip_publish()
    return None

  def finish_step(self, result: training_lib.StepResult, now: float) -> None:
    """Runs the step-end hooks decided in `publish_if_due`: evaluation (into the row), the
    metrics row, checkpoint, export."""
    del now
    step = result.step
    if self._decision is None or self._decision.step != step:  # publish_if_due was not called
      self._end_of_step()
    row = self.parts.telemetry.metrics.row(step, self.training.weights.version, result.metrics)
    info = hooks_lib.StepInfo(step, self.finished, row, result)
    self.hooks.run_hooks(info, self._decision)

  # ---- the step's end ------------------------------------------------------------------------------

  def _end_of_step(self) -> None:
    """Decides at the end of each step (once) whether it is the run's last one, which hooks run
    (the evaluation's rule reads the compute axis), and whether a stop signal ends the run here.
    A stop takes effect only at a step's end, so its checkpoint holds the same kind of state as a
    periodic one. With several trainer processes they agree (one allgather): all stop after the
    same step if any got a signal, and process 0 decides the end, the hooks and the pass@k draw
    (under the async schedule only it accounts the generation compute they depend on)."""
    grid = self.evaluator.grid
    grid.compute_at_step_end = self.parts.telemetry.metrics.compute_seconds()
    self._decide_finished(grid.compute_at_step_end)
    decision = self.hooks.decide(hooks_lib.StepInfo(self.step, self.finished))
    stop = self.stop_requested()
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      n = len(decision.flags)
      flags = np.asarray(multihost_utils.process_allgather(
          np.array([stop, self.finished, self.evaluator.passk_due, *decision.flags], np.int32))
      ).reshape(-1, 3 + n)
      stop = bool(flags[:, 0].any())
      self.finished, self.evaluator.passk_due = bool(flags[0, 1]), bool(flags[0, 2])
      decision = hooks_lib.Decision(self.step, tuple(bool(x) for x in flags[0, 3:]))
    self.stopped = stop and not self.finished
    self._decision = decision

  def _decide_finished(self, compute: float) -> None:
    c = self.config
    budget_spent = c.compute_budget > 0 and compute >= c.compute_budget
    self.finished = self.step >= c.total_steps or budget_spent

  def _evaluate_into_row(self, info: hooks_lib.StepInfo) -> None:
    """The evaluation hook: the held-out metrics of this step's policy, added to its row (and
    its line on the console)."""
    metrics = self.evaluate()
    info.row.update(metrics)
    if jax.process_index() == 0:
      self.progress.evaluated(info.step, metrics)

  def _write_row(self, info: hooks_lib.StepInfo) -> None:
    """The row hook: the metrics row written, the progress line, the non-finite guard (which
    stops the run before a checkpoint after too many skipped updates)."""
    self.parts.telemetry.writer.write(info.step, info.row)
    self.progress.update(info.step, info.row, force=info.finished)
    result = info.result
    self.guard.update(info.step, bool(result.metrics.get("nonfinite_skipped", 0.0)),
                      result.rollouts, result.metrics)

  def evaluate(self) -> dict[str, float]:
    """Evaluates the current policy on the held-out problems, on the trainer's JAX sampler or on
    the rollout engines through the schedule's jobs (config.eval.backend)."""
    return self.evaluator.evaluate(
        self.step, self.training.policy_params(), self.training.eval_weights,
        lambda weights, fns: self.scheduler.run_jobs(self, weights, fns),
        self.scheduler.job_parallelism)

  # ---- start, resume, stop -----------------------------------------------------------------------

  def resume(self) -> None:
    """Restores the host state of a resumed run and decides whether it has finished already."""
    p, c = self.parts, self.config
    if p.resumed_host is not None:
      self.checkpoints.restore(p.resumed_host)
      logging.info("resumed at step %d (buffer %d rollouts)", self.step, len(p.data.buffer))
    if c.scheduler.reference_tokens > 0:
      p.generation.sim_state.reference_tokens = float(c.scheduler.reference_tokens)
    grid = self.evaluator.grid
    if p.resumed_host is not None and "eval_grid" in p.resumed_host:
      compute = grid.compute_at_step_end  # saved: async compute moves on after it
    else:  # a fresh run, or a checkpoint from before the eval_grid key
      compute = p.telemetry.metrics.compute_seconds()
      grid.skip_evaluated(compute)  # the evaluated ones
    if self.step > 0:
      self._decide_finished(compute)

  def start(self) -> None:
    """Publishes the first weights and evaluates the initial policy (step 0)."""
    tel = self.parts.telemetry
    self.training.publish()
    if self.step == 0:
      metrics = self.evaluate() if self.evaluator.start() else {}
      if metrics and jax.process_index() == 0:
        self.progress.evaluated(0, metrics)
      row = tel.metrics.first_row(metrics)
    # Started: a stop from now on saves a checkpoint first. Switched before row 0 is written, so
    # a signal sent once row 0 is seen (as a supervisor or test may) always stops gracefully.
    if self.stop is not None:
      self.stop.graceful()
    if self.step == 0:
      tel.writer.write(0, row)

  def summary(self) -> dict[str, Any]:
    out = {"step": self.step,
           **{k: v for k, v in self.evaluator.last.items() if k.startswith("eval/")}}
    if self.stopped and not self.finished:
      out["stopped_by"] = self.stop.requested or "a stop on another trainer process"
    return out

  def stop_now(self) -> None:
    """After a stop signal, at a step's end: that step's checkpoint (unless saved already), so a
    rerun of the same command resumes exactly here."""
    logging.info("stopping at step %d (%s): saving a checkpoint", self.step, self.stop.requested)
    self.checkpoints.save()


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


def run(config, workdir: str, stop: Optional[safety.StopSignals] = None) -> dict[str, Any]:
  """Runs (or resumes) the experiment in `workdir`; returns the final step and eval metrics.

  The run holds WORKDIR/.lock for its life (`safety.WorkdirLock`: a second run there fails at
  once); the config is validated, then resolved once into a frozen copy (`config.resolve`: the
  "auto" choices made) that everything reads and nothing mutates (`config` itself is untouched);
  run_config.json records it, written only once the run is built (the config is valid). A SIGTERM / SIGINT ends it
  after the current step with a checkpoint (the summary then has "stopped_by"); a second one
  exits at once. `stop`: the caller's `safety.StopSignals`, already entered (the launcher's, which
  ends a run still starting up at once: `StopSignals.started` is called after the first step);
  None: the run installs its own.
  """
  os.makedirs(workdir, exist_ok=True)
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      stack.enter_context(safety.WorkdirLock(workdir))
    validation.validate_config(config)  # once: `build` trusts it
    config = resolve_lib.resolve(config)  # "auto" made (run_config.json records it), frozen
    compilation_cache.apply(config.trainer.get("compilation_cache", "auto"), workdir)  # 1st compile
    validation.check_resume(config, workdir)
    if stop is None:
      stop = stack.enter_context(safety.StopSignals())
    parts = build_lib.build(config, workdir, stack)
    if jax.process_index() == 0:  # only a config that built (a rejected rerun leaves the old one)
      write_run_config(config, workdir)
    scheduler = make_scheduler(parts)
    stack.callback(scheduler.close)  # the workers, also when start() fails (eval on the engines)
    pipeline = Pipeline(parts, scheduler, stop)
    pipeline.resume()
    if pipeline.finished:
      logging.info("nothing to do: the run in %s finished at step %d (total_steps %d, "
                   "compute_budget %g)", workdir, pipeline.step, config.total_steps,
                   config.compute_budget)
      return pipeline.summary()
    pipeline.start()
    scheduler.run(pipeline)
    if jax.process_index() == 0:
      m = parts.data.buffer.metrics()
      logging.info("replay buffer: %d rollouts added over the run (resumes included), %d sampled",
                   m["buffer/total_added"], m["buffer/total_sampled"])
    if pipeline.stopped and not pipeline.finished:
      pipeline.stop_now()
  return pipeline.summary()
