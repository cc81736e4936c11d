"""The shared-memory segment format (`rollout.weights.shm_format`, numpy only): the slab transpose
copy, copies split over threads, a reader's cached mapping of a replaced slot file."""
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxreplay.rollout.weights import shm_format


@pytest.mark.parametrize("shape", [(130, 70), (64, 3), (1, 200), (200, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_copy_transposes_in_slabs_exactly(shape, dtype):
  """The slab-blocked transpose equals numpy's `.T` (row counts off the slab size, casts)."""
  src = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  want = np.ascontiguousarray(src.T).astype(shm_format.DTYPES[dtype])
  dst = np.empty(tuple(reversed(shape)), shm_format.DTYPES[dtype])
  shm_format.default_copy(dst, src, transpose=True)
  np.testing.assert_array_equal(dst.view(np.uint8), want.view(np.uint8))
  flat = np.empty(shape, np.float32)
  shm_format.default_copy(flat, src, transpose=False)
  np.testing.assert_array_equal(flat, src)


def test_copies_split_across_threads_equal_one_copy():
  """A slot written by several copy threads in pieces (tensors larger than COPY_CHUNK_BYTES)
  equals the sources, in both layouts; a second write reuses the slot's mapping."""
  rng = np.random.default_rng(0)
  kernel = rng.standard_normal((300, 40)).astype(np.float32)  # JAX [in, out]
  vector = rng.standard_normal(5000).astype(np.float32)
  sources = [("a.b.w", (40, 300), True, lambda: kernel), ("a.b.v", (5000,), False, lambda: vector)]
  root = os.path.join("/dev/shm", f"jaxreplay-test-copies-{os.getpid()}")
  os.makedirs(root)
  ring = shm_format.SlotRing(root, copy_threads=3)
  old = shm_format.COPY_CHUNK_BYTES, shm_format.PARALLEL_COPY_MIN_BYTES
  shm_format.COPY_CHUNK_BYTES, shm_format.PARALLEL_COPY_MIN_BYTES = 1024, 0  # many pieces
  try:
    for source_layout in (False, True):
      path, nbytes = ring.write(sources, "float32", 1, set(), source_layout=source_layout)
      mapping = ring._slots[0]["mm"]  # pylint: disable=protected-access
      _, got = shm_format.read_segment(path, 1)
      np.testing.assert_array_equal(got["a.b.w"], kernel.T)
      np.testing.assert_array_equal(got["a.b.v"], vector)
      assert nbytes == (kernel.size + vector.size) * 4
    assert ring._slots[0]["mm"] is mapping  # pylint: disable=protected-access
  finally:
    shm_format.COPY_CHUNK_BYTES, shm_format.PARALLEL_COPY_MIN_BYTES = old
    ring.remove()
    os.rmdir(root)


def test_reader_mapping_follows_a_replaced_slot_file():
  """Readers keep a slot's mapping between loads; a slot file removed and made again at the same
  path (a new publisher in the same root) is read afresh, never through the old mapping."""
  root = os.path.join("/dev/shm", f"jaxreplay-test-remap-{os.getpid()}")
  os.makedirs(root)
  try:
    for value in (1.0, 2.0, 3.0):
      ring = shm_format.SlotRing(root)
      tensor = np.full((64,), value, np.float32)
      path, _ = ring.write([("x", (64,), False, lambda t=tensor: t)], "float32", 7, set())
      assert path.endswith("slot-0.seg")
      np.testing.assert_array_equal(shm_format.read_segment(path, 7)[1]["x"], tensor)
      np.testing.assert_array_equal(shm_format.read_segment(path, 7)[1]["x"], tensor)
      ring.remove()
  finally:
    os.rmdir(root)
