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
from conftest import require

TINY = presets.tiny()
# Untied, with q/k/v biases and no q/k norms: every optional rule of the table.
QWEN2 = presets.tiny(model_type="qwen2", tie_word_embeddings=False, attention_bias=True,
                     qk_norm=False)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


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


def test_pool_serves_at_the_held_version_until_the_newest_is_written():
  from concurrent.futures import Future  # pylint: disable=g-import-not-at-top
  from test_pool import Recorder, check_complete, make_pool  # pylint: disable=g-import-not-at-top
  rec, workers = Recorder(), {}
  pool = make_pool(rec, workers, num_workers=1).start()
  try:
    pool.wait_ready(10)
    pending = Future()
    pool.refresh(Weights(1, shm_path="/dev/shm/none", ready=pending))
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 4)
    assert workers[0][0].updates == []  # never waited for (nor loaded) the unwritten version
    assert all(d.policy_version == 0 for d in rec.deliveries)
    assert pool.metrics()["deferred_refreshes"] >= 4
    pending.set_result("/dev/shm/none")
    pool.wait_for_version(1, 10)
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 2)
    for d in rec.deliveries:
      check_complete(d)
    assert rec.deliveries[-1].policy_version == 1
    pool.raise_if_failed()
  finally:
    pool.stop()


def test_pool_retries_a_superseded_load_at_the_newest_version():
  """A worker asked for version 1 whose slot was reused by 4 (the trainer published `keep` newer
  versions meanwhile) gets StaleWeights from its engine; it must load the newest, not fail."""
  from test_pool import FakeWorker, Recorder, check_complete  # pylint: disable=g-import-not-at-top
  rec, workers, pool_box = Recorder(), {}, []

  class Superseded(FakeWorker):
    def load_weights(self, weights):
      if weights.version == 1:
        pool_box[0].refresh(Weights(4, hf_dir="/weights/v4"))  # published while this one loaded
        raise shm_format.StaleWeights("slot of version 1 holds version 4")
      super().load_weights(weights)

  def make_worker(i):
    workers.setdefault(i, []).append(Superseded(i))
    return workers[i][-1]
  pool = WorkerPool(make_worker, 1, rec.source, rec.sink, on_drop=rec.on_drop,
                    restart_backoff_s=0.01, idle_sleep_s=0.01)
  pool_box.append(pool)
  pool.start()
  try:
    pool.wait_ready(10)
    pool.refresh(Weights(1, hf_dir="/weights/v1"))
    pool.wait_for_version(4, 10)
    mark = len(rec.deliveries)
    rec.wait_for(lambda ds: len(ds) >= mark + 2)
    for d in rec.deliveries:
      check_complete(d)
    assert workers[0][0].updates == [("/weights/v4", 4)]
    assert rec.deliveries[-1].policy_version == 4
    assert pool.metrics()["superseded_loads"] == 1
    pool.raise_if_failed()
  finally:
    pool.stop()


# ---- vLLM engines -------------------------------------------------------------------------------

PROMPTS = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10, 11, 12, 13], np.int32)]


def _generate_fixed(engine, sampling):
  """The same requests (same seeds) whatever the engine generated before."""
  engine._calls = 0  # pylint: disable=protected-access
  return engine.generate(PROMPTS, 3, sampling)


@pytest.mark.slow
def test_engine_refreshed_through_shm_matches_the_file_path(tmp_path):
  require("vllm")
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from test_vllm_worker import logprob_diffs  # pylint: disable=g-import-not-at-top
  params = [transformer.init_params(TINY, jax.random.key(s)) for s in (0, 1)]
  sampling = SamplingParams(max_tokens=16)  # temperature 1: log-probs comparable with the JAX forward
  with ShmPublisher(TINY, "float32", keep=2) as shm, FilePublisher(TINY, root=str(tmp_path)) as files:
    engine = VllmEngine(shm.model_dir, weights_pending=True, max_model_len=128, max_num_seqs=32)
    try:
      with pytest.raises(RuntimeError, match="weights_pending"):
        engine.generate(PROMPTS, 1, sampling)
      phases = engine.load_weights(shm.publish(params[0], 0))
      assert phases["bytes"] == shm.latest.nbytes and phases["repack_s"] <= phases["load_s"]
      assert logprob_diffs(_generate_fixed(engine, sampling), params[0]).max() < 1e-3
      engine.load_weights(files.publish(params[1], 1))
      by_file = _generate_fixed(engine, sampling)
      engine.load_weights(shm.publish(params[0], 2))  # away and back: a real refresh
      engine.load_weights(shm.publish(params[1], 3))
      by_shm = _generate_fixed(engine, sampling)
      assert all(g.policy_version == 1 for g in by_file) and all(g.policy_version == 3 for g in by_shm)
      for a, b in zip(by_file, by_shm):
        for ca, cb in zip(a.completions, b.completions):
          np.testing.assert_array_equal(ca.tokens, cb.tokens)
          np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-6)
      assert logprob_diffs(by_shm, params[1]).max() < 1e-3
      # A superseded segment is refused and the engine keeps the weights it had.
      stale = Weights(2, shm_path=shm.history[-2].location)
      shm.publish(params[0], 4).wait(30)
      shm.publish(params[0], 5).wait(30)
      assert shm_format.read_segment(stale.shm_path)[0] == 4  # keep=2: v2's slot went to v4
      with pytest.raises(shm_format.StaleWeights, match="holds version 4, not 2"):
        engine.load_weights(stale)
      assert engine.policy_version == 3
      chex.assert_trees_all_close(
          [c.logprobs for g in _generate_fixed(engine, sampling) for c in g.completions],
          [c.logprobs for g in by_shm for c in g.completions], atol=1e-6)
    finally:
      engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("cfg,dtype", [(TINY, "float32"), (QWEN2, "float32"), (TINY, "bfloat16")],
                         ids=["qwen3_tied", "qwen2_untied_bias", "qwen3_tied_bf16"])
