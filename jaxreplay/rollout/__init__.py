"""Rollout workers: the interface, the JAX sampler, the vLLM engine, the worker pool, weight sync.

Only the interface (numpy) is imported eagerly. The rest loads on first use, so that importing
`jaxreplay.rollout` never imports vLLM or torch (an optional extra), and a vLLM worker process that
imports `jaxreplay.rollout.vllm.engine` does not import JAX.
"""
import importlib

from jaxreplay.rollout.base import (Completion, Delivery, Group, PoolStopped, PromptBatch,
                                    RolloutWorker, SamplingParams, StaleWeights, Weights,
                                    WorkerDied)

_LAZY = {
    "JaxSampler": "jaxreplay.rollout.jax_sampler",
    "VllmEngine": "jaxreplay.rollout.vllm.engine",
    "VllmWorkerProcess": "jaxreplay.rollout.vllm.engine",
    "WeightPublisher": "jaxreplay.rollout.weights.file_publisher",
    "FilePublisher": "jaxreplay.rollout.weights.file_publisher",
    "DeviceCopyPublisher": "jaxreplay.rollout.weights.publisher",
    "PublishRecord": "jaxreplay.rollout.weights.publisher",
    "ShmPublisher": "jaxreplay.rollout.weights.shm_publisher",
    "WorkerPool": "jaxreplay.rollout.pool",
    "RolloutBackend": "jaxreplay.rollout.backends",
}

__all__ = ["SamplingParams", "Completion", "Group", "RolloutWorker", "Weights", "WorkerDied",
           "StaleWeights", "PoolStopped", "PromptBatch", "Delivery", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'jaxreplay.rollout' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
