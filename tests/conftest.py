"""Shared test set-up: 8 emulated CPU devices, and optional-dependency handling.

Under CI=true a missing optional dependency (torch, transformers, vllm) is a failure, never a skip.
"""
import importlib
import os
import shutil

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


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
  """The workdir of one finished `tiny_runs.SHORT` run, made once per test session and shared by
  the xdist workers (a file lock). Read it, never write it: copy it first to damage or extend it."""
  import fcntl  # pylint: disable=g-import-not-at-top
  import tiny_runs  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this session
  workdir = root / "tiny_reference"
  with open(root / "tiny_reference.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "tiny_reference.done").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      tiny_runs.run_launch(str(workdir))
      (root / "tiny_reference.done").write_text("ok")
  return str(workdir)