def test_direct_cpu_load_equals_vllm_generic_reload(cfg, dtype):
  """CPU engines re-pack each linear layer straight from the segment (`rollout.vllm.direct_load`): from
  a trainer-layout segment (q/k/v side by side: no copy) and from an HF-layout one, the engine
  generates exactly what vLLM's generic layerwise reload gives, and matches the JAX forward (f32;
  bf16 engines to bf16 rounding)."""
  require("vllm")
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from test_vllm_worker import logprob_diffs  # pylint: disable=g-import-not-at-top
  params = [transformer.init_params(cfg, jax.random.key(s)) for s in (0, 1)]
  sampling = SamplingParams(max_tokens=16)
  tolerance = 1e-3 if dtype == "float32" else 5e-2
  with ShmPublisher(cfg, dtype, keep=2, kernel_layout="jax") as jax_layout, \
      ShmPublisher(cfg, dtype, keep=2, kernel_layout="hf") as hf_layout:
    engine = VllmEngine(jax_layout.model_dir, weights_pending=True, max_model_len=128,
                        max_num_seqs=32, dtype=dtype)
    try:
      assert engine.load_weights(jax_layout.publish(params[0], 0))["direct"] == 1.0
      assert logprob_diffs(_generate_fixed(engine, sampling), params[0], cfg).max() < tolerance
      engine.direct_load = False
      assert engine.load_weights(hf_layout.publish(params[1], 1))["direct"] == 0.0
      generic = _generate_fixed(engine, sampling)
      engine.direct_load = True
      engine.load_weights(jax_layout.publish(params[0], 2))  # away and back
      phases = engine.load_weights(jax_layout.publish(params[1], 3))
      assert phases["direct"] == 1.0 and 0 < phases["repack_s"] <= phases["load_s"]
      direct = _generate_fixed(engine, sampling)
      engine.load_weights(hf_layout.publish(params[1], 4))  # HF rows side by side: direct too
      direct_hf = _generate_fixed(engine, sampling)
      for other in (direct, direct_hf):
        for a, b in zip(generic, other):
          for ca, cb in zip(a.completions, b.completions):
            np.testing.assert_array_equal(ca.tokens, cb.tokens)
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-6)
      assert logprob_diffs(direct, params[1], cfg).max() < tolerance
      # A segment that does not fill every linear layer (here: no k_proj) gets no direct plan.
      names = hf_io.hf_names(cfg)

      def probe(worker):
        from jaxreplay.rollout.vllm import direct_load  # pylint: disable=g-import-not-at-top
        model = worker.model_runner.get_model()
        partial = [n for n in names if "k_proj.weight" not in n]
        return (direct_load.plan(model, names) is not None,
                direct_load.plan(model, partial) is None)
      assert engine._llm.collective_rpc(probe) == [(True, True)]  # pylint: disable=protected-access
    finally:
      engine.close()


@pytest.mark.slow
def test_worker_process_through_the_rollout_backend_uses_shm():
  """`RolloutBackend` (vllm, transport shm): the worker process starts from the config-only dir,
  loads the published segment, and a refresh after the trainer's params changed lands."""
  require("vllm")
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  from test_vllm_worker import logprob_diffs  # pylint: disable=g-import-not-at-top
  c = defaults.base_config()
  c.rollout.backend, c.model.max_len, c.rollout.vllm_max_num_seqs = "vllm", 128, 32
  assert c.rollout.weight_transport == "shm"
  params = [transformer.init_params(TINY, jax.random.key(s)) for s in (0, 1)]
  backend = backends.RolloutBackend(c, TINY, stop_ids=(2,))
  worker = None
  try:
    w0 = backend.publish(params[0], 0)
    assert w0.hf_dir is None and w0.shm_path is not None
    worker = backend.make_worker(0, w0)
    assert worker.policy_version == 0
    groups = worker.generate(PROMPTS, 2, SamplingParams(max_tokens=12))
    assert all(g.policy_version == 0 for g in groups)
    assert logprob_diffs(groups, params[0]).max() < 1e-3
    phases = worker.load_weights(backend.publish(params[1], 1))
    assert set(phases) >= {"load_s", "repack_s", "finalize_s", "total_s"}
    groups = worker.generate(PROMPTS, 2, SamplingParams(max_tokens=12))
    assert all(g.policy_version == 1 for g in groups)
    assert logprob_diffs(groups, params[1]).max() < 1e-3
    root = backend.publisher.root
  finally:
    if worker is not None:
      worker.close(timeout_s=30)
    backend.close()
  assert not os.path.exists(root)
