"""jaxreplay: RL post-training of LLMs in JAX with an experience-replay buffer.

Submodules are imported on first use (`jaxreplay.models`, `jaxreplay.losses`, ...), so that
`import jaxreplay` stays cheap and optional dependencies (vLLM, torch) load only when used.
"""
import importlib

__version__ = "0.1.0"

_SUBMODULES = (
    "batch", "buffer", "collate", "checkpoint", "losses", "models", "optim", "rollout",
    "sharding", "tasks", "trainer", "evaluation", "metrics", "accounting", "pipeline",
)


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"jaxreplay.{name}")
  raise AttributeError(f"module 'jaxreplay' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_SUBMODULES))
