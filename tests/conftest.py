"""Shared test set-up: 8 emulated CPU devices, and optional-dependency handling.

Under CI=true a missing optional dependency (torch, transformers, vllm) is a failure, never a skip.
"""
import importlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def require(module_name: str):
  """Imports `module_name`; fails under CI=true when it is missing, skips otherwise."""
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    if os.environ.get("CI", "").lower() == "true":
      pytest.fail(f"optional dependency {module_name!r} is missing under CI=true: {e}")
    pytest.skip(f"{module_name} not installed: {e}")
