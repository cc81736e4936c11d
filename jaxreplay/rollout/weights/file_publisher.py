"""Weight refresh over files (rollout.weight_transport="file"): the trainer's parameters -> one HF
directory the rollout workers load in one RPC. The in-memory transport ("shm", the default) is
`shm_publisher`; both keep their versions under a root claimed by `publisher.claim_root`.

`FilePublisher.publish(params, version) -> Weights(hf_dir=...)` (the publisher contract of
`publisher.py`) moves the whole parameter pytree to the host in one batched transfer
(`jax.device_get` of the tree, not one call per tensor), writes it with `hf_io.save_hf` (one
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
from jaxreplay.rollout.weights.publisher import (PublishHistory, PublishRecord, claim_root,
                                                 release_root)


class FilePublisher(PublishHistory):
  """Writes successive parameter versions as HF directories `root/v{version}`.

  Args:
    cfg: the architecture (config.json).
    dtype: None writes the params' dtype; else the tensors are cast (e.g. "bfloat16").
    root: the directory holding the versions; None uses `publisher.default_root()` and deletes it
      on `close` (or at interpreter exit). A given root is kept on `close` (only the version
      directories written here are pruned).
    keep: how many of the newest versions stay on disk (>= 1). Keep >= 2 when workers apply a
      refresh lazily: a worker may still be reading version v while v+1 is being written.
    tokenizer_dir: tokenizer files to copy alongside (vLLM runs without them here).
  """

  def __init__(self, cfg: ModelConfig, dtype=None, root: Optional[str] = None, keep: int = 2,
               tokenizer_dir: Optional[str] = None):
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1 (the newest version must stay on disk)")
    super().__init__()
    self.cfg, self.dtype, self.tokenizer_dir = cfg, dtype, tokenizer_dir
    self.root, self._owns_root, self._owner_fd = claim_root(root)
    self.keep = int(keep)
    self._lock = threading.Lock()
    self._kept: list[PublishRecord] = []  # the versions on disk

  def version_dir(self, version: int) -> str:
    return os.path.join(self.root, f"v{int(version)}")

  def publish(self, params: Any, version: int) -> Weights:
    """Writes `params` (jax arrays, possibly sharded, or numpy) as `version` (greater than any
    published before); returns `Weights(version, hf_dir=root/v{version})`, written and ready.
    The record's stall_s is the whole publish, its write_s the save after the host transfer."""
    version = int(version)
    with self._lock:
      self._check_newer(version)
      start = time.perf_counter()
      host = jax.device_get(params)  # One batched device -> host transfer of the whole tree.
      transferred = time.perf_counter()
      out_dir = self.version_dir(version)
      save_hf(self.cfg, host, out_dir, tokenizer_dir=self.tokenizer_dir, dtype=self.dtype)
      done = time.perf_counter()
      leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(host)]
      itemsize = lambda x: (x.dtype if self.dtype is None else jnp.dtype(self.dtype)).itemsize
      record = PublishRecord(version, sum(x.size * itemsize(x) for x in leaves),
                             stall_s=done - start, write_s=done - transferred, location=out_dir)
      self._kept.append(record)
      self.history.append(record)
      while len(self._kept) > self.keep:
        shutil.rmtree(self._kept.pop(0).location, ignore_errors=True)
    return Weights(version=version, hf_dir=out_dir, cfg=self.cfg)

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

