"""Weight refresh over files (rollout.weight_transport="file"): the trainer's parameters -> one HF
directory the rollout workers load in one RPC. The in-memory transport ("shm", the default) is
`rollout.shm_publisher`; both keep their versions under a root made here.

`WeightPublisher.publish` moves the whole parameter pytree to the host in one batched transfer
(`jax.device_get` of the tree, not one call per tensor), writes it with `models.save_hf` (one
safetensors file, written under a temporary name and renamed into place, so a worker never sees a
partial directory) to `root/v{version}`, and keeps the newest `keep` versions. The root defaults
to a new `/dev/shm/jaxreplay-<pid>-<random>` (RAM-backed, shared by the worker processes of this
machine) and falls back to a temporary directory where /dev/shm is absent.
"""
from __future__ import annotations

import atexit
import dataclasses
import fcntl
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models.config import ModelConfig
from jaxreplay.models.hf_io import save_hf

@dataclasses.dataclass(frozen=True)
class PublishRecord:
  """One publish: where, which version, bytes of tensor data written, and seconds."""
  hf_dir: str
  version: int
  nbytes: int
  transfer_seconds: float
  write_seconds: float

  @property
  def seconds(self) -> float:
    return self.transfer_seconds + self.write_seconds


OWNER_FILE = ".owner"  # flock-ed by the publisher for its life: a free lock means a dead owner


def _owner_alive(path: str) -> bool:
  """Whether the publisher of root `path` still runs: it holds an flock on path/.owner for its
  life (works across PID namespaces sharing /dev/shm, e.g. containers with --ipc=host)."""
  try:
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY)
  except FileNotFoundError:
    return None  # a root written before owner files: decided by its pid
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return False  # nobody holds it
  except OSError:
    return True
  finally:
    os.close(fd)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def remove_stale_roots(parent: str) -> list[str]:
  """Deletes `parent/jaxreplay-<pid>-*` directories whose publisher is dead (a run killed with -9
  never reaches its exit handler, and /dev/shm is RAM); returns the removed paths. Directories of
  live publishers (other runs on this machine, or in other containers sharing /dev/shm) are kept:
  liveness is the flock on their `.owner` file, not the pid, which another PID namespace reuses."""
  removed = []
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    parts = name.split("-")
    if len(parts) < 3 or parts[0] != "jaxreplay" or not parts[1].isdigit():
      continue
    path = os.path.join(parent, name)
    if int(parts[1]) == os.getpid() or not os.path.isdir(path):
      continue
    alive = _owner_alive(path)
    if alive or (alive is None and _pid_alive(int(parts[1]))):
      continue
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
      removed.append(path)
  if removed:
    logging.info("removed %d weight directories left by dead runs: %s", len(removed),
                 ", ".join(removed))
  return removed


def default_root() -> str:
  """A new directory `/dev/shm/jaxreplay-<pid>-<random>` when /dev/shm is a writable directory,
  else a new temporary directory. New per call: two publishers never delete each other's files.
  Directories left by dead processes are removed first (`remove_stale_roots`)."""
  shm = "/dev/shm"
  if os.path.isdir(shm) and os.access(shm, os.W_OK):
    remove_stale_roots(shm)
    return tempfile.mkdtemp(prefix=f"jaxreplay-{os.getpid()}-", dir=shm)
  remove_stale_roots(tempfile.gettempdir())
  return tempfile.mkdtemp(prefix=f"jaxreplay-{os.getpid()}-")


