"""Compute accounting: measured mu, W/T, gamma, cumulative device-seconds and model FLOPs.

Definitions (PAPER.md, "Compute accounting"):
  mu    = cost of generating the rollouts of one update / cost of training on them. Both sides
          process the same sequences (prompt + completion tokens), so mu is measured per token:
          (generation device-seconds / generation tokens) / (training device-seconds / training
          tokens). This holds with replay too, where an update reuses rollouts.
  gamma = (1 + W/T) / (1 + mu): compute per update with a buffer over without one.
The figure of merit is accuracy against cumulative compute ("compute_seconds": generation +
training device-seconds; "compute/flops": model FLOPs), not against steps.
"""
from __future__ import annotations

import threading
from typing import Any, Optional


def gamma(num_workers: float, num_trainer_devices: float, mu: float) -> float:
  """(1 + W/T) / (1 + mu). The paper: mu = 5.28, (W, T) = (5, 3) -> 0.4246 ("0.43")."""
  if num_trainer_devices <= 0:
    raise ValueError(f"num_trainer_devices={num_trainer_devices} must be > 0")
  if mu < 0:
    raise ValueError(f"mu={mu} must be >= 0")
  return (1.0 + num_workers / num_trainer_devices) / (1.0 + mu)


def sync_gamma(batch_size: int, rollouts_per_step: int, mu: float) -> float:
  """(B + mu R) / ((1 + mu) B): a sync step's compute over that of the on-policy N = B = R one."""
  return (batch_size + mu * rollouts_per_step) / ((1.0 + mu) * batch_size)


def diagnostics_device_seconds(pass_rollouts: float, batch_size: int,
                               train_seconds_per_step: float) -> float:
  """Virtual device-seconds charged for regime diagnostics whose passes covered `pass_rollouts`
  rollouts (B for the batch's forward + backward, 2 P for the probe's two forwards,
  `run.regime`): each priced like a train step's share, pass_rollouts / B *
  train_seconds_per_step."""
  if pass_rollouts < 0 or batch_size < 1 or train_seconds_per_step < 0:
    raise ValueError(f"pass_rollouts={pass_rollouts}, batch_size={batch_size}, "
                     f"train_seconds_per_step={train_seconds_per_step}: need >= 0, >= 1, >= 0")
  return float(pass_rollouts) / float(batch_size) * float(train_seconds_per_step)


