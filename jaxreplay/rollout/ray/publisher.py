"""Weights through Ray's object store (rollout.placement="ray"): `ObjectStorePublisher`.

One object per version, `ray.put` on a background thread (the trainer's stall is the device -> host
copy, as with `ShmPublisher`): JAX actors get the numpy parameter pytree, vLLM actors the HF-named,
HF-layout state dict in the engines' dtype (bf16 through ml_dtypes). Only the newest `keep`
versions stay referenced; loading an older one raises `StaleWeights` (the pool then loads its
newest target). The object store reaches every node of the cluster: no shared filesystem.
Not built: GPU NCCL broadcast from the trainer to the engines (GPU engines get this host copy).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import ray

from jaxreplay.models import hf_io
from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.base import Weights
from jaxreplay.rollout.weights.shm_publisher import host_copies
from jaxreplay.rollout.weights.publisher import PublishHistory, PublishRecord


def stored_weights(weights: Weights) -> "StoredWeights":
  """The `StoredWeights` of an object-store handle (waits for its background put); ValueError for
  a handle without one."""
  if not isinstance(weights, Weights):
    raise TypeError(f"load_weights takes a jaxreplay.rollout.base.Weights, got {type(weights)}")
  ref = weights.object_ref
  if ref is None:
    raise ValueError(f"Weights of version {weights.version} carry no object-store copy, which Ray "
                     "actors load (rollout.placement='ray'); publish them with "
                     "RolloutBackend.publish under placement 'ray' (or ObjectStorePublisher)")
  weights.wait()
  if isinstance(ref, concurrent.futures.Future):
    ref = ref.result()
  return ref



@dataclasses.dataclass
class StoredWeights:
  """One version in Ray's object store. `ref` is the `ray.ObjectRef` of the payload, None once
  the publisher dropped it (only the newest `keep` versions stay referenced)."""
  version: int
  ref: Any
  nbytes: int
  put_s: float


PutRecord = PublishRecord  # the name of its record before the publisher contract


class ObjectStorePublisher(PublishHistory):
  """Publishes successive parameter versions into Ray's object store (see the module docstring).

  Args:
    cfg: the architecture. form: "params" (the numpy parameter pytree, for JAX-sampler actors) or
      "hf" (the HF-named, HF-layout state dict, for vLLM actors).
    dtype: the payload's dtype ("float32" | "bfloat16" | "float16"; cast on device before the host
      copy); None keeps the params' own (the JAX samplers' in-process behaviour).
    keep: the newest versions whose objects stay referenced (>= 1; a worker may be about to load
      version v while v + 1 is stored, so 2 or more for a pool).
  """

  def __init__(self, cfg, form: str, dtype: Optional[str] = None, keep: int = 3):
    if form not in ("params", "hf"):
      raise ValueError(f"form={form!r}: expected 'params' (JAX samplers) or 'hf' (vLLM engines)")
    if dtype is not None and dtype not in shm_format.DTYPES:
      raise ValueError(f"dtype={dtype!r}: expected one of {sorted(shm_format.DTYPES)} or None")
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1")
    if not ray.is_initialized():
      raise RuntimeError("ObjectStorePublisher needs Ray: connect first (group.connect, or "
                         "a RayRolloutGroup)")
    self.cfg, self.form, self.dtype, self.keep = cfg, form, dtype, int(keep)
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ray-publisher")
    self._lock = threading.Lock()
    self._stored: collections.deque[StoredWeights] = collections.deque()
    self._last_version: Optional[int] = None
    self.history: list[PublishRecord] = []
    self._closed = False

  def publish(self, params: Any, version: int) -> Weights:
    """Hands `params` over as `version`; returns at once with `Weights(object_ref=future,
    ready=future)` (the future's result: the `StoredWeights`). `params` (jax arrays, fully
    addressable, or numpy) may be donated as soon as this returns."""
    version = int(version)
    with self._lock:
      if self._closed:
        raise RuntimeError("this ObjectStorePublisher is closed")
      if self._last_version is not None and version <= self._last_version:
        raise ValueError(f"version {version} is not newer than the last published version "
                         f"{self._last_version}; versions must increase")
      start = time.perf_counter()
      leaves, treedef = jax.tree_util.tree_flatten(params)
      host = host_copies(leaves, self.dtype)
      record = PublishRecord(version, sum(x.nbytes for x in host), time.perf_counter() - start)
      future = self._executor.submit(self._put, treedef, host, version, record)
      self._last_version = version
      self.history.append(record)
    return Weights(version=version, cfg=self.cfg, object_ref=future, ready=future)

  def close(self) -> None:
    """Finishes pending puts and drops every reference (Ray frees the objects)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._executor.shutdown(wait=True)
    with self._lock:
      for stored in self._stored:
        stored.ref = None
      self._stored.clear()

  def __enter__(self) -> "ObjectStorePublisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _put(self, treedef, host: list[np.ndarray], version: int, record: PublishRecord) -> StoredWeights:
    start = time.perf_counter()
    tree = jax.tree_util.tree_unflatten(treedef, host)
    payload = tree if self.form == "params" else _hf_state_dict(self.cfg, tree)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(payload))
    ref = ray.put(payload)
    del payload, tree, host
    record.write_s = time.perf_counter() - start
    stored = StoredWeights(version, ref, nbytes, record.write_s)
    with self._lock:
      self._stored.append(stored)
      while len(self._stored) > self.keep:
        self._stored.popleft().ref = None
    return stored


def _hf_state_dict(cfg, params: Any) -> dict[str, np.ndarray]:
  """{HF name: HF-layout array} of host `params` (HF order; transposes in slabs, as the segment
  writer does; padding and layer stacking undone)."""
  out = {}
  for name, shape, transpose, source in hf_io.hf_sources(cfg, params):
    src = source()
    dst = np.empty(shape, src.dtype)
    shm_format.default_copy(dst, src, transpose)
    out[name] = dst
  return out