def claim_root(root: Optional[str]) -> tuple[str, bool, Optional[int]]:
  """(absolute root, owned, owner fd) of a publisher: `root` as given (created, kept on close), or
  a new `default_root()` that the publisher owns: flock-ed through its `.owner` file for the
  publisher's life (how `remove_stale_roots` tells a live one) and removed at interpreter exit
  (/dev/shm is RAM: nothing stays behind when close() is skipped)."""
  owns = root is None
  root = os.path.abspath(root or default_root())
  os.makedirs(root, exist_ok=True)
  owner_fd = None
  if owns:
    owner_fd = os.open(os.path.join(root, OWNER_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(owner_fd, fcntl.LOCK_SH)
    atexit.register(shutil.rmtree, root, True)
  return root, owns, owner_fd


def release_root(root: str, owns: bool, owner_fd: Optional[int]) -> None:
  """Undoes `claim_root`: drops the owner lock and removes the root when the publisher owns it."""
  if owner_fd is not None:
    os.close(owner_fd)
  if owns:
    shutil.rmtree(root, ignore_errors=True)


class PublishHistory:
  """`history` (one record per publish, oldest first; set by the subclass) and `latest`: what the
  shared-memory and object-store publishers report to the run's metrics and benches."""

  history: list

  @property
  def latest(self):
    """The newest publish's record, or None."""
    return self.history[-1] if self.history else None


class WeightPublisher:
  """Writes successive parameter versions as HF directories `root/v{version}`.

  Args:
    root: the directory holding the versions; None uses `default_root()` and deletes it on `close`
      (or at interpreter exit).
      A given root is kept on `close` (only the version directories written here are pruned).
    keep: how many of the newest versions stay on disk (>= 1). Keep >= 2 when workers apply a
      refresh lazily: a worker may still be reading version v while v+1 is being written.
  """

  def __init__(self, root: Optional[str] = None, keep: int = 2):
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1 (the newest version must stay on disk)")
    self.root, self._owns_root, self._owner_fd = claim_root(root)
    self.keep = int(keep)
    self._lock = threading.Lock()
    self._published: list[PublishRecord] = []
    self.history: list[PublishRecord] = []

  @property
  def latest(self) -> Optional[PublishRecord]:
    """The newest publish, or None."""
    return self._published[-1] if self._published else None

  @property
  def last_publish_seconds(self) -> float:
    """Host transfer + write seconds of the newest publish (0.0 before the first)."""
    return self.latest.seconds if self.latest else 0.0

  def version_dir(self, version: int) -> str:
    return os.path.join(self.root, f"v{int(version)}")

  def publish(self, cfg: ModelConfig, params: Any, version: int,
              tokenizer_dir: Optional[str] = None, dtype=None) -> str:
    """Writes `params` as version `version`; returns its directory `root/v{version}`.

    Args:
      cfg: the architecture (config.json).
      params: the parameter pytree (jax arrays, possibly sharded, or numpy).
      version: the policy version (an int greater than any published before).
      tokenizer_dir: tokenizer files to copy alongside (vLLM runs without them here).
      dtype: None writes the params' dtype; else the tensors are cast (e.g. "bfloat16").
    Returns:
      The absolute path of the new HF directory.
    """
    version = int(version)
    with self._lock:
      if self._published and version <= self._published[-1].version:
        raise ValueError(f"version {version} is not newer than the last published version "
                         f"{self._published[-1].version}; versions must increase")
      start = time.perf_counter()
      host = jax.device_get(params)  # One batched device -> host transfer of the whole tree.
      transferred = time.perf_counter()
      out_dir = self.version_dir(version)
      save_hf(cfg, host, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
      done = time.perf_counter()
      leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(host)]
      nbytes = sum(x.size * (x.dtype if dtype is None else jnp.dtype(dtype)).itemsize for x in leaves)
      record = PublishRecord(hf_dir=out_dir, version=version, nbytes=nbytes,
                             transfer_seconds=transferred - start, write_seconds=done - transferred)
      self._published.append(record)
      self.history.append(record)
      self._prune()
    return out_dir

  def close(self) -> None:
    """Deletes the versions written here (and the root when it was the default one)."""
    with self._lock:
      for record in self._published:
        shutil.rmtree(record.hf_dir, ignore_errors=True)
      self._published.clear()
      release_root(self.root, self._owns_root, self._owner_fd)
      self._owner_fd = None

  def __enter__(self) -> "WeightPublisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _prune(self) -> None:
    while len(self._published) > self.keep:
      old = self._published.pop(0)
      shutil.rmtree(old.hf_dir, ignore_errors=True)
