"""What runs inside a Ray rollout actor (rollout.placement="ray"): `WorkerSpec`, `RolloutActor`.

`RolloutActor` hosts one worker in the actor's process through its backend's host class (the
record's `actor_host` in `rollout.backend_table`): `JaxSamplerHost`, a `JaxSampler`
(JAX_PLATFORMS=cpu in the actor's runtime env when it has no GPU: the record's
`actor_env_without_gpus`), or `VllmEngineHost`, an in-process `VllmEngine`, started with
`weights_pending=True` from a config-only model dir that the actor writes from config-file bytes
shipped by the driver (another node cannot read the driver's /dev/shm). Actors start without
weights (version -1): the driver loads them (`RayRolloutGroup.make_worker`), also after a restart.
A vLLM actor copies the received tensors into a node-local shared-memory segment
(`shm_format.SlotRing`) and loads it through the engine's tested path (`VllmEngine.load_weights`
with `shm_path`: vLLM's weight-transfer session); a JAX actor `device_put`s the pytree. The
worker's module (JAX sampler or vLLM engine) is imported only by the actors that run it.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any, Sequence

import numpy as np
import ray

from jaxreplay.rollout import backend_table
from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.base import Group, SamplingParams, Weights


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  """What every actor of a group builds (picklable; shipped to the actors).

  backend: a name of `backend_table.BACKENDS` whose record has an `actor_host` ("jax": a
    `JaxSampler`, "vllm": an in-process `VllmEngine`).
  model_cfg: the policy's `ModelConfig`. max_len: prompt + completion tokens of the JAX sampler.
  sampler_batch_size: rows per jitted batch (jax). eos_token_ids: ids that end a completion.
  seed: the run's seed; actor i's sampler seed is seed + 1000 * (i + 1) (`seed_of`), as for
    local workers. dtype: the engines' dtype ("float32" | "bfloat16" | "float16"; vllm).
  engine_kwargs: `VllmEngine` keyword arguments (`workers.vllm_engine_settings` without "env").
  env: environment variables of the actor process (its runtime env; vLLM reads them at import).
  config_files: {file name: bytes} of the config-only model dir (config.json,
    generation_config.json) that a vLLM actor writes on its own node.
  """
  backend: str
  model_cfg: Any
  max_len: int
  sampler_batch_size: int = 64
  eos_token_ids: tuple[int, ...] = ()
  seed: int = 0
  dtype: str = "float32"
  engine_kwargs: dict = dataclasses.field(default_factory=dict)
  env: dict = dataclasses.field(default_factory=dict)
  config_files: dict = dataclasses.field(default_factory=dict)

  def seed_of(self, index: int) -> int:
    """Worker `index`'s sampler seed (`RolloutBackend.make_worker`'s rule)."""
    return int(self.seed) + 1000 * (int(index) + 1)


class JaxSamplerHost:
  """A `JaxSampler` in a Ray actor: loads the numpy params pytree with `device_put`."""

  def __init__(self, spec: WorkerSpec, index: int):
    from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
    self.spec = spec
    self.worker = JaxSampler(spec.model_cfg, None, spec.max_len, batch_size=spec.sampler_batch_size,
                             eos_token_ids=spec.eos_token_ids, seed=spec.seed_of(index),
                             policy_version=-1)

  def load(self, version: int, payload: Any) -> dict[str, float]:
    """The numpy params pytree as `version`; its phases [s]: device_put_s."""
    import jax  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    params = jax.block_until_ready(jax.device_put(payload))
    phases = {"device_put_s": time.perf_counter() - start}
    self.worker.load_weights(Weights(int(version), params=params, cfg=self.spec.model_cfg))
    return phases

  def close(self) -> None:
    self.worker.close()


class VllmEngineHost:
  """An in-process `VllmEngine` in a Ray actor: started from a config-only model dir written on
  this node, loads each HF state dict through a node-local `SlotRing` segment."""

  def __init__(self, spec: WorkerSpec, index: int):
    from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
    from jaxreplay.rollout.weights.file_publisher import claim_root  # pylint: disable=g-import-not-at-top
    self.spec = spec
    # This node's /dev/shm: the config-only model dir and the segment the engine loads from.
    self._root, _, self._owner_fd = claim_root(None)
    model_dir = os.path.join(self._root, "model")
    os.makedirs(model_dir, exist_ok=True)
    for name, data in spec.config_files.items():
      with open(os.path.join(model_dir, name), "wb") as f:
        f.write(data)
    self._ring = shm_format.SlotRing(self._root)
    self.worker = VllmEngine(model_dir, weights_pending=True, policy_version=-1,
                             seed=spec.seed_of(index), eos_token_ids=spec.eos_token_ids,
                             dtype=spec.dtype, env=dict(spec.env), **spec.engine_kwargs)

  def load(self, version: int, payload: Any) -> dict[str, float]:
    """The HF state dict as `version`, through a segment; phases: segment_write_s, bytes and the
    engine's (load_s, repack_s, ...)."""
    start = time.perf_counter()
    sources = [(name, tuple(x.shape), False, (lambda x=x: x)) for name, x in payload.items()]
    path, nbytes = self._ring.write(sources, self.spec.dtype, int(version), protect=set())
    written = time.perf_counter() - start
    phases = dict(self.worker.load_weights(Weights(int(version), shm_path=path)))
    phases.update(segment_write_s=written, bytes=float(nbytes))
    return phases

  def close(self) -> None:
    """Releases the engine and this node's segment files."""
    self.worker.close()
    self._ring.remove()
    from jaxreplay.rollout.weights.file_publisher import release_root  # pylint: disable=g-import-not-at-top
    release_root(self._root, True, self._owner_fd)


