"""Rules over single config keys, as tables, checked by `validation.validate_config`:

  AT_LEAST    key -> (minimum, what it counts): the counts and sizes a run divides by or needs at
              least one of (`buffer.batch_size=0` used to end in a ZeroDivisionError deep in a run)
  POSITIVE    key -> what it measures: real numbers that must be > 0
  ELEMENTS    tuple key -> (element type, minimum or None): the command line parses
              `--config.trainer.buckets=abc` as ("abc",), so the elements are checked here
  NO_EFFECT   key -> (the condition under which the run ignores it, why, the fix): a key set away
              from its default (`defaults.base_config()`) while another key switches it off is an
              error, never a silent no-op (`lora_targets` with `lora_rank=0` trained every weight)

The options of the algorithms follow the same rule where they are defined
(`learner.algorithms.make_options`: an option of an algorithm other than `trainer.loss` set away
from its default is an error, reported by `validation.trainer_errors`). Each error names the key,
its value and the fix.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Optional

from jaxreplay.config import defaults
from jaxreplay.config import schedule_table

AT_LEAST: dict[str, tuple[int, str]] = {
    "total_steps": (1, "gradient steps"),
    "model.max_len": (2, "tokens of prompt + completion"),
    "rollout.num_workers": (1, "rollout workers"),
    "rollout.group_size": (1, "completions per prompt"),
    "rollout.prompts_per_request": (1, "prompts per request"),
    "rollout.max_tokens": (1, "completion tokens"),
    "rollout.sampler_batch_size": (1, "sequences per JAX-sampler call"),
    "buffer.size": (1, "rollouts the buffer holds"),
    "buffer.batch_size": (1, "rollouts per gradient step"),
    "trainer.num_devices": (1, "trainer devices"),
    "trainer.num_microbatches": (1, "micro-batches per step"),
    "trainer.logprob_chunk": (1, "tokens per log-prob chunk"),
    "checkpoint.every": (0, "steps between checkpoints (0 = only at the end)"),
    "checkpoint.keep": (1, "checkpoints kept"),
    "eval.every": (0, "steps between evaluations (0 = only at the end)"),
    "eval.num_problems": (0, "held-out problems (0 = no evaluation)"),
    "eval.n_samples": (0, "samples per problem (0 = pass@1 only)"),
    "log.mismatch_every": (0, "steps between log-prob comparisons"),
    "sft.steps": (1, "warm-start steps"),
    "sft.batch": (1, "warm-start examples per step"),
}

POSITIVE: dict[str, str] = {
    "task.reward_timeout_s": "seconds one reward call may take",
    "rollout.vllm_kv_cache_gib": "GiB of a CPU engine's KV cache",
    "scheduler.mu": "generation / training cost per update",
    "scheduler.train_seconds_per_step": "virtual seconds of one train step",
}

ELEMENTS: dict[str, tuple[type, Optional[float]]] = {
    "trainer.buckets": (int, 1),
    "trainer.mesh_shape": (int, None),
    "task.num_digits": (int, 1),
    "eval.ks": (int, 1),
    "eval.compute_grid": (float, 0.0),
    "eval.passk_grid": (float, 0.0),
    "eval.refine_levels": (float, 0.0),
    "model.lora_targets": (str, None),
    "sft.slip_range": (float, 0.0),
}


class NoEffect(NamedTuple):
  """`when(c)`: the run ignores the key; `why`: because of which key; `fix`: what to do."""
  when: Callable[[Any], bool]
  why: str
  fix: str


_LORA_OFF = NoEffect(lambda c: c.model.lora_rank == 0,
                     "model.lora_rank=0 (LoRA off: every weight is trained)",
                     "set model.lora_rank > 0 (e.g. 16) to train adapters, or leave it at its "
                     "default")
_ADAPTIVE_ONLY = NoEffect(lambda c: c.buffer.reuse_control != "adaptive",
                          "buffer.reuse_control is not 'adaptive'",
                          "set buffer.reuse_control='adaptive', or leave it at its default")
_NO_RAY = NoEffect(lambda c: c.rollout.placement != "ray", "rollout.placement is not 'ray'",
                   "set rollout.placement='ray', or leave it at its default")
_NO_WANDB = NoEffect(lambda c: not c.log.wandb_project, "log.wandb_project is '' (W&B off)",
                     "set log.wandb_project, or leave it at its default")

NO_EFFECT: dict[str, NoEffect] = {
    **{f"model.{k}": _LORA_OFF
       for k in ("lora_alpha", "lora_targets", "lora_rslora", "lora_dtype")},
    "buffer.fresh_tau": NoEffect(lambda c: c.buffer.priority != "fresh",
                                 "buffer.priority is not 'fresh'",
                                 "set buffer.priority='fresh', or leave it at its default"),
    "buffer.reuse_target": NoEffect(lambda c: c.buffer.reuse_control == "off",
                                    "buffer.reuse_control='off'", "set buffer.reuse_control="
                                    "'fixed' or 'adaptive', or leave it at its default"),
    **{f"buffer.{k}": _ADAPTIVE_ONLY for k in ("reuse_min", "reuse_max", "reuse_kl_max",
                                               "reuse_ess_min", "reuse_update_kl_max")},
    "buffer.on_policy_order": NoEffect(lambda c: not c.buffer.on_policy,
                                       "buffer.on_policy=False (a replay buffer, not a queue)",
                                       "set buffer.on_policy=True, or leave it at its default"),
    **{f"eval.{k}": NoEffect(lambda c: not c.eval.refine_levels or not c.eval.compute_grid,
                             "eval.refine_levels or eval.compute_grid is empty (no refinement)",
                             "set eval.refine_levels and eval.compute_grid, or leave it at its "
                             "default")
       for k in ("refine_band", "refine_splits", "refine_lookahead")},
    "trainer.m2po_threshold": NoEffect(lambda c: c.trainer.off_policy != "m2po",
                                       "trainer.off_policy is not 'm2po'",
                                       "set trainer.off_policy='m2po', or leave it at its default"),
    "trainer.off_policy_cap": NoEffect(lambda c: c.trainer.off_policy == "none",
                                       "trainer.off_policy='none' (no correction)",
                                       "choose a trainer.off_policy correction, or leave it at its "
                                       "default"),
    "trainer.kl_clamp": NoEffect(lambda c: c.trainer.kl_coef == 0.0,
                                 "trainer.kl_coef=0 (no KL penalty)",
                                 "set trainer.kl_coef > 0, or leave it at its default"),
    "scheduler.rollouts_per_step": NoEffect(
        lambda c: not getattr(schedule_table.SCHEDULES.get(c.scheduler.kind), "rollouts_per_step",
                              True),
        "only scheduler.kind='sync' generates rollouts_per_step per step",
        "set scheduler.kind='sync', or leave it at its default"),
    **{f"rollout.{k}": _NO_RAY for k in ("ray_address", "ray_num_cpus_per_worker",
                                         "ray_num_gpus_per_worker", "ray_placement_strategy",
                                         "ray_max_restarts")},
    **{f"log.{k}": _NO_WANDB for k in ("wandb_entity", "wandb_mode", "wandb_run_name")},
}


def get(c, key: str) -> Any:
  """The value of a dotted key of config `c` (KeyError when it has none)."""
  value = c
  for part in key.split("."):
    value = value[part]
  return value


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _differs(a, b) -> bool:
  if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
    return tuple(a) != tuple(b) if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) \
        else True
  return a != b


def count_errors(c) -> list[str]:
  """AT_LEAST and POSITIVE: counts below their minimum, real numbers that are not > 0."""
  errors = []
  for key, (minimum, what) in AT_LEAST.items():
    value = get(c, key)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
      errors.append(f"{key}={value!r} must be an integer >= {minimum} ({what}); set "
                    f"--config.{key}={max(minimum, get(defaults.base_config(), key))}")
  for key, what in POSITIVE.items():
    value = get(c, key)
    if not _is_number(value) or not value > 0:
      errors.append(f"{key}={value!r} must be > 0 ({what}); e.g. "
                    f"--config.{key}={get(defaults.base_config(), key)}")
  return errors


def element_errors(c) -> list[str]:
  """ELEMENTS: each element of a tuple key of the right type (and >= its minimum)."""
  errors = []
  for key, (kind, minimum) in ELEMENTS.items():
    value = get(c, key)
    items = value if isinstance(value, (tuple, list)) else (value,)
    ok = (lambda x: isinstance(x, str)) if kind is str else (
        (lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)) if kind is int
        else _is_number)
    bad = [x for x in items if not ok(x) or (minimum is not None and x < minimum)]
    if bad:
      example = get(defaults.base_config(), key) or (1.0, 2.0)
      need = {int: "integers", float: "numbers", str: "names"}[kind]
      bound = f" >= {minimum}" if minimum is not None and kind is not str else ""
      errors.append(f"{key}={tuple(items)!r}: expected a tuple of {need}{bound} (bad: "
                    f"{', '.join(map(repr, bad))}); e.g. \"--config.{key}={tuple(example)}\"")
  return errors


def no_effect_errors(c) -> list[str]:
  """NO_EFFECT: keys set away from their default while another key makes the run ignore them."""
  base = defaults.base_config()
  errors = []
  for key, rule in NO_EFFECT.items():
    value = get(c, key)
    if _differs(value, get(base, key)) and rule.when(c):
      errors.append(f"{key}={value!r} has no effect: {rule.why}; {rule.fix}")
  return errors

