"""Shared-memory weight segments: HF-named, HF-layout tensors in one /dev/shm file per slot.

One segment holds one policy version of every HF tensor of the model, laid out as

  [0, 8)      magic b"JXRWSHM1"
  [8, 16)     header length H (little-endian uint64)
  [16, 16+H)  JSON header {"version": int, "tensors": [[name, dtype, shape, offset(, 1)], ...],
              "data_bytes": int}; dtype is "float32" | "bfloat16" | "float16"; offset from the file
              start, 64-byte aligned; a fifth element R marks a 2-D HF [out, in] tensor stored as
              the trainer's [in, out] kernel: row-major with a row stride of R elements (R > out
              when kernels of one module with the same input size are stored side by side, e.g.
              q/k/v/o_proj: columns [0, out_q) are q_proj's, then k_proj's, ...; the writer copies
              them without transposing, and an engine that fuses q/k/v reads one strided matrix)
  data        from the first 4096-byte boundary after the header

so that a reader (a vLLM engine in another process, `rollout.vllm.transfer`) maps the file and
hands vLLM views of it: no (de)serialisation, one copy into the engine's own buffers. The reader's
view of a transposed tensor has the HF shape (a strided view), so names and shapes are HF's either way.

Slots. `SlotRing` reuses a few files (pages of /dev/shm already allocated and mapped cost a plain
memcpy to overwrite; fresh ones cost ~5x that on a VM). A writer takes a slot with an exclusive
`flock`, a reader holds a shared one while it copies (`open_segment`), so a slot is never rewritten
under a reader; the writer never reuses the slots of the `protect`ed (newest) versions and makes a
new slot when every other one is being read. A reader that finds another version in the slot than
it was promised raises `StaleWeights` (its version was superseded `keep` times over).

numpy only (no JAX, no torch): the engine processes import this module.
"""
from __future__ import annotations

import concurrent.futures
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

from jaxreplay.rollout.base import StaleWeights  # noqa: F401  (raised here; re-exported)

MAGIC = b"JXRWSHM1"
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}
_INVALID = -(2**62)  # the version field of a slot while it is being written

# (HF name, HF shape, transpose, source): source() is the tensor in the source layout; the HF
# tensor is source().T when transpose (`models.hf_io.hf_sources`).
Source = tuple[str, tuple[int, ...], bool, Callable[[], np.ndarray]]


