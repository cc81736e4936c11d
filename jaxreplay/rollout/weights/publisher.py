"""The weight-publisher contract: how every publisher hands the trainer's params to rollout workers.

A publisher has
  publish(params, version) -> Weights   the handle workers load (`RolloutWorker.load_weights`);
                                        versions strictly increase; `params` may be donated by the
                                        next train step as soon as it returns
  history: list[PublishRecord]          one record per publish, oldest first (`latest`: the newest)
  close()                               releases what it holds (slots, directories, object refs)
The publishers: `DeviceCopyPublisher` (here: device copies for in-process JAX samplers),
`shm_publisher.ShmPublisher` (shared-memory segments, vLLM engines), `file_publisher.FilePublisher`
(HF directories, vLLM engines) and `rollout.ray.publisher.ObjectStorePublisher` (Ray's object store).
The record of rollout.backend in `rollout.backend_table.BACKENDS` names one per (rollout.placement,
transport).

Publishers that write to /dev/shm keep their files under a root claimed here (`claim_root`): a
directory flock-ed for the publisher's life, removed at exit and by the next run after a kill.
"""
from __future__ import annotations

import atexit
import dataclasses
import fcntl
import os
import shutil
import tempfile
import time
from typing import Any, Optional, Protocol

from absl import logging
import jax
import jax.numpy as jnp

from jaxreplay.rollout.base import Weights


@dataclasses.dataclass
class PublishRecord:
  """One publish of any publisher.

  version: the policy version. nbytes: bytes of tensor data handed over. stall_s: seconds on the
  trainer's thread (what delays the next step, logged as `time/publish_s`). write_s: seconds of
  the part done in the background (segment write, object-store put), NaN until it is done; for a
  publisher that does everything on the trainer's thread, the write's share of stall_s.
  location: the segment path or HF directory ("" for device copies and object-store objects).
  """
  version: int
  nbytes: int
  stall_s: float
  write_s: float = float("nan")
  location: str = ""


class Publisher(Protocol):
  """What `RolloutBackend` and the benches use of a publisher (see the module docstring)."""
  history: list[PublishRecord]

  def publish(self, params: Any, version: int) -> Weights: ...

  def close(self) -> None: ...


class PublishHistory:
  """`history`, `latest` and the increasing-version check every publisher shares."""

  def __init__(self):
    self.history: list[PublishRecord] = []

  @property
  def latest(self) -> Optional[PublishRecord]:
    """The newest publish's record, or None."""
    return self.history[-1] if self.history else None

  def _check_newer(self, version: int) -> None:
    if self.history and version <= self.history[-1].version:
      raise ValueError(f"version {version} is not newer than the last published version "
                       f"{self.history[-1].version}; versions must increase")


class DeviceCopyPublisher(PublishHistory):
  """In-process JAX samplers: `Weights(params=...)` holding a device copy of the params (the train
  step donates its own buffers), no host round trip. `copy=False` hands the params over as they
  are (they are copies already: host-local gathers of a multi-process trainer)."""

  def __init__(self, cfg, copy: bool = True):
    super().__init__()
    self.cfg, self.copy = cfg, bool(copy)

  def publish(self, params: Any, version: int) -> Weights:
    version = int(version)
    self._check_newer(version)
    start = time.perf_counter()
    if self.copy:
      params = jax.tree.map(jnp.copy, params)
    nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    self.history.append(PublishRecord(version, nbytes, time.perf_counter() - start, 0.0))
    return Weights(version=version, params=params, cfg=self.cfg)

  def close(self) -> None:
    self.history.clear()


# ---- publisher roots (/dev/shm directories) ----------------------------------------------------

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