class RolloutActor:
  """One rollout worker inside a Ray actor process (wrapped with `ray.remote` by the group).

  Args:
    spec: the `WorkerSpec`. index: the worker's slot (its seed derives from it).
  Starts without weights (policy_version -1): `load_weights` must come before `generate`.
  """

  def __init__(self, spec: WorkerSpec, index: int):
    start = time.perf_counter()
    self.spec, self.index = spec, int(index)
    record = backend_table.BACKENDS.get(spec.backend)
    if record is None or record.actor_host is None:
      hosted = tuple(n for n, b in backend_table.BACKENDS.items() if b.actor_host is not None)
      raise ValueError(f"WorkerSpec.backend={spec.backend!r}: expected one of {hosted}")
    self.host = backend_table.load(record.actor_host)(spec, self.index)
    self.worker = self.host.worker
    self.startup_seconds = time.perf_counter() - start

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """The worker's `generate` (groups tagged with the version it holds)."""
    if self.worker.policy_version < 0:
      raise RuntimeError(f"rollout actor {self.index} holds no weights yet; call load_weights "
                         "first (RayRolloutGroup.make_worker does)")
    return self.worker.generate(prompts, n, sampling)

  def load_weights(self, version: int, payload: Any) -> dict[str, float]:
    """Loads `payload` (the object-store value: Ray resolves the driver's ref to it before this
    runs) as `version`. Returns the phases [s]: the host's (jax device_put_s; vllm
    segment_write_s and the engine's load_s, repack_s, ...) and actor_s."""
    start = time.perf_counter()
    phases = self.host.load(int(version), payload)
    phases["actor_s"] = time.perf_counter() - start
    return phases

  def stats(self) -> dict[str, Any]:
    """Where and what this actor is: index, pid, node id, hostname, node IP, GPU ids,
    policy_version, start-up seconds."""
    ctx = ray.get_runtime_context()
    return {"index": self.index, "pid": os.getpid(), "node_id": ctx.get_node_id(),
            "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "backend": self.spec.backend,
            "counts_calls": hasattr(self.worker, "call_count"),
            "policy_version": int(self.worker.policy_version),
            "startup_seconds": self.startup_seconds}

  def ping(self) -> int:
    """This actor's pid (it answers: it is alive and not busy)."""
    return os.getpid()

  def get_call_count(self) -> int:
    return self._sampler().call_count

  def set_call_count(self, value: int) -> None:
    self._sampler().call_count = int(value)

  def close(self) -> None:
    """Releases the worker and what its host holds on this node (the group then kills the
    process)."""
    self.host.close()

  def _sampler(self):
    if not hasattr(self.worker, "call_count"):
      raise AttributeError("call_count: only actors of samplers that count their calls (the JAX "
                           "sampler's noise stream) have it")
    return self.worker

