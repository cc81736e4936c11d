"""Optional dependencies in tests: under CI=true a missing one is a failure, never a skip."""
import importlib
import os

import pytest


def require(module_name: str):
  """Imports `module_name`; fails under CI=true when it is missing, skips otherwise."""
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    if os.environ.get("CI", "").lower() == "true":
      pytest.fail(f"optional dependency {module_name!r} is missing under CI=true: {e}")
    pytest.skip(f"{module_name} not installed: {e}")
