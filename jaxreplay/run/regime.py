"""Regime diagnostics of a run (host side): is it sample-limited or update-limited, how stale is it.

Every `log.diagnostics_every` steps (0 = off) `RegimeDiagnostics` measures, before the update and on
the batch it will use (`learner.diagnostics`: one extra forward + backward, no update), and after
it on a fixed probe (a forward pass over its rollouts before and after the update), and returns
metrics-row keys:

  diag/noise_scale           B_simple = tr(Sigma) / |G|^2 in rollouts, a ratio of exponential moving
                             averages of the two unbiased estimates (McCandlish et al. 2018; for
                             micro-batches of unequal sizes, as packed rows are, and token_mean's
                             per-token noise: `learner.diagnostics`); NaN until the smoothed |G|^2
                             is positive
  diag/noise_scale_raw       the same from this step's estimates alone (noisy, may be negative)
  diag/batch_over_noise_scale  B / diag/noise_scale: << 1 sample-limited (fresh rollouts buy the
                             progress; replay cannot pay), >~ 1 update-limited (replay can pay)
  diag/grad_sq, diag/grad_var_trace   this step's |G|^2 and tr(Sigma) estimates
  diag/update_kl             KL(pi_t || pi_t+1) over the vocabulary, mean over the probe's completion
                             tokens: how far one update moved the policy
  diag/behaviour_kl_k3, diag/ratio_p05 / p50 / p95, diag/ratio_outside_clip, diag/is_ess
                             off-policyness of the batch (`learner.diagnostics.off_policy_stats`)
The probe is the first `log.diagnostics_probe` rollouts of the run's first measured batch; it and
the moving averages are checkpointed (`state_dict`), so a resumed run continues them.

Who pays for them (`log.charge_diagnostics`, `charges_diagnostics`): a design that reads the
diagnostics to decide (buffer.reuse_control "adaptive": `data.reuse.READS_DIAGNOSTICS`) is charged
their passes ("auto", the default; "on" charges every run, "off" none); for every other design they
are measurement, not part of the design, and cost nothing. Charged, each measurement adds to the
run's compute (`compute_seconds`, and the counter compute/diagnostics_device_seconds): under the
simulated / sync schedules its passes priced like training, (B + 2 P) / B * train_seconds_per_step
device-seconds for the forward + backward over the batch's B rollouts and the probe's two forward
passes over its P rollouts (`accounting.diagnostics_device_seconds`; a forward priced as a forward
+ backward, an upper bound: measured on CPU, the diagnostics took 0.6-0.8 of a train step); under
the async schedule their measured seconds on the T trainer devices. The charge is not put on the
simulated clock (the schedule's events are those of the uncharged run: the paced designs' trainer
waits for generation, when the passes would run) and not into sim/* (the modelled generation and
training).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from absl import logging
import jax
import numpy as np

from jaxreplay.data import reuse
from jaxreplay.learner import diagnostics
from jaxreplay.learner.batch import Rollout


def charges_diagnostics(config) -> bool:
  """Whether the run's compute includes its regime diagnostics (log.charge_diagnostics: "auto" =
  the design reads them, buffer.reuse_control in `data.reuse.READS_DIAGNOSTICS`; "on"; "off")."""
  mode = str(config.log.get("charge_diagnostics", "auto"))
  if mode == "auto":
    return config.buffer.get("reuse_control", "off") in reuse.READS_DIAGNOSTICS
  return mode == "on"


class NoiseScale:
  """Exponential moving averages of |G|^2 and tr(Sigma); their ratio is the smoothed B_simple.

  decay: the weight of the past per update (0.9: ~10 measurements). The averages are bias-corrected
  (as Adam's moments) so the first measurements are not pulled towards 0.
  """

  def __init__(self, decay: float = 0.9):
    if not 0.0 <= decay < 1.0:
      raise ValueError(f"decay={decay} must be in [0, 1)")
    self.decay = float(decay)
    self.g2 = self.trace = 0.0
    self.count = 0

  def update(self, g2: float, trace: float) -> float:
    """Adds one measurement; returns the smoothed B_simple (NaN while the smoothed |G|^2 <= 0). A
    non-finite measurement (a batch whose valid tokens all fall in one micro-batch) is left out."""
    if not (math.isfinite(g2) and math.isfinite(trace)):
      return self.value
    d = self.decay
    self.g2 = d * self.g2 + (1.0 - d) * g2
    self.trace = d * self.trace + (1.0 - d) * trace
    self.count += 1
    return self.value

  @property
  def value(self) -> float:
    if self.count == 0:
      return float("nan")
    correction = 1.0 - self.decay ** self.count
    g2, trace = self.g2 / correction, self.trace / correction
    return trace / g2 if g2 > 0 else float("nan")

  def state_dict(self) -> dict[str, float]:
    return {"g2": self.g2, "trace": self.trace, "count": self.count}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.g2, self.trace = float(state["g2"]), float(state["trace"])
    self.count = int(state["count"])


def splits_for(rows: int, multiple: int, preferred: int = 4) -> int:
  """The largest k <= preferred (>= 2) with rows % (k * multiple) == 0, or 0 when none."""
  for k in range(int(preferred), 1, -1):
    if rows % (k * multiple) == 0:
      return k
  return 0


class RegimeDiagnostics:
  """The run's regime diagnostics (see the module docstring).

  Args:
    model_cfg, loss_fn, mesh, param_shardings: as the train step's.
    every: steps between measurements (0 = off).
    splits: preferred micro-batches of the noise estimate (4; fewer when the batch does not divide).
    probe_rollouts: rollouts in the update-KL probe (0 = no update KL).
    decay: the noise scale's moving-average decay.
    collate: `fn(rollouts) -> Batch` of the probe (the pipeline's collate settings).
    chunk_size, logprob_remat, logprob_processing: the train step's log-prob settings.
    lora: the train step's `adapters.FrozenBase` (LoRA: params are the adapters), or None.
  """

  def __init__(self, model_cfg, loss_fn, mesh, param_shardings, every: int, splits: int = 4,
               probe_rollouts: int = 8, decay: float = 0.9, collate=None, chunk_size: int = 512,
               logprob_remat: str = "auto", logprob_processing=None, lora=None):
    self.every, self.preferred_splits = int(every), int(splits)
    self.probe_rollouts = int(probe_rollouts)
    self.noise = NoiseScale(decay)
    self._collate = collate
    self._make = lambda k: diagnostics.make_diagnostics_fn(
        model_cfg, loss_fn, mesh, param_shardings, splits=k, chunk_size=chunk_size,
        logprob_remat=logprob_remat, logprob_processing=logprob_processing, lora=lora)
    self._fns: dict[int, Any] = {}
    # The probe is a host batch given to every process alike; with several trainer processes it
    # would need a global array of its own: the update KL is measured in one-process runs only.
    self._probe_fn = (diagnostics.make_probe_fn(model_cfg, mesh, param_shardings, lora=lora)
                      if self.probe_rollouts and jax.process_count() == 1 else None)
    self._multiple = max(1, int(np.prod([mesh.shape.get(a, 1) for a in ("data", "fsdp")])))
    self.probe: Optional[list[Rollout]] = None
    self._probe_batch = None
    self._before = None
    self._warned = False
    self.pass_rollouts = 0.0  # the last measurement's rollouts through a pass (B + 2 P)

  def due(self, step: int) -> bool:
    """Whether the update from `step` to step + 1 is measured."""
    return self.every > 0 and step % self.every == 0

  def before_update(self, params, ref_params, batch, rollouts) -> dict[str, float]:
    """Measures the batch at the current params (before the donating train step runs)."""
    rows = int(batch.tokens.shape[0])
    k = splits_for(rows, self._multiple, self.preferred_splits)
    if not k:
      if not self._warned:
        logging.warning("regime diagnostics off: a batch of %d rows does not split into >= 2 "
                        "micro-batches of a multiple of data * fsdp = %d rows", rows, self._multiple)
        self._warned = True
      return {}
    if k not in self._fns:
      self._fns[k] = self._make(k)
    raw = {key: float(v) for key, v in jax.device_get(self._fns[k](params, ref_params,
                                                                   batch)).items()}
    g2, trace = diagnostics.noise_estimates(raw["grad_sq_small"], raw["grad_sq_big"],
                                            raw["micro_rollouts"], raw["batch_rollouts"])
    smoothed = self.noise.update(g2, trace)
    out = {"diag/noise_scale": smoothed,
           "diag/noise_scale_raw": trace / g2 if g2 != 0 else float("nan"),
           "diag/batch_over_noise_scale": (raw["batch_rollouts"] / smoothed
                                           if smoothed > 0 else float("nan")),
           "diag/grad_sq": g2, "diag/grad_var_trace": trace}
    for key in ("behaviour_kl_k3", "ratio_p05", "ratio_p50", "ratio_p95", "ratio_outside_clip",
                "is_ess"):
      out[f"diag/{key}"] = raw[key]
    self.pass_rollouts = float(len(rollouts))
    if self._probe_fn is not None:
      if self.probe is None:
        self.probe = list(rollouts[:self.probe_rollouts])
      if self._probe_batch is None:
        self._probe_batch = self._collate(self.probe)
      self._before = self._probe_fn(params, self._probe_batch)
      self.pass_rollouts += 2.0 * len(self.probe)  # this forward and the one after the update
    return out

  def after_update(self, params) -> dict[str, float]:
    """The update KL on the probe (after `before_update` of the same step)."""
    if self._before is None:
      return {}
    after = self._probe_fn(params, self._probe_batch)
    kl = float(diagnostics.policy_kl(self._before, after, self._probe_batch.completion_mask))
    self._before = None
    return {"diag/update_kl": kl if math.isfinite(kl) else float("nan")}

  def state_dict(self) -> dict[str, Any]:
    """The moving averages and the probe's rollouts (the host state of a checkpoint)."""
    return {"noise": self.noise.state_dict(),
            "probe": [dataclasses.asdict(r) for r in (self.probe or [])]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.noise.load_state_dict(state["noise"])
    probe = state.get("probe") or []
    self.probe = [Rollout(**r) for r in probe] or None
    self._probe_batch = None
