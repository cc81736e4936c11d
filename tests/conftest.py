"""Shared test set-up: 8 emulated CPU devices, the session's JAX compilation cache, and the
session's shared fixtures. Helpers the tests import live in `tests/helpers/` (`deps.require`:
optional dependencies, a failure under CI=true)."""
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent JAX compilation cache for the session's processes (the pytest workers and the runs
# they launch), every program in it however fast it compiled: the tests build the same tiny models
# and steps again and again (measured on tests/learner/test_adapters.py + tests/run/test_regime.py,
# cold cache: 177 -> 124 CPU-seconds). Entries are keyed by the program, the devices and the jax
# version, so a stale one is never used; tests that need their own cache set it themselves.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get(
    "JAXREPLAY_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "jaxreplay-test-jax-cache")))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
  """The workdir of one finished `tiny_runs.SHORT` run, made once per test session and shared by
  the xdist workers (a file lock). Read it, never write it: copy it first to damage or extend it."""
  import fcntl  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_runs  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this session
  workdir = root / "tiny_reference"
  with open(root / "tiny_reference.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (root / "tiny_reference.done").exists():
      shutil.rmtree(workdir, ignore_errors=True)
      proc = tiny_runs.run_launch(str(workdir))
      (root / "tiny_reference.console").write_text(proc.stderr)  # tests/test_launch.py reads it
      (root / "tiny_reference.done").write_text("ok")
  return str(workdir)
