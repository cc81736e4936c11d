"""LoRA refreshes: only the adapters travel to the rollout workers (model.lora_rank > 0).

Both publishers follow the contract of `publisher.py` (publish(params, version) -> Weights, history,
close); their `params` are the train state's adapters (`models.lora`), and `rollout.backends` picks
them from its tables under the transport "lora":

  `AdapterDeviceCopyPublisher` (JAX samplers in this process): `Weights(params=...)` = the frozen
    base with a device copy of the adapters attached (`lora.attach`). The sampler applies the
    adapters in its forward instead of merging them once per version: the base is shared with the
    trainer (never donated, never copied), a refresh copies megabytes, and the sampler runs the
    trainer's own function, so its log-probs match the trainer's to float rounding. The price is
    the rank-r matmuls of every step (r (in + out) / (in out) of a kernel's FLOPs: 8-13% on the
    tiny model at r=8, under 1% on Qwen3-8B at r=16).
  `AdapterDirPublisher` (vLLM engines of this machine): each version is an adapter directory in
    PEFT's format (`lora.write_peft`: adapter_config.json + adapter_model.safetensors, the format of
    the WORKDIR/hf_adapter export) under a /dev/shm root, written on the trainer's thread under a
    temporary name and renamed into place; the engine registers it through vLLM's own LoRA support
    as a new adapter id per version (`VllmEngine.load_weights`, `Weights.lora_dir`). The newest
    `keep` directories stay; a worker asked to load an older, deleted one raises `StaleWeights`.

`BaseModelDir` is the HF directory the engines start from: model.path itself (the checkpoint the
trainer loaded its frozen base from), or for a preset base one save_hf of it in the engines' dtype.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import lora as lora_lib
from jaxreplay.models.config import ModelConfig
from jaxreplay.models.hf_io import save_hf
from jaxreplay.rollout.base import Weights
from jaxreplay.rollout.weights.publisher import (PublishHistory, PublishRecord, claim_root,
                                                 release_root)


def _nbytes(tree: Any, dtype: Optional[str] = None) -> int:
  return sum(int(np.size(x)) * (jnp.dtype(dtype) if dtype else x.dtype).itemsize
             for x in jax.tree.leaves(tree))


class AdapterDeviceCopyPublisher(PublishHistory):
  """In-process JAX samplers under LoRA (see the module docstring). `base`: the run's
  `learner.adapters.FrozenBase` (its `params` and `model_params(adapters)`)."""

  def __init__(self, cfg: ModelConfig, base: Any):
    super().__init__()
    self.cfg, self.base = cfg, base

  def publish(self, params: Any, version: int) -> Weights:
    version = int(version)
    self._check_newer(version)
    start = time.perf_counter()
    adapters = jax.tree.map(jnp.copy, params)  # the train step donates its own buffers
    self.history.append(PublishRecord(version, _nbytes(adapters), time.perf_counter() - start, 0.0))
    return Weights(version=version, params=self.base.model_params(adapters), cfg=self.cfg)

  def close(self) -> None:
    self.history.clear()


class AdapterDirPublisher(PublishHistory):
  """Successive adapter versions as PEFT directories `root/v{version}` (see the module docstring).

  Args:
    cfg: the architecture (tensor names). spec: the adapters' `LoraSpec` (adapter_config.json).
    dtype: the tensors' dtype in the files (the engines' dtype: vLLM's lora_dtype "auto").
    root: None makes a new /dev/shm root, removed on `close` (and by the next run after a kill).
    keep: the newest versions kept on disk (>= 2: a worker may load v while v + 1 is written).
    base_model_name_or_path: written into adapter_config.json.
  """

  def __init__(self, cfg: ModelConfig, spec: lora_lib.LoraSpec, dtype: str = "float32",
               root: Optional[str] = None, keep: int = 3, base_model_name_or_path: str = ""):
    if keep < 2:
      raise ValueError(f"keep={keep} must be >= 2 (workers load version v while v + 1 is written)")
    super().__init__()
    self.cfg, self.spec, self.dtype, self.keep = cfg, spec, dtype, int(keep)
    self.base_model_name_or_path = base_model_name_or_path
    self.root, self._owns_root, self._owner_fd = claim_root(root)
    self._lock = threading.Lock()
    self._kept: list[str] = []

  def version_dir(self, version: int) -> str:
    return os.path.join(self.root, f"v{int(version)}")

  def publish(self, params: Any, version: int) -> Weights:
    """Writes the adapters `params` as `version`; returns `Weights(version, lora_dir=...)`, written
    and ready (the whole write is on the caller's thread: `stall_s`, of which `write_s` the files)."""
    version = int(version)
    with self._lock:
      self._check_newer(version)
      start = time.perf_counter()
      host = jax.device_get(params)  # one batched device -> host transfer
      write_start = time.perf_counter()
      out = self.version_dir(version)
      tmp = os.path.join(self.root, f".v{version}.tmp")
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      try:
        nbytes = lora_lib.write_peft(tmp, self.cfg, self.spec, host, self.base_model_name_or_path,
                                     dtype=self.dtype)
        os.rename(tmp, out)  # a reader never sees a partial directory
      except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
      now = time.perf_counter()
      self.history.append(PublishRecord(version, nbytes, now - start, now - write_start, out))
      self._kept.append(out)
      while len(self._kept) > self.keep:
        shutil.rmtree(self._kept.pop(0), ignore_errors=True)
    return Weights(version=version, lora_dir=out, cfg=self.cfg)

  def close(self) -> None:
    with self._lock:
      for path in self._kept:
        shutil.rmtree(path, ignore_errors=True)
      self._kept.clear()
      release_root(self.root, self._owns_root, self._owner_fd)
      self._owner_fd = None

  def __enter__(self) -> "AdapterDirPublisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class BaseModelDir:
  """The HF directory LoRA engines start from (see the module docstring): `path` is `base_path`
  when given, else a save_hf of `base_params` (the trainer's frozen base, on any devices) in
  `dtype` under a new /dev/shm root, written on first use of `path` and removed by `close`."""

  def __init__(self, cfg: ModelConfig, base_params: Any, base_path: str = "",
               dtype: str = "float32"):
    self.cfg, self._params, self.base_path, self.dtype = cfg, base_params, base_path, dtype
    self._root = None

  @property
  def path(self) -> str:
    if self.base_path:
      return self.base_path
    if self._root is None:
      root, owns, fd = claim_root(None)
      try:
        save_hf(self.cfg, jax.device_get(self._params), os.path.join(root, "base"),
                dtype=self.dtype)
      except BaseException:
        release_root(root, owns, fd)
        raise
      self._root = (root, owns, fd)
    return os.path.join(self._root[0], "base")

  def close(self) -> None:
    if self._root is not None:
      release_root(*self._root)
      self._root = None
