"""The environment a launch on a machine without GPUs needs before JAX starts (no JAX import here).

`cpu_environment(environ, gpus_visible, dry_run_devices)`:
  JAX_PLATFORMS=cpu   when no GPU is visible and no TPU runtime (libtpu) is installed: JAX would
                      otherwise probe its other backends and log their failures ("Unable to
                      initialize backend 'tpu'", and with JAX's CUDA plugin installed (the
                      `gpu-compile` extra, for `--compile_for`) a version probe that needs a
                      driver and prints a traceback, "Unable to load cuPTI"). Compile-only GPU
                      devices (`run.gpu_compile`) still work with it set.
  XLA_FLAGS           --xla_force_host_platform_device_count=T for a CPU `--dry_run` (the plan's
                      mesh needs T = trainer.num_devices devices), unless XLA_FLAGS already asks
                      for T or more.
Both only where the user's own setting does not already cover it, and only before JAX is imported
(afterwards they would not take effect: `jax_started` says so). `host_device_count` reads the
count XLA_FLAGS asks for.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Optional

COUNT_FLAG = "--xla_force_host_platform_device_count"
_COUNT = re.compile(re.escape(COUNT_FLAG) + r"=(\d+)")


def installed(module: str) -> bool:
  """Whether `module` (dotted) can be imported, without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a parent package is missing
    return False


def cuda_plugin_installed() -> bool:
  """JAX's CUDA-13 plugin (the `gpu-compile` and `gpu` extras)."""
  return installed("jax_plugins.xla_cuda13")


def tpu_runtime_installed() -> bool:
  """libtpu (a TPU machine's JAX)."""
  return installed("libtpu")


def jax_started() -> bool:
  """Whether JAX is imported in this process (environment changes would come too late)."""
  return "jax" in sys.modules


def host_device_count(environ: Optional[dict] = None) -> int:
  """XLA's host devices under `environ`'s XLA_FLAGS (the last count given; 1 when none)."""
  env = os.environ if environ is None else environ
  found = _COUNT.findall(env.get("XLA_FLAGS", ""))
  return int(found[-1]) if found else 1


def cpu_environment(environ: Optional[dict] = None, gpus_visible: bool = False,
                    dry_run_devices: int = 0, tpu_installed: Optional[bool] = None) -> dict:
  """Sets the variables of the module docstring in `environ` (default os.environ) where they
  apply; returns {name: value} of those it set. `tpu_installed` replaces the libtpu lookup
  (tests)."""
  env = os.environ if environ is None else environ
  changed = {}
  if gpus_visible:
    return changed
  tpu = tpu_runtime_installed() if tpu_installed is None else tpu_installed
  if not tpu and "JAX_PLATFORMS" not in env:
    changed["JAX_PLATFORMS"] = "cpu"
  if dry_run_devices > 1 and host_device_count(env) < dry_run_devices:
    flags = _COUNT.sub("", env.get("XLA_FLAGS", "")).split()
    changed["XLA_FLAGS"] = " ".join(flags + [f"{COUNT_FLAG}={int(dry_run_devices)}"])
  env.update(changed)
  return changed