class ComputeAccountant:
  """Accumulates measured generation and training cost; thread-safe (workers report from threads).

  Args:
    num_workers: W, inference devices.
    num_trainer_devices: T, trainer devices.
    model_cfg: a `ModelConfig`; when given, FLOPs are counted with `model_cfg.flops_per_token`:
      forward (2 x params per token + attention) for generation, 3 x forward (forward + backward,
      ~6 x params) for training. Model FLOPs, so rematerialisation is not counted.
    seq_len: default sequence length for the attention term of flops_per_token.

  Callers report device-seconds: wall seconds x devices busy (a trainer step of 0.5 s on T = 4
  devices is 2.0 device-seconds), and tokens = real (unpadded) prompt + completion tokens.
  """

  def __init__(self, num_workers: int, num_trainer_devices: int, model_cfg: Any = None,
               seq_len: int = 1024):
    if num_workers < 0 or num_trainer_devices <= 0:
      raise ValueError(f"need num_workers >= 0 and num_trainer_devices > 0, got W={num_workers}, "
                       f"T={num_trainer_devices}")
    self.num_workers, self.num_trainer_devices = num_workers, num_trainer_devices
    self.model_cfg, self.seq_len = model_cfg, seq_len
    self._lock = threading.Lock()
    self._s = dict(generation_seconds=0.0, training_seconds=0.0, generation_tokens=0,
                   training_tokens=0, generation_flops=0.0, training_flops=0.0, updates=0,
                   diagnostics_seconds=0.0)

  def _flops(self, tokens: int, seq_len: Optional[int], factor: float) -> float:
    if self.model_cfg is None:
      return 0.0
    return factor * self.model_cfg.flops_per_token(seq_len or self.seq_len) * tokens

  def add_generation(self, device_seconds: float, tokens: int, seq_len: Optional[int] = None):
    """Records one generation call: `device_seconds` spent producing sequences of `tokens` total
    (prompt + completion) tokens; `seq_len` (mean sequence length) feeds the attention FLOPs."""
    if device_seconds < 0 or tokens < 0:
      raise ValueError(f"negative cost: device_seconds={device_seconds}, tokens={tokens}")
    flops = self._flops(tokens, seq_len, 1.0)
    with self._lock:
      self._s["generation_seconds"] += float(device_seconds)
      self._s["generation_tokens"] += int(tokens)
      self._s["generation_flops"] += flops

  def add_training(self, device_seconds: float, tokens: int, seq_len: Optional[int] = None,
                   updates: int = 1):
    """Records `updates` optimizer updates that took `device_seconds` over `tokens` tokens."""
    if device_seconds < 0 or tokens < 0 or updates < 0:
      raise ValueError(f"negative cost: device_seconds={device_seconds}, tokens={tokens}, "
                       f"updates={updates}")
    flops = self._flops(tokens, seq_len, 3.0)
    with self._lock:
      self._s["training_seconds"] += float(device_seconds)
      self._s["training_tokens"] += int(tokens)
      self._s["training_flops"] += flops
      self._s["updates"] += int(updates)

  def add_diagnostics(self, device_seconds: float):
    """Records charged regime diagnostics (`run.regime.charges_diagnostics`): measured
    device-seconds, part of compute_seconds (compute/diagnostics_device_seconds)."""
    if device_seconds < 0:
      raise ValueError(f"negative cost: device_seconds={device_seconds}")
    with self._lock:
      self._s["diagnostics_seconds"] += float(device_seconds)

  def mu(self) -> float:
    """Measured mu (per token; see module docstring); nan until both sides have data."""
    with self._lock:
      s = dict(self._s)
    return _mu(s)

  def metrics(self) -> dict[str, float]:
    """The per-step log: measured mu and gamma (compute/measured_mu, compute/measured_gamma), W/T,
    cumulative measured device-seconds, FLOPs, tokens and updates."""
    with self._lock:
      s = dict(self._s)
    mu = _mu(s)
    w_over_t = self.num_workers / self.num_trainer_devices
    updates = s["updates"]
    charged = {"compute/diagnostics_device_seconds": s["diagnostics_seconds"]} if s[
        "diagnostics_seconds"] else {}
    return {**charged,
        "compute/measured_mu": mu,
        "compute/w_over_t": w_over_t,
        "compute/measured_gamma": (gamma(self.num_workers, self.num_trainer_devices, mu)
                                   if mu == mu else mu),
        "compute_seconds": (s["generation_seconds"] + s["training_seconds"] +
                            s["diagnostics_seconds"]),
        "compute/generation_seconds": s["generation_seconds"],
        "compute/training_seconds": s["training_seconds"],
        "compute/flops": s["generation_flops"] + s["training_flops"],
        "compute/generation_flops": s["generation_flops"],
        "compute/training_flops": s["training_flops"],
        "compute/generation_tokens": float(s["generation_tokens"]),
        "compute/training_tokens": float(s["training_tokens"]),
        "compute/updates": float(updates),
        "compute/training_seconds_per_update": (s["training_seconds"] / updates if updates
                                                else float("nan")),
    }

  def state_dict(self) -> dict[str, float]:
    """Cumulative totals, to checkpoint with the run (the compute axis continues on resume)."""
    with self._lock:
      return dict(self._s)

  OPTIONAL_STATE = {"diagnostics_seconds": 0.0}  # added by issue 37: older checkpoints lack it

  def load_state_dict(self, state: dict[str, float]) -> None:
    state = {**self.OPTIONAL_STATE, **state}
    missing = set(self._s) - set(state)
    if missing:
      raise ValueError(f"ComputeAccountant state lacks {sorted(missing)}")
    with self._lock:
      for k in self._s:
        self._s[k] = type(self._s[k])(state[k])


def _mu(s: dict) -> float:
  if not (s["generation_tokens"] and s["training_tokens"] and s["training_seconds"] > 0):
    return float("nan")
  gen = s["generation_seconds"] / s["generation_tokens"]
  train = s["training_seconds"] / s["training_tokens"]
  return gen / train
