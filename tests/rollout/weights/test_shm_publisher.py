"""Tests of the shared-memory weight transport: the segment round trip (names, dtypes, shapes,
values; bf16), the publisher's stall (only the host copy: the segment is written in the background),
version tags and slot reuse, stale segments removed after a killed run, the pool serving at the held
version while the newest one is written, and vLLM engines refreshed through shared memory (same
log-probs as through the file path, also in a worker process)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import chex
import jax
import ml_dtypes
import numpy as np
import pytest

from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.models import hf_io
from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.base import SamplingParams, Weights
from jaxreplay.rollout.pool import WorkerPool
from jaxreplay.rollout.weights.shm_publisher import ShmPublisher
from jaxreplay.rollout.weights.file_publisher import FilePublisher
from jaxreplay.rollout.weights.publisher import remove_stale_roots
from tests.helpers.deps import require
from tests.helpers.paths import REPO

TINY = presets.tiny()
# Untied, with q/k/v biases and no q/k norms: every optional rule of the table.
QWEN2 = presets.tiny(model_type="qwen2", tie_word_embeddings=False, attention_bias=True,
                     qk_norm=False)


@pytest.mark.parametrize("kernel_layout", ["hf", "jax"])
@pytest.mark.parametrize("cfg", [TINY, QWEN2], ids=["qwen3_tied", "qwen2_untied_bias"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segment_round_trip_names_dtypes_shapes_values(cfg, dtype, kernel_layout):
  """Either kernel layout reads back as the HF state dict (names, order, [out, in] shapes)."""
  params = transformer.init_params(cfg, jax.random.key(0))
  reference = hf_io.to_hf_state_dict(cfg, jax.device_get(params))
  with ShmPublisher(cfg, dtype, kernel_layout=kernel_layout) as pub:
    weights = pub.publish(params, 3)
    weights.wait(30)
    version, tensors = shm_format.read_segment(weights.shm_path, 3)
    assert os.path.dirname(weights.shm_path) == pub.root and pub.root.startswith("/dev/shm/")
    assert sorted(os.listdir(pub.model_dir)) == ["config.json", "generation_config.json"]
  assert version == 3
  assert list(tensors) == hf_io.hf_names(cfg) == list(reference)  # HF names, HF order
  want = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
  for name, ref in reference.items():
    got = tensors[name]
    assert got.dtype == want and got.shape == ref.shape, name  # HF layout: [out, in]
    np.testing.assert_array_equal(got, ref.astype(want), err_msg=name)
  assert pub.latest.nbytes == sum(x.size for x in reference.values()) * want.itemsize


def test_jax_layout_stores_one_module_s_kernels_side_by_side():
  """kernel_layout "jax": q/k/v/o_proj (same input size) share one row-major [in, 384] block in
  column order, gate/up share another, down_proj (other input size) and non-kernels stand alone;
  each HF view is a strided view of its block."""
  params = transformer.init_params(TINY, jax.random.key(0))
  with ShmPublisher(TINY, "float32", kernel_layout="jax") as pub:
    weights = pub.publish(params, 0)
    with shm_format.SegmentReader(weights.shm_path, 0) as reader:
      entries = {e[0]: e for e in reader.header["tensors"]}
      views = dict(reader.tensors())
      attn = "model.layers.0.self_attn."
      q, k, v, o = (entries[attn + f"{n}_proj.weight"] for n in "qkvo")
      assert [e[4] for e in (q, k, v, o)] == [128 + 64 + 64 + 128] * 4
      assert [e[3] - q[3] for e in (q, k, v, o)] == [0, 128 * 4, 192 * 4, 256 * 4]
      gate, up, down = (entries[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
      assert gate[4] == up[4] == 2 * 384 and up[3] - gate[3] == 384 * 4
      assert down[4] == 128 and len(entries["model.layers.0.input_layernorm.weight"]) == 4
      assert views[attn + "k_proj.weight"].shape == (64, 128)
      assert views[attn + "k_proj.weight"].strides == (4, 384 * 4)  # the [in, out] kernel's .T
      assert not views[attn + "k_proj.weight"].flags.writeable


def test_jax_layout_writes_on_the_trainer_thread_and_survives_donation():
  """kernel_layout "jax": publish returns with the segment written (no staging copy, no
  background write), so the params may be donated at once."""
  params = transformer.init_params(TINY, jax.random.key(1))
  reference = hf_io.to_hf_state_dict(TINY, jax.device_get(params))
  with ShmPublisher(TINY, "float32", kernel_layout="jax") as pub:
    weights = pub.publish(params, 1)
    assert weights.is_ready()
    record = pub.latest
    assert 0 < record.write_s <= record.stall_s
    for leaf in jax.tree_util.tree_leaves(params):
      leaf.delete()
    _, tensors = shm_format.read_segment(weights.shm_path, 1)
  for name, ref in reference.items():
    np.testing.assert_array_equal(tensors[name], ref, err_msg=name)
  with pytest.raises(ValueError, match="kernel_layout"):
    ShmPublisher(TINY, "float32", kernel_layout="torch")


def test_publish_returns_after_the_host_copy_and_survives_donation(monkeypatch):
  """The segment write is held back: publish still returns (the trainer goes on), the handle is
  not ready, and the params may be deleted (donated) at once; the segment holds them all the same."""
  params = transformer.init_params(TINY, jax.random.key(1))
  reference = hf_io.to_hf_state_dict(TINY, jax.device_get(params))
  release = threading.Event()
  fill = shm_format.Reservation.fill

  def slow_fill(self, *args, **kwargs):
    assert release.wait(30)
    return fill(self, *args, **kwargs)

  monkeypatch.setattr(shm_format.Reservation, "fill", slow_fill)
  with ShmPublisher(TINY, "float32") as pub:
    pub.publish(params, 0)  # compiles nothing more later; release it and go on
    release.set()
    pub.wait()
    release.clear()
    start = time.perf_counter()
    weights = pub.publish(params, 1)
    stall = time.perf_counter() - start
    assert not weights.is_ready()
    for leaf in jax.tree_util.tree_leaves(params):
      leaf.delete()  # what the next train step's donation does
    assert stall < 0.5 and pub.latest.stall_s <= stall
    assert np.isnan(pub.latest.write_s)
    release.set()
    weights.wait(30)
    assert weights.is_ready() and pub.latest.write_s > 0
    _, tensors = shm_format.read_segment(weights.shm_path, 1)
  for name, ref in reference.items():
    np.testing.assert_array_equal(tensors[name], ref, err_msg=name)


def test_versions_are_tagged_and_newest_slots_never_reused():
  params = transformer.init_params(TINY, jax.random.key(0))
  with ShmPublisher(TINY, "float32", keep=2) as pub:
    w1 = pub.publish(params, 1)
    w2 = pub.publish(params, 2)
    with pytest.raises(ValueError, match="versions must increase"):
      pub.publish(params, 2)
    pub.wait()
    assert w1.shm_path != w2.shm_path
    # w2's slot is protected (newest); w1's is free: v3 reuses it, and v1 is gone.
    w3 = pub.publish(params, 3)
    w3.wait(30)
    assert w3.shm_path == w1.shm_path
    with pytest.raises(shm_format.StaleWeights, match="holds version 3, not 1"):
      shm_format.read_segment(w1.shm_path, 1)
    # A slot being read is never rewritten: with w3's being read, v4 gets a new slot.
    with shm_format.SegmentReader(w2.shm_path, 2) as reader:
      w4 = pub.publish(params, 4)
      w4.wait(30)
      assert w4.shm_path not in (w2.shm_path, w3.shm_path)
      assert reader.version == 2
    assert shm_format.read_segment(w4.shm_path, 4)[0] == 4
    assert Weights(4, shm_path=w4.shm_path, cfg=TINY) == w4  # `ready` is not compared
    assert w4.portable().ready is None and w4.portable().shm_path == w4.shm_path


def test_segments_of_a_killed_run_are_removed_and_a_normal_exit_leaves_none(tmp_path):
  """A publisher killed with SIGKILL leaves its /dev/shm root behind; the next publisher's
  default root removes it (its owner lock is free). One that exits without close() removes its
  own at exit. A live publisher's root is kept."""
  script = textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {REPO!r})
      import jax
      from jaxreplay.models import presets
      from jaxreplay.models import transformer
      from jaxreplay.rollout.weights.shm_publisher import ShmPublisher
      cfg = presets.tiny()
      pub = ShmPublisher(cfg, "float32")
      pub.publish(transformer.init_params(cfg, jax.random.key(0)), 0).wait()
      print(pub.root, flush=True)
      if sys.argv[1] == "hang":
        time.sleep(600)
      """)
  path = tmp_path / "publisher.py"
  path.write_text(script)
  exits = subprocess.run([sys.executable, str(path), "exit"], capture_output=True, text=True,
                         timeout=300, check=True)
  assert not os.path.exists(exits.stdout.strip())  # atexit removed it
  proc = subprocess.Popen([sys.executable, str(path), "hang"], stdout=subprocess.PIPE, text=True)
  try:
    root = proc.stdout.readline().strip()
    assert os.path.isdir(root) and any(n.endswith(".seg") for n in os.listdir(root))
    assert root not in remove_stale_roots("/dev/shm")  # alive: kept
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert os.path.isdir(root)  # a killed run leaves it
    with ShmPublisher(TINY, "float32"):  # default_root() clears the dead run's segments first
      assert not os.path.exists(root)
  finally:
    proc.kill()
    proc.stdout.close()


# ---- vLLM engines -------------------------------------------------------------------------------
