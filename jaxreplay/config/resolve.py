"""The run's config resolved once, after validation: every "auto" choice made, then frozen.

`resolve(config) -> FrozenConfigDict` copies a validated config, makes its "auto" choices

  rollout.backend  "auto" -> the installed backend `rollout.backend_table.resolve` picks (vLLM
                   when installed, else the JAX sampler)
  eval.backend     "auto" -> "engines" or "trainer" (`rollout.backend_table.resolve_eval`)

and freezes it: the result and each of its sections (`c.model`, `c.trainer`, `c.rollout`,
`c.buffer`, ...: what each layer reads) are immutable, an assignment raises. `run.pipeline.run`
resolves once and hands the result to everything it builds (run_config.json records it);
nothing mutates it afterwards. The caller's config is left as it was.
"""
from __future__ import annotations

from absl import logging
import ml_collections

from jaxreplay.rollout import backend_table


def is_resolved(config) -> bool:
  """Whether `config` is already a `resolve` result (frozen, no "auto" left to make)."""
  return (isinstance(config, ml_collections.FrozenConfigDict)
          and config.rollout.backend != backend_table.AUTO
          and config.eval.backend != backend_table.AUTO)


def resolve(config) -> ml_collections.FrozenConfigDict:
  """`config` (a ConfigDict the validation accepted) with its "auto" choices made, frozen (see the
  module docstring). A resolved config is returned as it is."""
  if is_resolved(config):
    return config
  if isinstance(config, ml_collections.FrozenConfigDict):
    c = config.as_configdict()
  else:
    c = config.copy_and_resolve_references()
  c.rollout.backend = backend_table.resolve(c.rollout.backend)
  eval_backend = backend_table.resolve_eval(c.eval.backend, c.rollout.backend)
  if eval_backend != c.eval.backend:
    logging.debug("eval.backend=%s -> %s", c.eval.backend, eval_backend)  # the banner says it
    c.eval.backend = eval_backend
  return ml_collections.FrozenConfigDict(c)
