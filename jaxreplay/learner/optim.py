"""The optimizer: AdamW with linear warmup then a constant or cosine schedule, and global-norm clipping.

Pure functions of scalars: `make_optimizer(...)` -> `optax.GradientTransformation`.
Weight decay skips RMSNorm weights and biases (paths containing "norm" or "bias").
The optimizer's update at step s (0-based, the number of updates already applied) uses
`make_schedule(...)(s)` as its learning rate.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import jax
import optax

from jaxreplay.infra.sharding import path_str

SCHEDULES = ("constant", "cosine")
NO_DECAY_PATTERN = r"(norm|bias)$"


def make_schedule(learning_rate: float, warmup_steps: int = 0, total_steps: Optional[int] = None,
                  schedule: str = "constant", min_lr_ratio: float = 0.0) -> optax.Schedule:
  """Learning rate per step: linear 0 -> `learning_rate` over `warmup_steps`, then constant or cosine.

  cosine decays from `learning_rate` at step `warmup_steps` to `min_lr_ratio * learning_rate` at
  `total_steps` and stays there. With warmup_steps=0 the first step uses the full learning rate.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
  if learning_rate < 0 or warmup_steps < 0:
    raise ValueError(f"learning_rate={learning_rate} and warmup_steps={warmup_steps} must be >= 0")
  if schedule == "cosine":
    if total_steps is None or total_steps <= warmup_steps:
      raise ValueError(f"cosine schedule needs total_steps > warmup_steps; got "
                       f"total_steps={total_steps}, warmup_steps={warmup_steps}")
    after = optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps, alpha=min_lr_ratio)
  else:
    after = optax.constant_schedule(learning_rate)
  if warmup_steps == 0:
    return after
  # Step s of warmup uses lr * (s + 1) / warmup_steps so that no step has a zero learning rate.
  warmup = optax.linear_schedule(learning_rate / warmup_steps, learning_rate, warmup_steps - 1) \
      if warmup_steps > 1 else optax.constant_schedule(learning_rate)
  return optax.join_schedules([warmup, after], [warmup_steps])


def weight_decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: everything but norms and biases (by path)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: re.search(NO_DECAY_PATTERN, path_str(path)) is None, params)


def make_optimizer(learning_rate: float | optax.Schedule = 1e-6, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, schedule: str = "constant",
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   max_grad_norm: Optional[float] = 1.0, min_lr_ratio: float = 0.0,
                   mu_dtype: Optional[Any] = None,
                   decay_mask: Optional[Callable] = weight_decay_mask) -> optax.GradientTransformation:
  """clip_by_global_norm(max_grad_norm) -> AdamW(schedule); max_grad_norm None or <= 0: no clipping.

  `learning_rate` is a float (combined with warmup/schedule via `make_schedule`) or a ready schedule.
  `mu_dtype` sets the dtype of Adam's first moment (e.g. jnp.bfloat16 to save memory); default: params'.
  `decay_mask`: params -> bool tree of the leaves that get weight decay (default: all but norms and
  biases); None decays every leaf.
  """
  lr: Callable = learning_rate if callable(learning_rate) else make_schedule(
      learning_rate, warmup_steps, total_steps, schedule, min_lr_ratio)
  parts = []
  if max_grad_norm is not None and max_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(max_grad_norm))
  parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                           mask=decay_mask, mu_dtype=mu_dtype))
  return optax.chain(*parts)
