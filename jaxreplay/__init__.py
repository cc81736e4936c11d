"""jaxreplay: RL post-training of LLMs in JAX with an experience-replay buffer.

The package is layered (WORKSPACE.md draws the map):
  config/    defaults, validation, device split, memory plan
  models/    Qwen3 / Qwen2.5 / Llama as pure functions over a parameter pytree, HF conversion
  tasks/     problems, prompts, rewards, tokenizers
  learner/   losses, algorithms, batch, optimizer, the jitted train step
  data/      the replay buffer, collate, the experience intake
  rollout/   rollout workers (JAX sampler, vLLM, Ray), the pool, weight publishers
  run/       build, the pipeline, the schedules, evaluation, metrics rows, compute accounting
  infra/     sharding, checkpoints, child processes, safety, the step channel, metric writers
  science/   sweeps, statistics, plots, reports, Theorem 4.5's design, the noise probe
Entry points: `python -m jaxreplay.launch | sft | experiments | plot`.

Submodules are imported on first use, so that `import jaxreplay` stays cheap and optional
dependencies (vLLM, torch, Ray) load only when used. The module paths from before the layers
(`jaxreplay.losses`, `jaxreplay.buffer`, ...) stay importable (`jaxreplay._imports`).
"""
import importlib

from jaxreplay import _imports

__version__ = "0.1.0"

_imports.install()

_SUBPACKAGES = ("config", "models", "tasks", "learner", "data", "rollout", "run", "infra",
                "science")


def __getattr__(name):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"jaxreplay.{name}")
  module = _imports.old_attribute(name)
  if module is not None:
    return module
  raise AttributeError(f"module 'jaxreplay' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_SUBPACKAGES))