def _align(n: int, a: int) -> int:
  return -(-n // a) * a


def _kernel_groups(sources: Sequence[Source], source_layout: bool) -> list[list[int]]:
  """Indices of `sources` in storage groups: consecutive 2-D tensors stored as [in, out] kernels
  (`source_layout` and transposed) of one module (the name up to its last two parts) with the same
  input size share a group (stored side by side); every other tensor is a group of its own."""
  groups: list[list[int]] = []
  key_of_last = None
  for i, (name, shape, transpose, _) in enumerate(sources):
    key = None
    if source_layout and transpose and len(shape) == 2:
      key = (name.rsplit(".", 2)[0], int(shape[1]))
    if key is not None and key == key_of_last:
      groups[-1].append(i)
    else:
      groups.append([i])
    key_of_last = key
  return groups


def plan_layout(sources: Sequence[Source], dtype: str, version: int,
                source_layout: bool = False) -> tuple[bytes, int]:
  """(header bytes incl. magic and length, total file size) of a segment of `sources` in `dtype`;
  `source_layout`: tensors whose source is their transpose are stored as the source is, the
  kernels of one module side by side (`_kernel_groups`)."""
  if dtype not in DTYPES:
    raise ValueError(f"segment dtype {dtype!r}: expected one of {sorted(DTYPES)}")
  itemsize = DTYPES[dtype].itemsize
  sizes = [math.prod(shape) * itemsize for _, shape, _, _ in sources]
  groups = _kernel_groups(sources, source_layout)
  data_start = DATA_ALIGN
  while True:  # a longer header moves the data, which lengthens the offsets: twice at most
    offset, tensors = data_start, [None] * len(sources)
    for group in groups:
      name, shape, transpose, _ = sources[group[0]]
      if not (source_layout and transpose and len(shape) == 2):
        tensors[group[0]] = [name, dtype, list(shape), offset]
        offset = _align(offset + sizes[group[0]], TENSOR_ALIGN)
        continue
      row = sum(int(sources[i][1][0]) for i in group)  # [in, row] kernels side by side
      column = 0
      for i in group:
        tensors[i] = [sources[i][0], dtype, list(sources[i][1]), offset + column * itemsize, row]
        column += int(sources[i][1][0])
      offset = _align(offset + sum(sizes[i] for i in group), TENSOR_ALIGN)
    header = json.dumps({"version": int(version), "tensors": tensors,
                         "data_bytes": int(sum(sizes))}, separators=(",", ":")).encode()
    if 16 + len(header) <= data_start:
      return MAGIC + struct.pack("<Q", len(header)) + header, max(offset, data_start)
    data_start = _align(16 + len(header) + 64, DATA_ALIGN)


def tensor_view(buf, entry: list) -> np.ndarray:
  """The HF-shaped view of one header `entry` in the mapped segment `buf` (a strided view of the
  stored kernel for an entry with a row stride)."""
  _, dtype, shape, offset = entry[:4]
  dt = DTYPES[dtype]
  if len(entry) < 5:
    return np.frombuffer(buf, dt, math.prod(shape), offset).reshape(shape)
  out, inp = int(shape[0]), int(shape[1])
  row = int(entry[4])
  flat = np.frombuffer(buf, dt, (inp - 1) * row + out, offset)
  kernel = np.lib.stride_tricks.as_strided(flat, (inp, out), (row * dt.itemsize, dt.itemsize))
  return kernel.T


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

  def __init__(self, root: str, prefix: str = "slot", copy_threads: Optional[int] = None):
    self.root, self.prefix = root, prefix
    self._slots: list[dict[str, Any]] = []  # {"path", "version", "size", "mm"}
    self._lock = threading.Lock()
    # Two or more threads: a single core's plain stores reach about half the memcpy floor on
    # multi-MB pieces (glibc's non-temporal stores start only at tens of MB).
    self.copy_threads = int(copy_threads or min(4, os.cpu_count() or 1))
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

  def _mapping(self, slot: dict[str, Any], fd: int, size: int) -> mmap.mmap:
    """The slot's writable mapping of `size` bytes, kept between writes (mapping and populating a
    model-sized file again costs about half a memcpy of it)."""
    mm = slot.get("mm")
    if slot["size"] != size or mm is None or mm.closed:
      _close_mapping(mm)
      if slot["size"] != size:
        os.ftruncate(fd, size)
        if size > slot["size"]:
          try:  # a full tmpfs fails here (ENOSPC), not with SIGBUS at a page of the mapping
            os.posix_fallocate(fd, 0, size)
          except OSError as e:
            raise OSError(e.errno, f"cannot allocate {size / 2**30:.2f} GiB for weight slot "
                          f"{slot['path']} ({e.strerror}); give /dev/shm more space (docker run "
                          "--shm-size) or keep fewer versions (rollout.keep_versions)") from e
        slot["size"] = size
      mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
      slot["mm"] = mm
    return mm

  def _run_copies(self, tasks, copy) -> None:
    total = sum(src.nbytes for _, src, _ in tasks)
    if self.copy_threads <= 1 or len(tasks) <= 1 or total < PARALLEL_COPY_MIN_BYTES:
      for dst, src, transpose in tasks:
        copy(dst, src, transpose)
      return
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.copy_threads,
                                                         thread_name_prefix="segment-copy")
    for future in [self._pool.submit(copy, *task) for task in tasks]:
      future.result()

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
            copy: Callable[[np.ndarray, np.ndarray, bool], None] = default_copy,
            source_layout: bool = False) -> tuple[str, int]:
    """`reserve` + `Reservation.fill`: returns (path, data bytes)."""
    return self.reserve(protect).fill(sources, dtype, version, copy, source_layout)

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
      if self._pool is not None:
        self._pool.shutdown(wait=True)
        self._pool = None
      for slot in self._slots:
        _close_mapping(slot.pop("mm", None))
        try:
          os.unlink(slot["path"])
        except FileNotFoundError:
          pass
      self._slots.clear()


def _close_mapping(mm: Optional[mmap.mmap]) -> None:
  if mm is not None and not mm.closed:
    try:
      mm.close()
    except BufferError:  # a view is still alive: unmapped when it is collected
      pass


