"""The run's rollout backend: which workers generate, and how the trainer's weights reach them.

`RolloutBackend.publish(params, version) -> Weights` turns the trainer's parameters into the opaque
handle the workers load with `load_weights`:
  - jax:  `JaxSampler`s in this process get device arrays: a copy of the params (the train step
          donates its own buffers), no host round trip.
  - vllm: `VllmWorkerProcess`es (one engine process per worker) get an HF directory written once
          per refresh by `WeightPublisher` (to /dev/shm), which each engine reloads in one RPC.
With several trainer processes every process gathers full host copies first (a collective).
`make_worker(index, weights)` builds worker `index` holding `weights`; the schedules
(`jaxreplay.schedulers`) decide how many workers run and when they load newer weights.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxreplay import sharding
from jaxreplay.devices import GpuSplit
from jaxreplay.rollout.base import RolloutWorker, Weights
from jaxreplay.rollout.jax_sampler import JaxSampler


class RolloutBackend:
  """Makes the rollout workers of one run and publishes weights to them.

  Args:
    config: the run config (rollout.backend resolved to "jax" or "vllm", rollout.*, model.max_len).
    model_cfg: the policy's `ModelConfig`.
    stop_ids: token ids that end a completion (the tokenizer's eos ids).
  """

  def __init__(self, config, model_cfg, stop_ids):
    self.config, self.model_cfg, self.stop_ids = config, model_cfg, tuple(stop_ids)
    self.backend = config.rollout.backend
    if self.backend not in ("jax", "vllm"):
      raise ValueError(f"rollout.backend={self.backend!r}: resolve 'auto' first "
                       "(build.resolve_backend)")
    self.publisher = None
    if self.backend == "vllm":
      from jaxreplay.rollout.weight_sync import WeightPublisher  # pylint: disable=g-import-not-at-top
      self.publisher = WeightPublisher(keep=3)

  def publish(self, params, version: int) -> Weights:
    """The weights handle of `params` at policy `version` (see the module docstring)."""
    if jax.process_count() > 1:  # a collective: every trainer process publishes at the same step
      params = sharding.host_local(params)
    elif self.backend == "jax":
      params = jax.tree.map(jnp.copy, params)  # the train step donates its own buffers
    if self.backend == "jax":
      return Weights(version=int(version), params=params, cfg=self.model_cfg)
    hf_dir = self.publisher.publish(self.model_cfg, params, version)
    return Weights(version=int(version), hf_dir=hf_dir, cfg=self.model_cfg)

  def make_worker(self, index: int, weights: Weights) -> RolloutWorker:
    """A new worker `index` holding `weights` (its seed derives from config.seed and index)."""
    c = self.config
    seed = c.seed + 1000 * (index + 1)
    if self.backend == "jax":
      return JaxSampler(self.model_cfg, weights.params, c.model.max_len,
                        batch_size=c.rollout.sampler_batch_size, eos_token_ids=self.stop_ids,
                        seed=seed, policy_version=weights.version)
    from jaxreplay.rollout.vllm_worker import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
    on_cpu = jax.default_backend() == "cpu"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(c.rollout.vllm_kv_cache_gib)}
    gpus = tuple(g for g in os.environ.get("JAXREPLAY_WORKER_GPUS", "").split(",") if g)
    if gpus:  # set by jaxreplay.devices (launch): JAXREPLAY_GPUS_PER_WORKER GPUs per worker
      per_worker = int(os.environ.get("JAXREPLAY_GPUS_PER_WORKER", "1"))
      split = GpuSplit(trainer=(), workers=gpus, per_worker=per_worker)
      env["CUDA_VISIBLE_DEVICES"] = ",".join(split.worker_gpus(index))
    return VllmWorkerProcess(
        weights.hf_dir, policy_version=weights.version, max_model_len=c.model.max_len,
        dtype="float32" if on_cpu else "bfloat16", seed=seed, env=env, eos_token_ids=self.stop_ids)

  def close(self) -> None:
    if self.publisher is not None:
      self.publisher.close()
      self.publisher = None
