"""The environment a launch on a machine without GPUs needs before JAX starts (no JAX import here).

`cpu_environment(environ, gpus_visible, dry_run_devices)`:
  JAX_PLATFORMS=cpu   when JAX's CUDA plugin is installed (the `gpu-compile` extra, for
                      `--compile_for`) but no GPU is visible: JAX would otherwise initialise the
                      plugin, whose version probe needs a driver and prints a traceback
                      ("Unable to load cuPTI") before falling back to the CPU. Compile-only GPU
                      devices (`run.gpu_compile`) still work with it set.
  XLA_FLAGS           --xla_force_host_platform_device_count=T for a CPU `--dry_run` (the plan's
                      mesh needs T = trainer.num_devices devices), unless XLA_FLAGS already sets a
                      count.
Both only where the variable is not set already, and only before JAX is imported (afterwards they
would not take effect: `jax_started` says so).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Optional

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def installed(module: str) -> bool:
  """Whether `module` (dotted) can be imported, without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a parent package is missing
    return False


def cuda_plugin_installed() -> bool:
  """JAX's CUDA-13 plugin (the `gpu-compile` and `gpu` extras)."""
  return installed("jax_plugins.xla_cuda13")


def jax_started() -> bool:
  """Whether JAX is imported in this process (environment changes would come too late)."""
  return "jax" in sys.modules


def cpu_environment(environ: Optional[dict] = None, gpus_visible: bool = False,
                    dry_run_devices: int = 0, plugin_installed: Optional[bool] = None) -> dict:
  """Sets the variables of the module docstring in `environ` (default os.environ) where they
  apply; returns {name: value} of those it set. `plugin_installed` replaces the plugin lookup
  (tests)."""
  env = os.environ if environ is None else environ
  changed = {}
  if gpus_visible:
    return changed
  plugin = cuda_plugin_installed() if plugin_installed is None else plugin_installed
  if plugin and "JAX_PLATFORMS" not in env:
    changed["JAX_PLATFORMS"] = "cpu"
  flags = env.get("XLA_FLAGS", "")
  if dry_run_devices > 1 and not re.search(rf"{_COUNT_FLAG}=\d+", flags):
    changed["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={int(dry_run_devices)}".strip()
  env.update(changed)
  return changed
