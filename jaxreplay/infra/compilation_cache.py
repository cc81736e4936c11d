"""JAX's persistent compilation cache for a run (config `trainer.compilation_cache`).

An 8B train step compiles for minutes on GPU; without a persistent cache every restart (a resume
after a kill, a preempted job) compiles it again. `apply(value, workdir)` (value: the config's
trainer.compilation_cache) points JAX at a cache
directory before the run's first compile (`pipeline.run` calls it first thing; JAX decides whether
a process uses the cache once, at its first compile):

  auto        WORKDIR/xla_cache when JAX runs on GPU (or TPU); off on CPU, where the tiny runs
              compile in seconds and the tests start many processes
  off         no cache
  a path      that directory (made when missing), on any platform; runs may share it

Entries: computations that took >= MIN_COMPILE_TIME_S to compile (XLA's GPU autotuning results go
along: jax_persistent_cache_enable_xla_caches keeps its default). JAX keys an entry by the
computation, the compiler options, the devices and the jax/jaxlib versions, so a stale entry is
never used; the directory is never pruned here.
"""
from __future__ import annotations

import os
from typing import Optional

from absl import logging
import jax

MODES = ("auto", "off")
SUBDIR = "xla_cache"
MIN_COMPILE_TIME_S = 0.5  # computations compiled faster than this are not written
MIN_ENTRY_SIZE_BYTES = 0  # JAX's default: no size floor (it may raise it for its filesystem)


def resolve(value: str, workdir: str, platform: str) -> Optional[str]:
  """The cache directory `trainer.compilation_cache=value` means for a run in `workdir` on
  `platform` ("cpu", "gpu", ...), or None for no cache."""
  value = str(value).strip()
  if not value:
    raise ValueError("trainer.compilation_cache='': expected 'auto', 'off' or a directory")
  if value == "off":
    return None
  if value == "auto":
    return None if platform == "cpu" else os.path.join(os.path.abspath(workdir), SUBDIR)
  return os.path.abspath(os.path.expanduser(value))


def apply(value: str, workdir: str, min_compile_time_s: float = MIN_COMPILE_TIME_S
          ) -> Optional[str]:
  """Sets JAX's persistent compilation cache for this process from `value` (config
  trainer.compilation_cache: "auto", "off" or a directory; see the module docstring); returns the
  directory, or None when off. Must run before the process's first compile to take effect."""
  path = resolve(value, workdir, jax.default_backend())
  if path is None:
    return None
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
  logging.info("persistent compilation cache: %s (trainer.compilation_cache=%r)", path, value)
  return path
