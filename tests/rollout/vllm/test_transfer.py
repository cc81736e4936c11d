"""vLLM engines refreshed through shared memory (`rollout.vllm.transfer`, the weight-transfer
engine `jaxreplay_shm`): the same log-probs as through the file path, a superseded segment refused,
the CPU direct re-pack (`rollout.vllm.direct_load`) equal to vLLM's generic reload, and a worker
process of the rollout backend fed segments."""
import os

import chex
import jax
import numpy as np
import pytest

from jaxreplay.models import hf_io
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout.base import SamplingParams, Weights
from jaxreplay.rollout.weights import shm_format
from jaxreplay.rollout.weights.file_publisher import FilePublisher
from jaxreplay.rollout.weights.shm_publisher import ShmPublisher
from tests.helpers.deps import require

TINY = presets.tiny()
# Untied, with q/k/v biases and no q/k norms: every optional rule of the table.
QWEN2 = presets.tiny(model_type="qwen2", tie_word_embeddings=False, attention_bias=True,
                     qk_norm=False)


PROMPTS = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10, 11, 12, 13], np.int32)]


def _generate_fixed(engine, sampling):
  """The same requests (same seeds) whatever the engine generated before."""
  engine._calls = 0  # pylint: disable=protected-access
  return engine.generate(PROMPTS, 3, sampling)


@pytest.mark.slow
def test_engine_refreshed_through_shm_matches_the_file_path(tmp_path):
  require("vllm")
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from tests.helpers.engine_logprobs import logprob_diffs  # pylint: disable=g-import-not-at-top
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
  bf16 engines to bf16 rounding). On a CPU with AMX tiles vLLM multiplies bf16 weights with its
  SGL kernel, not oneDNN (vLLM's own `check_cpu_sgl_kernel`): there the direct load must not apply
  and every refresh takes the generic reload, with the same outputs."""
  require("vllm")
  import torch  # pylint: disable=g-import-not-at-top
  from vllm.model_executor.layers.utils import check_cpu_sgl_kernel  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from tests.helpers.engine_logprobs import logprob_diffs  # pylint: disable=g-import-not-at-top
  shapes = [(cfg.hidden_size, cfg.intermediate_size), (2 * cfg.intermediate_size, cfg.hidden_size)]
  direct_expected = 0.0 if any(check_cpu_sgl_kernel(n, k, getattr(torch, dtype))
                               for n, k in shapes) else 1.0
  params = [transformer.init_params(cfg, jax.random.key(s)) for s in (0, 1)]
  sampling = SamplingParams(max_tokens=16)
  tolerance = 1e-3 if dtype == "float32" else 5e-2
  with ShmPublisher(cfg, dtype, keep=2, kernel_layout="jax") as jax_layout, \
      ShmPublisher(cfg, dtype, keep=2, kernel_layout="hf") as hf_layout:
    engine = VllmEngine(jax_layout.model_dir, weights_pending=True, max_model_len=128,
                        max_num_seqs=32, dtype=dtype)
    try:
      assert engine.load_weights(jax_layout.publish(params[0], 0))["direct"] == direct_expected
      assert logprob_diffs(_generate_fixed(engine, sampling), params[0], cfg).max() < tolerance
      engine.direct_load = False
      assert engine.load_weights(hf_layout.publish(params[1], 1))["direct"] == 0.0
      generic = _generate_fixed(engine, sampling)
      engine.direct_load = True
      engine.load_weights(jax_layout.publish(params[0], 2))  # away and back
      phases = engine.load_weights(jax_layout.publish(params[1], 3))
      assert phases["direct"] == direct_expected
      assert not direct_expected or 0 < phases["repack_s"] <= phases["load_s"]
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
      assert engine._llm.collective_rpc(probe) == [(bool(direct_expected), True)]  # pylint: disable=protected-access
    finally:
      engine.close()


@pytest.mark.slow
def test_worker_process_through_the_rollout_backend_uses_shm():
  """`RolloutBackend` (vllm, transport shm): the worker process starts from the config-only dir,
  loads the published segment, and a refresh after the trainer's params changed lands."""
  require("vllm")
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  from tests.helpers.engine_logprobs import logprob_diffs  # pylint: disable=g-import-not-at-top
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
