"""Weight refresh over shared memory, off the trainer's critical path (rollout.weight_transport="shm").

`ShmPublisher.publish(params, version)` does on the trainer's thread only what must happen before
the next train step donates the params: the device -> host copy of every leaf (cast on device to
the engines' dtype first, e.g. bfloat16) into one of two reused host staging buffers. It returns a
`Weights` handle at once; a background thread then writes the HF-named, HF-layout tensors (names
and transposes from `models.layout.RULES`, through `hf_io.hf_sources`) into a shared-memory
segment (`shm_format`: a reused /dev/shm slot, no serialisation) and settles the handle's
`ready` future. The engines load the segment between two requests (`rollout.vllm.transfer`); a
worker whose newest target is not written yet keeps generating at the version it holds
(`WorkerPool`), and every group carries the version that generated it.

The trainer's stall per refresh (`PublishRecord.stall_s`, logged as `time/publish_s`) is the host
copy, plus a wait only when both staging buffers are still being written (two refreshes within
one segment write). On GPU the host copy is the device -> host transfer itself (`host_copies`
keeps the transfer's host arrays, no second copy on the trainer's thread); `--dry_run`'s plan.json
estimates it (`time.publish_stall_s`) against the step. `model_dir` holds config.json and generation_config.json (no weights) for
starting engines (`load_format="dummy"`, then the first segment).

`kernel_layout="jax"` (what CPU runs use: their engines re-pack every kernel from the trainer's
[in, out] layout anyway, `rollout.vllm.direct_load`) stores each kernel as the trainer holds it
(marked in the segment's header; readers still see HF names and shapes). Nothing is transposed
then, so the trainer's thread copies the params straight into the segment: one copy of the model
instead of two, no staging buffers, `ready` settled on return; `write_s` is part of `stall_s`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import shutil
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.models import hf_io
from jaxreplay.models import layout
from jaxreplay.models.config import ModelConfig
from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.base import Weights
from jaxreplay.rollout.weights.publisher import (PublishHistory, PublishRecord, claim_root,
                                                 release_root)

STAGING_BUFFERS = 2  # double-buffered: the trainer copies into one while the other is written
GIB = 1024 ** 3


class ShmSpaceError(RuntimeError):
  """/dev/shm (a publisher's root) has less free space than the slots a publisher may hold: a
  segment write past tmpfs's size would kill the process with SIGBUS mid-run."""


def size_text(nbytes: float) -> str:
  """A byte count for messages: GiB, or MiB below one GiB."""
  return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def check_space(root: str, need: int, detail: str, statvfs=None) -> None:
  """Raises `ShmSpaceError` naming the size needed and the fixes when the filesystem of `root`
  has less than `need` bytes free (`detail` says what needs them). `statvfs` replaces
  `os.statvfs` (tests)."""
  st = (statvfs or os.statvfs)(root)
  free = int(st.f_bavail) * int(st.f_frsize)
  if free >= need:
    return
  size = math.ceil((int(st.f_blocks) * int(st.f_frsize) + need - free) / GIB)
  raise ShmSpaceError(
      f"{root} has {size_text(free)} free but the weight publishers need {size_text(need)} "
      f"({detail}); writing past it would end the run with SIGBUS. Give the machine more shared "
      f"memory (docker run --shm-size={size}g, or a Kubernetes emptyDir with medium Memory "
      "mounted at /dev/shm), free space there (e.g. other runs' /dev/shm/jaxreplay-* roots), or "
      "keep fewer versions (--config.rollout.keep_versions=2, the least)")


def _cast_and_start_transfers(leaves: list[Any], dtype: Optional[str]) -> list[Any]:
  """`leaves` cast on device to `dtype` (None keeps each leaf's), every device -> host transfer
  started."""
  if dtype is not None:
    target = jnp.dtype(dtype)
    leaves = [x.astype(target) if isinstance(x, jax.Array) and x.dtype != target else x
              for x in leaves]
  for x in leaves:
    if isinstance(x, jax.Array):
      x.copy_to_host_async()
  return leaves


def _host_value_is_a_copy(x: Any) -> bool:
  """Whether `np.asarray(x)` is a host array of its own: the device -> host transfer of an array
  on an accelerator. On the CPU backend it is a zero-copy view of x's buffer, which the next train
  step may donate, so it must be copied out."""
  return isinstance(x, jax.Array) and all(d.platform != "cpu" for d in x.devices())


def host_copies(leaves: list[Any], dtype: Optional[str] = None,
                into: Optional[list[np.ndarray]] = None) -> list[np.ndarray]:
  """Host copies of `leaves` (jax arrays or numpy), cast on device to `dtype` first (None keeps
  each leaf's), every device -> host transfer in flight before the first wait. The copies never
  alias the leaves, so the train step may donate them next. A leaf on an accelerator (GPU) is the
  transfer's own host array, with no second copy on this (the trainer's) thread; the others (CPU
  backend, numpy) are copied into `into` (reused buffers) when its shapes match, else into new
  arrays. Returns the host arrays."""
  leaves = _cast_and_start_transfers(leaves, dtype)
  if into is None or [b.shape for b in into] != [tuple(x.shape) for x in leaves]:
    into = [None] * len(leaves)
  out = []
  for buf, x in zip(into, leaves):
    if _host_value_is_a_copy(x):
      out.append(np.asarray(x))
      continue
    if buf is None or not buf.flags.writeable:
      buf = np.empty(x.shape, jnp.dtype(dtype) if dtype is not None else x.dtype)
    np.copyto(buf, np.asarray(x), casting="unsafe")
    out.append(buf)
  return out


def host_views(leaves: list[Any], dtype: str) -> list[np.ndarray]:
  """Numpy arrays of `leaves` in `dtype` (cast on device first), every device -> host transfer in
  flight before the first wait. They may alias the leaves (zero-copy on the CPU backend): copy
  out of them before the leaves are donated."""
  target = jnp.dtype(dtype)
  return [np.asarray(x, dtype=target) for x in _cast_and_start_transfers(leaves, dtype)]


class ShmPublisher(PublishHistory):
  """Publishes successive parameter versions as shared-memory segments (see the module docstring).

  Args:
    cfg: the architecture (names, shapes and layouts come from its table).
    dtype: the engines' dtype ("float32", "bfloat16", "float16"); leaves are cast on device.
    root: the directory of the slots and `model_dir`; None makes a new /dev/shm one, removed on
      `close` or at exit (and by the next run when this process is killed).
    keep: the newest versions whose slots are never reused (>= 2: a worker may still be about to
      load version v while v + 1 is written).
    tokenizer_dir: its generation_config.json is kept in `model_dir` (every eos id).
    kernel_layout: "hf" (HF [out, in] kernels, transposed on the background thread) or "jax"
      (kernels stored in the trainer's [in, out] layout, written on the trainer's thread).
    reserve_bytes: more bytes the root's filesystem must hold besides this publisher's slots
      (another publisher's, e.g. the evaluation one); checked at start (`check_space`).
    statvfs: replaces `os.statvfs` in the space check (tests).
  """

  def __init__(self, cfg: ModelConfig, dtype: str = "float32", root: Optional[str] = None,
               keep: int = 3, tokenizer_dir: Optional[str] = None, kernel_layout: str = "hf",
               reserve_bytes: int = 0, statvfs=None):
    if kernel_layout not in ("hf", "jax"):
      raise ValueError(f"kernel_layout={kernel_layout!r}: expected 'hf' or 'jax'")
    self.kernel_layout = kernel_layout
    if keep < 2:
      raise ValueError(f"keep={keep} must be >= 2 (workers load version v while v + 1 is written)")
    if dtype not in shm_format.DTYPES:
      raise ValueError(f"dtype={dtype!r}: expected one of {sorted(shm_format.DTYPES)}")
    self.cfg, self.dtype, self.keep = cfg, dtype, int(keep)
    self._segment_bytes: Optional[int] = None
    self.root, self._owns_root, self._owner_fd = claim_root(root)
    try:
      check_space(self.root, self.bytes_needed(cfg, dtype, self.keep, kernel_layout) + reserve_bytes,
                  f"{self.max_slots(self.keep, kernel_layout)} slots of "
                  f"{size_text(self.slot_bytes(cfg, dtype))}: the newest {self.keep} versions" +
                  (" and one more written meanwhile" if kernel_layout == "hf" else "") +
                  (f", plus {size_text(reserve_bytes)} of another publisher's" if reserve_bytes
                   else ""), statvfs)
    except BaseException:
      release_root(self.root, self._owns_root, self._owner_fd)
      raise
    self.model_dir = os.path.join(self.root, "model")
    os.makedirs(self.model_dir, exist_ok=True)
    hf_io.write_config_files(cfg, self.model_dir, dtype, tokenizer_dir)
    self._ring = shm_format.SlotRing(self.root)
    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shm-publisher")
    self._lock = threading.Lock()
    self._staging_lock = threading.Lock()
    self._free = threading.Semaphore(STAGING_BUFFERS)
    self._staging: list[Optional[list[np.ndarray]]] = [None] * STAGING_BUFFERS
    self._staging_free = list(range(STAGING_BUFFERS))
    self._versions: list[int] = []
    self.history: list[PublishRecord] = []
    self._closed = False

  def publish(self, params: Any, version: int) -> Weights:
    """Hands `params` over as `version`; returns at once with a `Weights(shm_path=..., ready=...)`.

    Args:
      params: the parameter pytree (jax arrays, fully addressable, or numpy); may be donated by the
        next train step as soon as this returns.
      version: the policy version, greater than any published before.
    """
    version = int(version)
    start = time.perf_counter()
    with self._lock:
      if self._closed:
        raise RuntimeError("this ShmPublisher is closed")
      if self._versions and version <= self._versions[-1]:
        raise ValueError(f"version {version} is not newer than the last published version "
                         f"{self._versions[-1]}; versions must increase")
      protect = set(self._versions[-(self.keep - 1):]) if self.keep > 1 else set()
      if self.kernel_layout == "jax":
        record, future = self._write_now(params, version, protect, start)
      else:
        self._free.acquire()  # waits only when both staging buffers are being written
        with self._staging_lock:
          index = self._staging_free.pop()
        leaves, treedef = jax.tree_util.tree_flatten(params)
        host = self._copy_to_host(index, leaves)
        reservation = self._ring.reserve(protect)
        stall = time.perf_counter() - start
        record = PublishRecord(version, self._nbytes(), stall, location=reservation.path)
        future = self._executor.submit(self._write, reservation, treedef, host, index, version,
                                       record)
      self._versions.append(version)
      self.history.append(record)
    return Weights(version=version, shm_path=record.location, cfg=self.cfg, ready=future)

  def wait(self) -> None:
    """Blocks until every segment published so far is written."""
    self._executor.submit(lambda: None).result()

  def close(self) -> None:
    """Finishes pending writes, deletes the slots (and the root when it was the default one)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._executor.shutdown(wait=True)
    self._ring.remove()
    shutil.rmtree(self.model_dir, ignore_errors=True)
    release_root(self.root, self._owns_root, self._owner_fd)
    self._owner_fd = None

  def __enter__(self) -> "ShmPublisher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @staticmethod
  def slot_bytes(cfg: ModelConfig, dtype: str) -> int:
    """An upper bound of one segment's file size: its tensors in `dtype` plus the header and the
    alignment of each tensor (`shm_format.plan_layout`)."""
    shapes = [r.hf_shape(cfg) for _, r, _ in layout.entries(cfg)]
    data = sum(int(np.prod(s)) for s in shapes) * shm_format.DTYPES[dtype].itemsize
    return data + 2 * shm_format.DATA_ALIGN + len(shapes) * (shm_format.TENSOR_ALIGN + 256)

  @staticmethod
  def max_slots(keep: int, kernel_layout: str = "hf") -> int:
    """Slot files a publisher holds at most with no reader pinning an old one: the newest `keep`
    versions (one of them being written) and, for "hf", one more reserved while the previous
    write finishes (two staging buffers)."""
    return int(keep) + (1 if kernel_layout == "hf" else 0)

  @classmethod
  def bytes_needed(cls, cfg: ModelConfig, dtype: str, keep: int, kernel_layout: str = "hf") -> int:
    """The /dev/shm bytes a publisher of these settings may hold (`max_slots` x `slot_bytes`)."""
    return cls.max_slots(keep, kernel_layout) * cls.slot_bytes(cfg, dtype)

  def pending_bytes(self) -> int:
    """What this publisher may still allocate on its root's filesystem: `bytes_needed` less the
    slot files it has already filled (another publisher starting later must leave room for it)."""
    held = 0
    for path in self._ring.paths:
      try:
        held += os.stat(path).st_blocks * 512
      except FileNotFoundError:
        pass
    return max(0, self.bytes_needed(self.cfg, self.dtype, self.keep, self.kernel_layout) - held)

  # ---- helpers ------------------------------------------------------------------------------

  def _nbytes(self) -> int:
    """Bytes of tensor data in one segment (the HF tensors in `dtype`)."""
    if self._segment_bytes is None:
      shapes = [r.hf_shape(self.cfg) for _, r, _ in layout.entries(self.cfg)]
      self._segment_bytes = (sum(int(np.prod(s)) for s in shapes)
                             * shm_format.DTYPES[self.dtype].itemsize)
    return self._segment_bytes

  def _copy_to_host(self, index: int, leaves: list[Any]) -> list[np.ndarray]:
    """The trainer-side part: every leaf, cast on device, copied into staging buffer `index`."""
    self._staging[index] = host_copies(leaves, self.dtype, into=self._staging[index])
    return self._staging[index]

  def _write_now(self, params: Any, version: int, protect: set[int], start: float):
    """kernel_layout "jax": every leaf (cast on device) copied straight into a slot, on this
    thread. Returns (record, a settled future)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    host = host_views(leaves, self.dtype)
    reservation = self._ring.reserve(protect)
    write_start = time.perf_counter()
    sources = hf_io.hf_sources(self.cfg, jax.tree_util.tree_unflatten(treedef, host))
    path, _ = reservation.fill(sources, self.dtype, version, source_layout=True)
    now = time.perf_counter()
    record = PublishRecord(version, self._nbytes(), now - start, now - write_start, path)
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(path)
    return record, future

  def _write(self, reservation, treedef, host, index: int, version: int,
             record: PublishRecord) -> str:
    start = time.perf_counter()
    try:
      sources = hf_io.hf_sources(self.cfg, jax.tree_util.tree_unflatten(treedef, host))
      path, _ = reservation.fill(sources, self.dtype, version)
    finally:
      with self._staging_lock:
        self._staging_free.append(index)
      self._free.release()
    record.write_s = time.perf_counter() - start
    return path