class Reservation:
  """A slot taken by `SlotRing.reserve` (exclusively locked) until `fill` writes it."""

  def __init__(self, ring: SlotRing, slot: dict[str, Any], fd: int):
    self._ring, self._slot, self._fd = ring, slot, fd
    self.path = slot["path"]

  def fill(self, sources: Sequence[Source], dtype: str, version: int,
           copy: Callable[[np.ndarray, np.ndarray, bool], None] = default_copy,
           source_layout: bool = False) -> tuple[str, int]:
    """Writes `sources` (HF tensors) as `version` in `dtype`, releases the slot; returns (path,
    data bytes). The version field reads invalid until the last tensor is written.
    `source_layout`: a 2-D tensor whose source is its transpose is stored as the source is
    (a plain copy; marked in the header, read back as an HF-shaped view)."""
    if self._fd is None:
      raise RuntimeError("this reservation was already filled")
    slot, fd = self._slot, self._fd
    header, size = plan_layout(sources, dtype, version, source_layout)
    meta = parse_header(header)
    try:
      slot["version"] = _INVALID
      mm = self._ring._mapping(slot, fd, size)  # pylint: disable=protected-access
      blob = json.dumps(meta | {"version": _INVALID}, separators=(",", ":")).encode()
      mm[:16 + len(blob)] = MAGIC + struct.pack("<Q", len(blob)) + blob
      tasks = []
      for (name, shape, transpose, source), entry in zip(sources, meta["tensors"]):
        stored = len(entry) > 4
        dst = tensor_view(mm, entry)
        if stored:
          dst = dst.T  # the [in, out] kernel, as the source holds it
        src = source()
        want = tuple(reversed(shape)) if transpose else tuple(shape)
        if tuple(src.shape) != want:
          raise ValueError(f"{name}: source shape {src.shape}, expected {want}")
        tasks.extend(_chunks(dst, src, transpose and not stored))
      self._ring._run_copies(tasks, copy)  # pylint: disable=protected-access
      del dst, tasks
      mm[:len(header)] = header
      slot["version"] = int(version)
    finally:
      slot["reserved"] = False
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)
      self._fd = None
    return self.path, int(meta["data_bytes"])


COPY_CHUNK_BYTES = 4 << 20  # tensors are copied in pieces of about this size, by several threads
PARALLEL_COPY_MIN_BYTES = 8 << 20  # below this a thread hand-off costs more than it saves


def _chunks(dst: np.ndarray, src: np.ndarray, transpose: bool):
  """(dst piece, src piece, transpose) pieces of one copy, split along the source's first axis."""
  rows = src.shape[0] if src.ndim else 1
  per_row = max(1, src.nbytes // max(rows, 1))
  step = max(1, COPY_CHUNK_BYTES // per_row)
  if src.ndim == 0 or rows <= step:
    return [(dst, src, transpose)]
  if transpose:
    return [(dst[:, i:i + step], src[i:i + step], True) for i in range(0, rows, step)]
  return [(dst[i:i + step], src[i:i + step], False) for i in range(0, rows, step)]


class _ReadMappings:
  """Read-only mappings of slot files, kept between loads (a reader that loads every version
  from the same few slots would otherwise map and populate a model-sized file per load, about
  half a memcpy of it). A mapping is reused while its path names the same file (device, inode,
  size); one whose file is gone or replaced is dropped at the next `get`."""

  LIMIT = 8

  def __init__(self):
    self._lock = threading.Lock()
    self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}

  def get(self, path: str, fd: int) -> mmap.mmap:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size)
    with self._lock:
      for other, (other_key, mm) in list(self._maps.items()):
        try:
          current = os.stat(other)
          alive = (current.st_dev, current.st_ino, current.st_size) == other_key
        except FileNotFoundError:
          alive = False
        if not alive or (other == path and other_key != key):
          del self._maps[other]
          _close_mapping(mm)
      if path in self._maps:
        return self._maps[path][1]
      # Shared and read-only: MAP_POPULATE maps every page in one call (a private writable mapping
      # would copy each page on populate: a second copy of the model).
      mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ)
      if len(self._maps) >= self.LIMIT:
        oldest = next(iter(self._maps))
        _close_mapping(self._maps.pop(oldest)[1])
      self._maps[path] = (key, mm)
      return mm

  def clear(self) -> None:
    with self._lock:
      for _, mm in self._maps.values():
        _close_mapping(mm)
      self._maps.clear()


_READ_MAPPINGS = _ReadMappings()


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
      self._mm = _READ_MAPPINGS.get(path, self._fd)
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
    """(HF name, read-only HF-shaped view) per tensor; a kernel stored in the trainer's layout is
    a strided view (`tensor_view`)."""
    for entry in self.header["tensors"]:
      yield entry[0], tensor_view(self._mm, entry)

  @property
  def mapping(self) -> mmap.mmap:
    """The read-only mapping of the whole segment (valid until `close()`)."""
    return self._mm

  @property
  def address_range(self) -> tuple[int, int]:
    """(address, bytes) of the mapping: a tensor inside it is a view of the segment."""
    view = np.frombuffer(self._mm, np.uint8, 1)
    address = int(view.ctypes.data)
    del view
    return address, len(self._mm)

  @property
  def nbytes(self) -> int:
    return int(self.header["data_bytes"])

  def close(self) -> None:
    """Releases the lock (the slot may be rewritten from now on); the mapping stays cached."""
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
