"""Import plumbing: the module paths from before the layers (kept importable), lazy re-exports.

`import jaxreplay.losses`, `from jaxreplay import buffer`, `from jaxreplay.rollout.shm_weights import
StaleWeights`, ... keep working: each old path is an alias of the module that holds the code now
(the same module object, so patching either name patches both). An old path whose code was split
over two modules (`jaxreplay.build`: build + validation; `jaxreplay.accounting`: the accountant +
Theorem 4.5's design) is a module that reads its names from each of them, in order.
New code imports the new paths (WORKSPACE.md's layout); this table only keeps old callers working.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

OLD_PATHS: dict[str, tuple[str, ...]] = {
    "jaxreplay.config_defaults": ("jaxreplay.config.defaults",),
    "jaxreplay.devices": ("jaxreplay.config.devices",),
    "jaxreplay.memory_plan": ("jaxreplay.config.memory_plan",),
    "jaxreplay.losses": ("jaxreplay.learner.losses",),
    "jaxreplay.algorithms": ("jaxreplay.learner.algorithms",),
    "jaxreplay.batch": ("jaxreplay.learner.batch",),
    "jaxreplay.trainer": ("jaxreplay.learner.trainer",),
    "jaxreplay.optim": ("jaxreplay.learner.optim",),
    "jaxreplay.buffer": ("jaxreplay.data.buffer",),
    "jaxreplay.collate": ("jaxreplay.data.collate",),
    "jaxreplay.experience": ("jaxreplay.data.experience",),
    "jaxreplay.workers": ("jaxreplay.rollout.backends",),
    "jaxreplay.rollout.vllm_worker": ("jaxreplay.rollout.vllm.engine",),
    "jaxreplay.rollout.vllm_transfer": ("jaxreplay.rollout.vllm.transfer",),
    "jaxreplay.rollout.vllm_direct_load": ("jaxreplay.rollout.vllm.direct_load",),
    "jaxreplay.rollout.shm_weights": ("jaxreplay.rollout.weights.shm_format",),
    "jaxreplay.rollout.shm_publisher": ("jaxreplay.rollout.weights.shm_publisher",),
    "jaxreplay.rollout.weight_sync": ("jaxreplay.rollout.weights.file_publisher",),
    "jaxreplay.rollout.ray_actor": ("jaxreplay.rollout.ray.actor",),
    "jaxreplay.rollout.ray_publisher": ("jaxreplay.rollout.ray.publisher",),
    "jaxreplay.rollout.ray_workers": ("jaxreplay.rollout.ray.group",),
    "jaxreplay.build": ("jaxreplay.run.build", "jaxreplay.config.validation"),
    "jaxreplay.pipeline": ("jaxreplay.run.pipeline",),
    "jaxreplay.schedulers": ("jaxreplay.run.schedules",),
    "jaxreplay.evaluation": ("jaxreplay.run.evaluation",),
    "jaxreplay.run_metrics": ("jaxreplay.run.metrics_row",),
    "jaxreplay.accounting": ("jaxreplay.run.accounting", "jaxreplay.science.design"),
    "jaxreplay.sharding": ("jaxreplay.infra.sharding",),
    "jaxreplay.checkpoint": ("jaxreplay.infra.checkpoint",),
    "jaxreplay.checkpoint_integrity": ("jaxreplay.infra.checkpoint_integrity",),
    "jaxreplay.child_process": ("jaxreplay.infra.child_process",),
    "jaxreplay.safety": ("jaxreplay.infra.safety",),
    "jaxreplay.step_channel": ("jaxreplay.infra.step_channel",),
    "jaxreplay.metrics": ("jaxreplay.infra.metric_writers",),
    "jaxreplay.sweeps": ("jaxreplay.science.sweeps",),
    "jaxreplay.experiment_stats": ("jaxreplay.science.stats",),
    "jaxreplay.experiment_plots": ("jaxreplay.science.plots",),
    "jaxreplay.experiment_report": ("jaxreplay.science.report",),
    "jaxreplay.noise_probe": ("jaxreplay.science.noise_probe",),
    "jaxreplay.noise_stats": ("jaxreplay.science.noise_stats",),
}


def _merged(name: str, targets: tuple[str, ...]) -> types.ModuleType:
  """A module named `name` whose attributes are read from `targets`, first match wins."""
  modules = [importlib.import_module(t) for t in targets]
  merged = types.ModuleType(name, modules[0].__doc__)

  def __getattr__(attr):  # noqa: N807
    for m in modules:
      if hasattr(m, attr):
        return getattr(m, attr)
    raise AttributeError(f"module {name!r} has no attribute {attr!r}")

  merged.__getattr__ = __getattr__
  merged.__dir__ = lambda: sorted({a for m in modules for a in dir(m)})
  return merged


class _AliasLoader(importlib.abc.Loader):

  def __init__(self, targets: tuple[str, ...]):
    self.targets = targets

  def create_module(self, spec):
    if len(self.targets) == 1:
      module = importlib.import_module(self.targets[0])
      self._own_spec = module.__spec__
      return module
    return _merged(spec.name, self.targets)

  def exec_module(self, module):
    # The target module ran at its own import; the import system has just set its __spec__ to
    # the alias's, so it gets its own back (reload, pickling by module name, -m keep working).
    if len(self.targets) == 1:
      module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
  """Finds the old paths of `OLD_PATHS` (and nothing else)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    targets = OLD_PATHS.get(fullname)
    if targets is None:
      return None
    return importlib.machinery.ModuleSpec(fullname, _AliasLoader(targets))


def install() -> None:
  """Puts the alias finder on `sys.meta_path` once (called by `jaxreplay/__init__.py`)."""
  if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())


def old_attribute(name: str):
  """`jaxreplay.<name>` for an old top-level module name (`from jaxreplay import buffer`), or None."""
  full = f"jaxreplay.{name}"
  if full in OLD_PATHS:
    return importlib.import_module(full)
  return None


def lazy_exports(package: str, exports: dict[str, str]):
  """(__getattr__, __dir__) for a sub-package's `__init__`: `exports` maps each public name to the
  module (relative to `package`) that defines it; the module is imported on first access, so
  importing a layer never imports what its caller does not use (JAX, vLLM, Ray, matplotlib).
  A name may not be one of the package's modules: `from package import module` reads the
  attribute first, so the module would be shadowed."""
  shadowed = sorted(n for n, m in exports.items() if n == m)
  if shadowed:
    raise ValueError(f"{package}: exported names {shadowed} shadow its modules of the same name")

  def __getattr__(name):  # noqa: N807
    if name in exports:
      value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
      setattr(sys.modules[package], name, value)
      return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__():  # noqa: N807
    return sorted(set(vars(sys.modules[package])) | set(exports))

  return __getattr__, __dir__
