"""The package's import surface: `import jaxreplay` and its layer packages stay cheap (no JAX, no
optional dependency), and every module has one name: the paths from before the layers are gone."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


HEAVY = ("jax", "jaxlib", "vllm", "torch", "ray", "transformers", "matplotlib")

# The packages (and the light modules) a caller may import without paying for JAX or an optional
# dependency: every package, rollout/base.py and rollout/pool.py (numpy only), shm_format (numpy
# only: it reads segments in processes that never import JAX; its import covers rollout.weights')
# and the vLLM engine's driver side (an engine process imports vLLM itself, never JAX).
LIGHT = (
    "jaxreplay", "jaxreplay.config", "jaxreplay.models", "jaxreplay.tasks", "jaxreplay.learner",
    "jaxreplay.data", "jaxreplay.rollout", "jaxreplay.rollout.vllm", "jaxreplay.rollout.ray",
    "jaxreplay.run", "jaxreplay.infra", "jaxreplay.science", "jaxreplay.rollout.base",
    "jaxreplay.rollout.pool", "jaxreplay.rollout.weights.shm_format",
    "jaxreplay.rollout.vllm.engine",
)

# Every module path from before the layers (issue 25): each one's code lives at exactly one other
# path now, so none of these may import again (no alias finder, no shim module, no re-export).
# Written out here, never read from the package, so that an alias added back fails this test.
OLD_PATHS = (
    "jaxreplay.config_defaults", "jaxreplay.devices", "jaxreplay.memory_plan", "jaxreplay.losses",
    "jaxreplay.algorithms", "jaxreplay.batch", "jaxreplay.trainer", "jaxreplay.optim",
    "jaxreplay.buffer", "jaxreplay.collate", "jaxreplay.experience", "jaxreplay.workers",
    "jaxreplay.rollout.vllm_worker", "jaxreplay.rollout.vllm_transfer",
    "jaxreplay.rollout.vllm_direct_load", "jaxreplay.rollout.shm_weights",
    "jaxreplay.rollout.shm_publisher", "jaxreplay.rollout.weight_sync",
    "jaxreplay.rollout.ray_actor", "jaxreplay.rollout.ray_publisher",
    "jaxreplay.rollout.ray_workers", "jaxreplay.build", "jaxreplay.pipeline",
    "jaxreplay.schedulers", "jaxreplay.evaluation", "jaxreplay.run_metrics", "jaxreplay.accounting",
    "jaxreplay.sharding", "jaxreplay.checkpoint", "jaxreplay.checkpoint_integrity",
    "jaxreplay.child_process", "jaxreplay.safety", "jaxreplay.step_channel", "jaxreplay.metrics",
    "jaxreplay.sweeps", "jaxreplay.experiment_stats", "jaxreplay.experiment_plots",
    "jaxreplay.experiment_report", "jaxreplay.noise_probe", "jaxreplay.noise_stats",
)


def _in_fresh_interpreter(code: str):
  """stdout of `code` run by a fresh interpreter on the repository (nothing imported yet)."""
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


@pytest.mark.parametrize("module", LIGHT)
def test_a_light_module_imports_no_jax_and_no_optional_dependency(module):
  code = (f"import importlib, json, sys; importlib.import_module({module!r}); "
          f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
  assert json.loads(_in_fresh_interpreter(code)) == [], module


@pytest.mark.parametrize("old", OLD_PATHS)
def test_a_module_path_from_before_the_layers_does_not_import(old):
  """Neither as a module (fresh interpreter, and this one, where every layer may be imported by
  now) nor as an attribute of its parent package."""
  parent, _, name = old.rpartition(".")
  code = (f"import importlib.util, {parent}; "
          f"print(importlib.util.find_spec({old!r}) is None, hasattr({parent}, {name!r}))")
  assert _in_fresh_interpreter(code).split() == ["True", "False"], old
  assert importlib.util.find_spec(old) is None, old
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(old)
