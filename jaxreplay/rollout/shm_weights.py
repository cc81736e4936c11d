"""Shared-memory weight segments: HF-named, HF-layout tensors in one /dev/shm file per slot.

One segment holds one policy version of every HF tensor of the model, laid out as

  [0, 8)      magic b"JXRWSHM1"
  [8, 16)     header length H (little-endian uint64)
  [16, 16+H)  JSON header {"version": int, "tensors": [[name, dtype, shape, offset], ...],
              "data_bytes": int}; dtype is "float32" | "bfloat16" | "float16"; offset from the file
              start, 64-byte aligned
  data        from the first 4096-byte boundary after the header

so that a reader (a vLLM engine in another process, `rollout.vllm_transfer`) maps the file and
hands vLLM views of it: no (de)serialisation, one copy into the engine's own buffers.

Slots. `SlotRing` reuses a few files (pages of /dev/shm already allocated and mapped cost a plain
memcpy to overwrite; fresh ones cost ~5x that on a VM). A writer takes a slot with an exclusive
`flock`, a reader holds a shared one while it copies (`open_segment`), so a slot is never rewritten
under a reader; the writer never reuses the slots of the `protect`ed (newest) versions and makes a
new slot when every other one is being read. A reader that finds another version in the slot than
it was promised raises `StaleWeights` (its version was superseded `keep` times over).

numpy only (no JAX, no torch): the engine processes import this module.
"""
from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import struct
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import ml_dtypes  # bfloat16 for numpy
import numpy as np

MAGIC = b"JXRWSHM1"
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
_INVALID = -(2**62)  # the version field of a slot while it is being written

# (HF name, HF shape, transpose, source): source() is the tensor in the source layout; the HF
# tensor is source().T when transpose (`models.hf_io.hf_sources`).
Source = tuple[str, tuple[int, ...], bool, Callable[[], np.ndarray]]


class StaleWeights(RuntimeError):
  """The segment no longer holds the version the reader was promised (it was reused)."""


def _align(n: int, a: int) -> int:
  return -(-n // a) * a


def plan_layout(sources: Sequence[Source], dtype: str, version: int) -> tuple[bytes, int]:
  """(header bytes incl. magic and length, total file size) of a segment of `sources` in `dtype`."""
  if dtype not in DTYPES:
    raise ValueError(f"segment dtype {dtype!r}: expected one of {sorted(DTYPES)}")
  itemsize = DTYPES[dtype].itemsize
  sizes = [math.prod(shape) * itemsize for _, shape, _, _ in sources]
  data_start = DATA_ALIGN
  while True:  # a longer header moves the data, which lengthens the offsets: twice at most
    offset, tensors = data_start, []
    for (name, shape, _, _), size in zip(sources, sizes):
      tensors.append([name, dtype, list(shape), offset])
      offset = _align(offset + size, TENSOR_ALIGN)
    header = json.dumps({"version": int(version), "tensors": tensors,
                         "data_bytes": int(sum(sizes))}, separators=(",", ":")).encode()
    if 16 + len(header) <= data_start:
      return MAGIC + struct.pack("<Q", len(header)) + header, max(offset, data_start)
    data_start = _align(16 + len(header) + 64, DATA_ALIGN)


def parse_header(buf) -> dict[str, Any]:
  """The JSON header of a segment (`buf`: the mapped file, or its first bytes)."""
  if bytes(buf[:8]) != MAGIC:
    raise ValueError("not a jaxreplay weight segment (bad magic)")
  (length,) = struct.unpack("<Q", bytes(buf[8:16]))
  return json.loads(bytes(buf[16:16 + length]))


TRANSPOSE_SLAB_ROWS = 64  # measured here: 4.2x a memcpy at 1024 x 3072 f32, vs 11.7x unblocked


def default_copy(dst: np.ndarray, src: np.ndarray, transpose: bool) -> None:
  """dst[...] = src.T (transpose) or src, cast to dst's dtype. A 2-D transpose is copied in slabs of
  `TRANSPOSE_SLAB_ROWS` source rows, so that each destination row is written in runs of 64
  contiguous elements instead of one element per cache line (numpy's plain `.T` copy)."""
  if not transpose:
    np.copyto(dst, src, casting="unsafe")
  elif src.ndim != 2:
    np.copyto(dst, src.T, casting="unsafe")
  else:
    for i in range(0, src.shape[0], TRANSPOSE_SLAB_ROWS):
      np.copyto(dst[:, i:i + TRANSPOSE_SLAB_ROWS], src[i:i + TRANSPOSE_SLAB_ROWS].T,
                casting="unsafe")


class SlotRing:
  """The slot files `root/<prefix>-<k>.seg` of one publisher (see the module docstring).

  Args:
    root: a directory on /dev/shm (the publisher's, removed with it).
    prefix: file name prefix (one ring per publisher).
  """

  def __init__(self, root: str, prefix: str = "slot"):
    self.root, self.prefix = root, prefix
    self._slots: list[dict[str, Any]] = []  # {"path", "version", "size"}
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._slots)

  @property
  def paths(self) -> list[str]:
    return [s["path"] for s in self._slots]

  def reserve(self, protect: set[int]) -> "Reservation":
    """Takes a slot for the next write (the oldest that is neither `protect`ed, i.e. one of the
    newest versions workers may still load, nor being read; a new file when none is free)."""
    slot, fd = self._acquire(protect)
    return Reservation(self, slot, fd)

  def write(self, sources: Sequence[Source], dtype: str, version: int, protect: set[int],
            copy: Callable[[np.ndarray, np.ndarray, bool], None] = default_copy) -> tuple[str, int]:
    """`reserve` + `Reservation.fill`: returns (path, data bytes)."""
    return self.reserve(protect).fill(sources, dtype, version, copy)

  def _acquire(self, protect: set[int]) -> tuple[dict[str, Any], int]:
    with self._lock:
      for slot in sorted(self._slots, key=lambda s: s["version"]):
        if slot["version"] in protect or slot.get("reserved"):
          continue
        fd = os.open(slot["path"], os.O_RDWR)
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a reader holds it
          os.close(fd)
          continue
        slot["reserved"] = True
        return slot, fd
      path = os.path.join(self.root, f"{self.prefix}-{len(self._slots)}.seg")
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
      fcntl.flock(fd, fcntl.LOCK_EX)
      slot = {"path": path, "version": _INVALID, "size": 0, "reserved": True}
      self._slots.append(slot)
      return slot, fd

  def remove(self) -> None:
    """Deletes the slot files (a reader that has one mapped keeps its pages until it unmaps)."""
    with self._lock:
      for slot in self._slots:
        try:
          os.unlink(slot["path"])
        except FileNotFoundError:
          pass
      self._slots.clear()


