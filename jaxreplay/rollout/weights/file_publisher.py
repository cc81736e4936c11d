"""Weight refresh over files (rollout.weight_transport="file"): the trainer's parameters -> one HF
directory the rollout workers load in one RPC. The in-memory transport ("shm", the default) is
`shm_publisher`; both keep their versions under a root claimed by `publisher.claim_root`.

`FilePublisher.publish(params, version) -> Weights(hf_dir=...)` (the publisher contract of
`publisher.py`) moves the whole parameter pytree to the host in one batched transfer
(`jax.device_get` of the tree, not one call per tensor), writes it with `models.save_hf` (one
safetensors file, written under a temporary name and renamed into place, so a worker never sees a
partial directory) to `root/v{version}`, and keeps the newest `keep` versions. The root defaults
to a new `/dev/shm/jaxreplay-<pid>-<random>` (RAM-backed, shared by the worker processes of this
machine) and falls back to a temporary directory where /dev/shm is absent.
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

from jaxreplay.models.config import ModelConfig
from jaxreplay.models.hf_io import save_hf
from jaxreplay.rollout.base import Weights
from jaxreplay.rollout.weights.publisher import (PublishHistory, PublishRecord,  # noqa: F401
                                                 claim_root, default_root, release_root,
                                                 remove_stale_roots)

class FilePublisher(PublishHistory):
  """Writes successive parameter versions as HF directories `root/v{version}`.

  Args:
    cfg: the architecture (config.json).
    dtype: None writes the params' dtype; else the tensors are cast (e.g. "bfloat16").
    root: the directory holding the versions; None uses `default_root()` and deletes it on `close`
      (or at interpreter exit). A given root is kept on `close` (only the version directories
      written here are pruned).
    keep: how many of the newest versions stay on disk (>= 1). Keep >= 2 when workers apply a
      refresh lazily: a worker may still be reading version v while v+1 is being written.
    tokenizer_dir: tokenizer files to copy alongside (vLLM runs without them here).
  """

  def __init__(self, cfg: Optional[ModelConfig] = None, dtype=None, root: Optional[str] = None,
               keep: int = 2, tokenizer_dir: Optional[str] = None):
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1 (the newest version must stay on disk)")
    super().__init__()
    self.cfg, self.dtype, self.tokenizer_dir = cfg, dtype, tokenizer_dir
    self.root, self._owns_root, self._owner_fd = claim_root(root)
    self.keep = int(keep)
    self._lock = threading.Lock()
    self._kept: list[PublishRecord] = []  # the versions on disk

  @property
  def last_publish_seconds(self) -> float:
    """Host transfer + write seconds of the newest publish (0.0 before the first)."""
    return self.latest.stall_s if self.latest else 0.0

  def version_dir(self, version: int) -> str:
    return os.path.join(self.root, f"v{int(version)}")

  def publish(self, params: Any, version: int) -> Weights:
    """Writes `params` (jax arrays, possibly sharded, or numpy) as `version` (greater than any
    published before); returns `Weights(version, hf_dir=root/v{version})`, written and ready."""
    record = self._write(self.cfg, params, version, self.tokenizer_dir, self.dtype)
    return Weights(version=record.version, hf_dir=record.location, cfg=self.cfg)

  def _write(self, cfg, params, version: int, tokenizer_dir, dtype) -> PublishRecord:
    if cfg is None:
      raise ValueError("FilePublisher needs the architecture: FilePublisher(cfg, ...)")
    version = int(version)
    with self._lock:
      self._check_newer(version)
      start = time.perf_counter()
      host = jax.device_get(params)  # One batched device -> host transfer of the whole tree.
      transferred = time.perf_counter()
      out_dir = self.version_dir(version)
      save_hf(cfg, host, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
      done = time.perf_counter()
      leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(host)]
      nbytes = sum(x.size * (x.dtype if dtype is None else jnp.dtype(dtype)).itemsize for x in leaves)
      record = PublishRecord(version, nbytes, stall_s=done - start, write_s=done - transferred,
                             location=out_dir)
      self._kept.append(record)
      self.history.append(record)
      while len(self._kept) > self.keep:
        shutil.rmtree(self._kept.pop(0).location, ignore_errors=True)
    return record

  def close(self) -> None:
    """Deletes the versions written here (and the root when it was the default one)."""
    with self._lock:
      for record in self._kept:
        shutil.rmtree(record.location, ignore_errors=True)
      self._kept.clear()
      release_root(self.root, self._owns_root, self._owner_fd)
      self._owner_fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class WeightPublisher(FilePublisher):
  """The interface from before the publisher contract, kept for its callers:
  `WeightPublisher(root=None, keep=2).publish(cfg, params, version, tokenizer_dir=None, dtype=None)
  -> hf_dir` (the architecture and dtype per call; returns the directory, not a `Weights`)."""

  def __init__(self, root: Optional[str] = None, keep: int = 2):
    super().__init__(None, None, root=root, keep=keep)

  def publish(self, cfg: ModelConfig, params: Any, version: int,  # pylint: disable=arguments-differ
              tokenizer_dir: Optional[str] = None, dtype=None) -> str:
    return self._write(cfg, params, version, tokenizer_dir, dtype).location
