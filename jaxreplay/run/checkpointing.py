"""Checkpoint / resume and HF export of a run, as hooks: `RunCheckpoint`.

A checkpoint is the train state (orbax, `parts.checkpointer`) plus the host state: one dict of
plain values under fixed keys, which older checkpoints share (a key added later is optional on
restore, so they still resume):

  "buffer"             the replay buffer (`ReplayBuffer.state_dict`)
  (the intake's keys)  the prompt cursor, group ids, in-flight requests (`Intake.state_dict`)
  "accountant"         compute accounting
  "sim"                the simulated clock (`SimState` fields)
  "published_version"  the newest published weights' version
  "eval_calls"         generate calls of the evaluations (the eval noise stream)
  "counters"           the metrics' counters that continue over resumes
  "regime", "reuse"    the regime diagnostics and the reuse controller (None when off)
  "batch_reuse"        the fresh batch held for several updates, the position in it and the
                       gradient gate's window (`data.batch_reuse`; None when not reusing)
  "nonfinite"          the non-finite guard's {"consecutive", "total"}
  "eval_grid"          the eval grid's {"next", "compute_at_step_end"}
  "scheduler"          the schedule's state when it has one (`Schedule.state_dict`)
  "lora"               LoRA: the base's path and content hash (`FrozenBase.identity`)

`save` and `export_hf` are the pipeline's checkpoint and export hooks (`hooks.TrainerHooks`):
with export_hf_every = 0 the export goes with each checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from jaxreplay.models import hf_io
from jaxreplay.infra import safety
from jaxreplay.infra import sharding
from jaxreplay.models import lora as lora_lib


class RunCheckpoint:
  """The host state of a run and its checkpoint / export hooks.

  Args:
    parts: the run's `build.Parts`. training: its `training.Training` (the step, the published
      weights; the train state in parts.learner.state). evaluator: its `evaluator.Evaluator`.
    guard: its `safety.NonFiniteGuard`. scheduler: its schedule (`schedules.Schedule`).
  """

  def __init__(self, parts, training, evaluator, guard: safety.NonFiniteGuard, scheduler):
    self.parts, self.config = parts, parts.config
    self.training, self.evaluator, self.guard, self.scheduler = (training, evaluator, guard,
                                                                 scheduler)

  def host_state(self) -> dict[str, Any]:
    """The host state of this step (module docstring)."""
    data, tel, gen = self.parts.data, self.parts.telemetry, self.parts.generation
    with data.intake.snapshot_lock:  # the async workers' deliveries wait for this snapshot
      buffer_state, intake_state = data.buffer.state_dict(), data.intake.state_dict()
    host = {"buffer": buffer_state, **intake_state,
            "accountant": tel.accountant.state_dict(), "sim": dataclasses.asdict(gen.sim_state),
            "published_version": self.training.weights.version,
            "eval_calls": self.evaluator.calls,
            "counters": tel.metrics.counters(),
            "regime": tel.regime.state_dict() if tel.regime is not None else None,
            "reuse": data.reuse.state_dict() if data.reuse is not None else None,
            "batch_reuse": data.batch_reuse.state_dict() if data.batch_reuse.active else None,
            "nonfinite": {"consecutive": self.guard.consecutive, "total": self.guard.total},
            "eval_grid": self.evaluator.grid.state_dict()}
    scheduler_state = self.scheduler.state_dict()
    if scheduler_state is not None:
      host["scheduler"] = scheduler_state
    lora = self.parts.learner.lora
    if lora is not None:  # the base the adapters belong to: path and content hash (not the base)
      host["lora"] = lora.identity()
    return host

  def restore(self, host: dict[str, Any]) -> None:
    """Restores `host_state()` (also one of an older checkpoint, without the later keys)."""
    data, tel, gen = self.parts.data, self.parts.telemetry, self.parts.generation
    data.buffer.load_state_dict(host["buffer"])
    data.intake.load_state_dict(host)
    tel.accountant.load_state_dict(host["accountant"])
    for k, v in host["sim"].items():
      setattr(gen.sim_state, k, v)
    if "eval_calls" in host:  # checkpoints written before these keys existed resume without them
      self.evaluator.calls = int(host["eval_calls"])
    if "counters" in host:
      tel.metrics.restore_counters(host["counters"])
    if host.get("regime") and tel.regime is not None:
      tel.regime.load_state_dict(host["regime"])
    if host.get("reuse") and data.reuse is not None:
      data.reuse.load_state_dict(host["reuse"])
    if host.get("batch_reuse") and data.batch_reuse.active:
      data.batch_reuse.load_state_dict(host["batch_reuse"])
    if "nonfinite" in host:
      self.guard.consecutive = int(host["nonfinite"]["consecutive"])
      self.guard.total = int(host["nonfinite"]["total"])
    if "eval_grid" in host:
      self.evaluator.grid.load_state_dict(host["eval_grid"])
    if "scheduler" in host:
      self.scheduler.load_state_dict(host["scheduler"])

  def save(self, info=None) -> None:
    """The checkpoint hook: starts an asynchronous save of this step's train and host state (the
    host state is encoded now and the device arrays copied to host before `save` returns, so the
    next, donating step may run at once); with export_hf_every=0 the HF export goes with it. A
    step saved already is not saved again."""
    del info
    step, checkpointer = self.training.step, self.parts.checkpointer
    if step in checkpointer.all_steps():
      return
    self.training.check_finite("checkpoint")
    checkpointer.save(step, self.parts.learner.state, self.host_state())
    if not self.config.export_hf_every:
      self.export_hf()

  def export_hf(self, info=None) -> None:
    """The export hook: WORKDIR/hf, the policy as an HF model; with LoRA the merged model, and
    the adapters in PEFT's format in WORKDIR/hf_adapter (`lora.save_peft`)."""
    del info
    self.training.check_finite("HF export")
    learner, workdir = self.parts.learner, self.parts.workdir
    params = sharding.host_local(learner.state.params)  # a collective when multi-process
    if jax.process_index() != 0:
      return
    lora = learner.lora
    if lora is not None:
      lora_lib.save_peft(os.path.join(workdir, "hf_adapter"), learner.model_cfg, lora.spec, params,
                         base_model_name_or_path=lora.path)
      params = lora_lib.merge(learner.model_cfg, sharding.host_local(lora.params), params,
                              lora.spec)
    hf_io.save_hf(learner.model_cfg, params, os.path.join(workdir, "hf"),
                   tokenizer_dir=self.parts.data.tokenizer_dir)