class Reservation:
  """A slot taken by `SlotRing.reserve` (exclusively locked) until `fill` writes it."""

  def __init__(self, ring: SlotRing, slot: dict[str, Any], fd: int):
    self._ring, self._slot, self._fd = ring, slot, fd
    self.path = slot["path"]

  def fill(self, sources: Sequence[Source], dtype: str, version: int,
           copy: Callable[[np.ndarray, np.ndarray, bool], None] = default_copy) -> tuple[str, int]:
    """Writes `sources` (HF tensors) as `version` in `dtype`, releases the slot; returns (path,
    data bytes). The version field reads invalid until the last tensor is written."""
    if self._fd is None:
      raise RuntimeError("this reservation was already filled")
    slot, fd = self._slot, self._fd
    header, size = plan_layout(sources, dtype, version)
    meta = parse_header(header)
    try:
      slot["version"] = _INVALID
      if slot["size"] != size:
        os.ftruncate(fd, size)
        slot["size"] = size
      with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as mm:
        blob = json.dumps(meta | {"version": _INVALID}, separators=(",", ":")).encode()
        mm[:16 + len(blob)] = MAGIC + struct.pack("<Q", len(blob)) + blob
        for (name, shape, transpose, source), (_, _, _, offset) in zip(sources, meta["tensors"]):
          dst = np.frombuffer(mm, DTYPES[dtype], math.prod(shape), offset).reshape(shape)
          src = source()
          want = tuple(reversed(shape)) if transpose else tuple(shape)
          if tuple(src.shape) != want:
            raise ValueError(f"{name}: source shape {src.shape}, expected {want}")
          copy(dst, src, transpose)
          del dst
        mm[:len(header)] = header
      slot["version"] = int(version)
    finally:
      slot["reserved"] = False
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
      self._fd = None
    return self.path, int(meta["data_bytes"])


class SegmentReader:
  """A segment mapped for reading, under a shared lock (the writer cannot reuse it meanwhile).

  Use as a context manager; `tensors()` yields (HF name, read-only numpy view) in segment order.
  The views are valid until `close()`.

  Raises StaleWeights when the segment holds another version than `expected_version`.
  """

  def __init__(self, path: str, expected_version: Optional[int] = None):
    try:
      self._fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
      raise StaleWeights(f"weight segment {path!r} is gone (its publisher closed, or the run "
                         "ended)") from None
    self._mm = None
    try:
      fcntl.flock(self._fd, fcntl.LOCK_SH)  # waits while a writer rewrites this slot
      size = os.fstat(self._fd).st_size
      # Shared and read-only: MAP_POPULATE maps every page in one call (a private writable mapping
      # would copy each page on populate: a second copy of the model).
      self._mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
      self.header = parse_header(self._mm)
      self.version = int(self.header["version"])
      if expected_version is not None and self.version != int(expected_version):
        raise StaleWeights(f"weight segment {path!r} holds version {self.version}, not "
                           f"{expected_version}: that version was superseded; load a newer one")
    except BaseException:
      self.close()
      raise
    self.path = path

  def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
    for name, dtype, shape, offset in self.header["tensors"]:
      yield name, np.frombuffer(self._mm, DTYPES[dtype], math.prod(shape), offset).reshape(shape)

  @property
  def nbytes(self) -> int:
    return int(self.header["data_bytes"])

  def close(self) -> None:
    if self._mm is not None:
      try:
        self._mm.close()
      except BufferError:  # a view is still alive: unmapped when it is collected
        pass
      self._mm = None
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "SegmentReader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_segment(path: str, expected_version: Optional[int] = None) -> tuple[int, dict[str, np.ndarray]]:
  """(version, {HF name: a copy of the tensor}): the whole segment, for tests and tools."""
  with SegmentReader(path, expected_version) as seg:
    return seg.version, {name: np.array(x) for name, x in seg.tensors()}
