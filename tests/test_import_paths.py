"""The package's import plumbing (`jaxreplay/_imports.py`): the module paths from before the layers
stay importable as the same module objects, split modules read names from each part, the layers'
lazy exports resolve, and `import jaxreplay` / a layer imports no optional dependency."""
import contextlib
import importlib
import subprocess
import sys

from conftest import require
import pytest

import jaxreplay
from jaxreplay import _imports

OPTIONAL = ("vllm", "torch", "ray", "transformers", "matplotlib")


@contextlib.contextmanager
def _optional_dependencies():
  """An import inside that needs a missing optional dependency skips the test (fails under
  CI=true: `conftest.require`); any other import error propagates."""
  try:
    yield
  except ModuleNotFoundError as e:
    missing = (e.name or "").split(".")[0]
    if missing not in OPTIONAL:
      raise
    require(missing)
    raise


def _import(name):
  with _optional_dependencies():
    return importlib.import_module(name)


# The module paths users and configs imported before the layers (issue 25), and where each one's code
# is now: written out here, not read from `_imports.OLD_PATHS`, so a lost or misdirected alias fails.
MOVED = {
    "jaxreplay.config_defaults": "jaxreplay.config.defaults",
    "jaxreplay.devices": "jaxreplay.config.devices",
    "jaxreplay.memory_plan": "jaxreplay.config.memory_plan",
    "jaxreplay.losses": "jaxreplay.learner.losses",
    "jaxreplay.algorithms": "jaxreplay.learner.algorithms",
    "jaxreplay.batch": "jaxreplay.learner.batch",
    "jaxreplay.trainer": "jaxreplay.learner.trainer",
    "jaxreplay.optim": "jaxreplay.learner.optim",
    "jaxreplay.buffer": "jaxreplay.data.buffer",
    "jaxreplay.collate": "jaxreplay.data.collate",
    "jaxreplay.experience": "jaxreplay.data.experience",
    "jaxreplay.workers": "jaxreplay.rollout.backends",
    "jaxreplay.rollout.vllm_worker": "jaxreplay.rollout.vllm.engine",
    "jaxreplay.rollout.vllm_transfer": "jaxreplay.rollout.vllm.transfer",
    "jaxreplay.rollout.vllm_direct_load": "jaxreplay.rollout.vllm.direct_load",
    "jaxreplay.rollout.shm_weights": "jaxreplay.rollout.weights.shm_format",
    "jaxreplay.rollout.shm_publisher": "jaxreplay.rollout.weights.shm_publisher",
    "jaxreplay.rollout.weight_sync": "jaxreplay.rollout.weights.file_publisher",
    "jaxreplay.rollout.ray_actor": "jaxreplay.rollout.ray.actor",
    "jaxreplay.rollout.ray_publisher": "jaxreplay.rollout.ray.publisher",
    "jaxreplay.rollout.ray_workers": "jaxreplay.rollout.ray.group",
    "jaxreplay.pipeline": "jaxreplay.run.pipeline",
    "jaxreplay.schedulers": "jaxreplay.run.schedules",
    "jaxreplay.evaluation": "jaxreplay.run.evaluation",
    "jaxreplay.run_metrics": "jaxreplay.run.metrics_row",
    "jaxreplay.sharding": "jaxreplay.infra.sharding",
    "jaxreplay.checkpoint": "jaxreplay.infra.checkpoint",
    "jaxreplay.checkpoint_integrity": "jaxreplay.infra.checkpoint_integrity",
    "jaxreplay.child_process": "jaxreplay.infra.child_process",
    "jaxreplay.safety": "jaxreplay.infra.safety",
    "jaxreplay.step_channel": "jaxreplay.infra.step_channel",
    "jaxreplay.metrics": "jaxreplay.infra.metric_writers",
    "jaxreplay.sweeps": "jaxreplay.science.sweeps",
    "jaxreplay.experiment_stats": "jaxreplay.science.stats",
    "jaxreplay.experiment_plots": "jaxreplay.science.plots",
    "jaxreplay.experiment_report": "jaxreplay.science.report",
    "jaxreplay.noise_probe": "jaxreplay.science.noise_probe",
    "jaxreplay.noise_stats": "jaxreplay.science.noise_stats",
}
# Old modules whose code was split: each part, and a name that callers read from the old path.
SPLIT = {
    "jaxreplay.build": (("jaxreplay.run.build", "build"),
                        ("jaxreplay.config.validation", "validate_config")),
    "jaxreplay.accounting": (("jaxreplay.run.accounting", "ComputeAccountant"),
                             ("jaxreplay.science.design", "optimal_design")),
}


def test_the_alias_table_holds_every_old_path():
  assert set(_imports.OLD_PATHS) == set(MOVED) | set(SPLIT)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_that_holds_the_code_now(old):
  module = _import(old)
  assert module is importlib.import_module(MOVED[old])
  assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]  # pickle, reload


@pytest.mark.parametrize("old", sorted(SPLIT))
def test_a_split_old_path_reads_each_part_in_order(old):
  module = _import(old)
  parts = [importlib.import_module(new) for new, _ in SPLIT[old]]
  for part, (_, name) in zip(parts, SPLIT[old]):
    assert getattr(module, name) is getattr(part, name)
  public = {n for p in parts for n in dir(p) if not n.startswith("_")}
  assert public <= set(dir(module))
  for name in public:
    owner = next(p for p in parts if hasattr(p, name))
    assert getattr(module, name) is getattr(owner, name), name
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    getattr(module, "not_a_name")


def test_patching_the_old_name_patches_the_new(monkeypatch):
  import jaxreplay.buffer as old  # pylint: disable=g-import-not-at-top
  from jaxreplay.data import buffer as new  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(old, "ReplayBuffer", "patched")
  assert new.ReplayBuffer == "patched"


def test_top_level_names():
  from jaxreplay import buffer, schedulers  # pylint: disable=g-import-not-at-top
  assert buffer is importlib.import_module("jaxreplay.data.buffer")
  assert schedulers is importlib.import_module("jaxreplay.run.schedules")
  assert jaxreplay.learner is importlib.import_module("jaxreplay.learner")
  assert "learner" in dir(jaxreplay)
  with pytest.raises(AttributeError, match="has no attribute 'not_a_module'"):
    getattr(jaxreplay, "not_a_module")


@pytest.mark.parametrize("layer", ["config", "models", "tasks", "learner", "data", "rollout", "run",
                                   "infra", "science"])
def test_every_name_a_layer_exports_resolves(layer):
  package = importlib.import_module(f"jaxreplay.{layer}")
  names = [n for n in dir(package) if not n.startswith("_")]
  assert names, layer
  for name in names:
    with _optional_dependencies():
      assert getattr(package, name) is not None, f"jaxreplay.{layer}.{name}"


def test_a_lazy_export_may_not_shadow_a_module():
  with pytest.raises(ValueError, match=r"\['buffer'\] shadow its modules"):
    _imports.lazy_exports("jaxreplay.data", {"buffer": "buffer"})


def test_importing_the_package_and_its_interfaces_loads_no_optional_dependency():
  code = ("import sys, jaxreplay, jaxreplay.rollout, jaxreplay.data, jaxreplay.learner;"
          f"heavy = sorted(m for m in {OPTIONAL + ('jax',)!r} if m in sys.modules);"
          "print(','.join(heavy))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "", out.stdout
