"""Tests of the vLLM backend against the JAX model: its log-probs are those of the JAX forward (also
after a weight refresh through FilePublisher, and for requests continued across one by a partial
pool), sampling filters follow the "processed" semantics, and the engine in its own process
generates and reports its death."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout import base
from jaxreplay.rollout.base import SamplingParams, Weights
from jaxreplay.rollout.vllm.engine import (VllmEngine, VllmWorkerProcess, WorkerDied,
                                           request_seed)
from jaxreplay.rollout.vllm import worker_side
from jaxreplay.rollout.weights.file_publisher import FilePublisher
from tests.helpers.deps import require
from tests.helpers.engine_logprobs import jax_logprobs_many, logprob_diffs, padded, pairs_of
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow  # vLLM engines start in seconds each

CFG = presets.tiny()
PROMPTS = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10, 11, 12, 13], np.int32),
           np.array([1, 40], np.int32)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  require("vllm")
  params = [transformer.init_params(CFG, jax.random.key(s)) for s in (0, 1)]
  publisher = FilePublisher(CFG, root=str(tmp_path_factory.mktemp("weights")), keep=10)
  v0 = publisher.publish(params[0], version=0).hf_dir
  start = time.perf_counter()
  engine = VllmEngine(v0, max_model_len=128, max_num_seqs=64, seed=0)
  print(f"\nvLLM in-process engine start-up: {time.perf_counter() - start:.1f} s")
  yield engine, params, publisher
  engine.close()
  publisher.close()


def publish_next(publisher, params):
  """The HF directory of the next version."""
  return publisher.publish(params, version=publisher.latest.version + 1).hf_dir


def jax_logits_many(params, pairs):
  """transformer.apply logits predicting each completion token: a list of f32 [L, V]."""
  seqs = [np.concatenate([g.prompt_tokens, c.tokens]) for g, c in pairs]
  logits = np.asarray(transformer.apply(CFG, params, padded(seqs)[:, :-1]))
  return [logits[i, len(g.prompt_tokens) - 1:len(s) - 1]
          for i, ((g, _), s) in enumerate(zip(pairs, seqs))]


def processed_reference(logits, tokens, temperature, top_k=0, top_p=1.0):
  """log_softmax of logits [L, V] after temperature, top-k, top-p at `tokens` [L] (numpy, float64)."""
  out = []
  for row, t in zip(np.asarray(logits, np.float64) / temperature, tokens):
    if top_k:
      row = np.where(row < np.sort(row)[::-1][top_k - 1], -np.inf, row)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    if top_p < 1.0:
      order = np.argsort(-probs)
      keep = np.cumsum(probs[order]) - probs[order] < top_p  # smallest prefix with mass >= top_p
      mask = np.zeros_like(probs, bool)
      mask[order[keep]] = True
      row = np.where(mask, row, -np.inf)
    out.append(row[t] - row.max() - np.log(np.sum(np.exp(row - row.max()))))
  return np.asarray(out)


def test_logprobs_match_jax_forward(setup):
  engine, params, _ = setup
  sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24)
  start = time.perf_counter()
  groups = engine.generate(PROMPTS, 4, sampling)
  seconds = time.perf_counter() - start
  assert [g.prompt_index for g in groups] == [0, 1, 2]
  for g, p in zip(groups, PROMPTS):
    np.testing.assert_array_equal(g.prompt_tokens, p)
    assert g.policy_version == 0 and len(g.completions) == 4
    for c in g.completions:
      assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32
      assert c.tokens.shape == c.logprobs.shape and 1 <= len(c.tokens) <= 24
      assert np.all(c.logprobs <= 0)
  d = logprob_diffs(groups, params[0])
  tokens = sum(len(c.tokens) for g in groups for c in g.completions)
  print(f"\nvLLM vs JAX log-probs: mean |diff| {d.mean():.2e}, max {d.max():.2e}, "
        f"mean exp(|diff|) {np.exp(d).mean():.6f}; {tokens / seconds:.0f} tokens/s")
  assert np.exp(d).mean() <= 1.05
  assert d.max() < 1e-3
  # Against the other parameters the log-probs are far off: the comparison can fail.
  assert logprob_diffs(groups, params[1]).mean() > 0.05


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 10, 1.0), (1.3, 0, 0.8)])
def test_logprobs_are_processed(setup, temperature, top_k, top_p):
  """Log-probs of the distribution actually sampled from: after temperature, top-k, top-p."""
  engine, params, _ = setup
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12)
  groups = engine.generate(PROMPTS[:2], 3, sampling)
  pairs = pairs_of(groups)
  raws = jax_logprobs_many(params[0], pairs)
  for (_, c), logits, raw in zip(pairs, jax_logits_many(params[0], pairs), raws):
    ref = processed_reference(logits, c.tokens, temperature, top_k, top_p)
    assert np.all(np.isfinite(ref))  # every sampled token survived the filters
    np.testing.assert_allclose(c.logprobs, ref, atol=1e-3)
  raw_diff = np.concatenate([np.abs(r - c.logprobs) for r, (_, c) in zip(raws, pairs)])
  assert raw_diff.max() > 1e-2  # ...and they are not the raw log-probs


def test_stop_tokens_and_eos(setup):
  engine, _, _ = setup
  assert engine.eos_token_ids == (CFG.eos_token_id,)
  stop = (7, 8, 9, 10)
  groups = engine.generate(PROMPTS, 4, SamplingParams(max_tokens=20, stop_token_ids=stop))
  ends = set(stop) | {CFG.eos_token_id}
  reasons = set()
  for g in groups:
    for c in g.completions:
      reasons.add(c.finish_reason)
      assert not set(c.tokens[:-1].tolist()) & ends
      if c.finish_reason == "stop":
        assert c.tokens[-1] in ends
      else:
        assert c.finish_reason == "length" and len(c.tokens) == 20
  assert "stop" in reasons  # 5 stop ids of 64: some of 12 completions of 20 tokens stop


def test_greedy_is_argmax_with_zero_logprobs(setup):
  engine, params, _ = setup
  groups = engine.generate(PROMPTS[:2], 2, SamplingParams(temperature=0.0, max_tokens=10))
  for g in groups:
    a, b = g.completions
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, 0.0)
  pairs = [(g, g.completions[0]) for g in groups]
  for (_, c), logits in zip(pairs, jax_logits_many(params[0], pairs)):
    np.testing.assert_array_equal(c.tokens, logits.argmax(-1))


def test_repeated_calls_draw_fresh_samples(setup):
  engine, _, _ = setup
  sampling = SamplingParams(max_tokens=16)
  a = engine.generate(PROMPTS[:1], 2, sampling)[0].completions
  b = engine.generate(PROMPTS[:1], 2, sampling)[0].completions
  assert not np.array_equal(a[0].tokens, b[0].tokens)
  assert not np.array_equal(a[0].tokens, a[1].tokens)
  assert request_seed(0, 0, 3, 1) == request_seed(0, 0, 3, 1)
  assert len({request_seed(0, 0, c, p) for c in range(20) for p in range(20)}) == 400


def test_shared_names_live_in_base():
  from jaxreplay.rollout import jax_sampler  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm import engine as engine_lib  # pylint: disable=g-import-not-at-top
  assert engine_lib.WorkerDied is base.WorkerDied
  assert engine_lib.GREEDY_EPS == jax_sampler.GREEDY_EPS == base.GREEDY_EPS == 1e-5


def test_load_weights_switches_to_new_params(setup):
  engine, params, publisher = setup
  sampling = SamplingParams(max_tokens=24)
  v1 = publisher.publish(params[1], version=1).hf_dir
  assert publisher.latest.stall_s > 0
  engine.load_weights(Weights(1, hf_dir=v1))
  print(f"\nvLLM reload_weights (tiny model): {engine.last_update_seconds * 1e3:.1f} ms")
  groups = engine.generate(PROMPTS, 4, sampling)
  assert engine.policy_version == 1 and all(g.policy_version == 1 for g in groups)
  new, old = logprob_diffs(groups, params[1]), logprob_diffs(groups, params[0])
  print(f"after refresh: mean |diff| vs new {new.mean():.2e} (max {new.max():.2e}), "
        f"vs old {old.mean():.2e}")
  assert np.exp(new).mean() <= 1.05 and new.max() < 1e-3
  assert old.mean() > 0.05
  # And back: a second reload (the tied LM head is re-packed each time).
  v2 = publisher.publish(params[0], version=2).hf_dir
  engine.load_weights(Weights(2, hf_dir=v2, cfg=CFG))
  groups = engine.generate(PROMPTS, 2, sampling)
  assert all(g.policy_version == 2 for g in groups)
  assert logprob_diffs(groups, params[0]).max() < 1e-3


class _SharedEngine:
  """The module's engine as a pool worker: records each call's contexts, runs `after(calls)`
  after each call, and is not closed by the pool (the other tests use it)."""

  def __init__(self, engine, after):
    self.engine, self.after, self.calls = engine, after, []

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def generate(self, prompts, n, sampling):
    self.calls.append(([np.asarray(p).copy() for p in prompts], self.engine.policy_version))
    out = self.engine.generate(prompts, n, sampling)
    self.after(len(self.calls))
    return out

  def close(self):
    pass


def test_requests_continue_across_a_refresh_in_a_partial_pool(setup):
  """rollout.partial="continue" on vLLM: a pool advances the requests by chunks of 4 tokens and a
  refresh after the second chunk continues them under the new weights, each chunk a new request
  whose prompt is the original prompt + the tokens so far (nothing regenerated); each token's
  log-prob is the JAX forward's under the version that sampled it, given the whole context (the
  prefix recomputed by the new weights: the refresh reset the prefix cache)."""
  from jaxreplay.rollout.pool import PromptBatch, WorkerPool  # pylint: disable=g-import-not-at-top
  from tests.helpers.pool_fakes import Recorder  # pylint: disable=g-import-not-at-top
  engine, params, publisher = setup
  old = publish_next(publisher, params[0])
  engine.load_weights(Weights(publisher.latest.version, hf_dir=old))
  v_old = engine.policy_version
  new = Weights(v_old + 1, hf_dir=publish_next(publisher, params[1]))
  sampling = SamplingParams(max_tokens=16)
  sent, rec, pool = [], Recorder(), None

  def source(i):
    if sent:
      return None
    sent.append(i)
    return PromptBatch(PROMPTS[:2], 3, sampling, meta=0)

  def refresh_after_two_chunks(calls):
    if calls == 2:
      pool.refresh(new)

  worker = _SharedEngine(engine, refresh_after_two_chunks)
  pool = WorkerPool(lambda i: worker, 1, source, rec.sink,
                    initial_weights=Weights(v_old, hf_dir=old), partial_chunk_tokens=4)
  pool.start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 1, timeout=300)
    pool.raise_if_failed()
  finally:
    pool.stop(30)
  (d,) = rec.deliveries
  assert d.policy_version == v_old and engine.policy_version == v_old + 1
  assert [v for _, v in worker.calls[:3]] == [v_old, v_old, v_old + 1]
  pairs = pairs_of(d.groups)
  crossed = 0
  for j, (g, c) in enumerate(pairs):
    want = np.where(np.arange(len(c.tokens)) < 8, v_old, v_old + 1)
    np.testing.assert_array_equal(c.versions, want)
    crossed += len(c.tokens) > 8
    for k, (contexts, _) in enumerate(worker.calls):
      in_flight = [i for i, (_, cc) in enumerate(pairs) if len(cc.tokens) > 4 * k]
      if j in in_flight:  # its context at call k: the prompt and exactly the tokens so far
        np.testing.assert_array_equal(contexts[in_flight.index(j)],
                                      np.r_[g.prompt_tokens, c.tokens[:4 * k]])
  assert crossed >= 4  # most of the 6 sequences ran past the refresh
  by_version = {v_old: jax_logprobs_many(params[0], pairs),
                v_old + 1: jax_logprobs_many(params[1], pairs)}
  for i, (_, c) in enumerate(pairs):
    for v, refs in by_version.items():
      mine = c.versions == v
      assert np.abs(c.logprobs[mine] - refs[i][mine]).max(initial=0.0) < 1e-3, (i, v)


def test_bad_inputs_raise_clear_errors(setup, tmp_path):
  engine, _, _ = setup
  sampling = SamplingParams(max_tokens=8)
  with pytest.raises(ValueError, match="outside"):
    engine.generate([np.array([1, CFG.vocab_size])], 1, sampling)
  with pytest.raises(ValueError, match="max_model_len"):
    engine.generate([np.ones(125, np.int32)], 1, sampling)
  with pytest.raises(ValueError, match="1-D"):
    engine.generate([np.ones((2, 2), np.int32)], 1, sampling)
  with pytest.raises(ValueError, match="no prompts"):
    engine.generate([], 1, sampling)
  with pytest.raises(FileNotFoundError, match="config.json"):
    engine.load_weights(Weights(9, hf_dir=str(tmp_path)))
  with pytest.raises(ValueError, match="has neither"):
    engine.load_weights(Weights(9, params={"w": np.zeros(2)}))
  assert engine.policy_version != 9


def test_worker_process_generates_refreshes_and_reports_death(setup):
  _, params, publisher = setup
  v0 = publish_next(publisher, params[0])
  v1 = publish_next(publisher, params[1])
  worker = VllmWorkerProcess(v0, max_model_len=128, max_num_seqs=16, startup_timeout_s=300)
  try:
    print(f"\nvLLM worker process start-up: {worker.startup_seconds:.1f} s "
          f"(engine {worker.engine_startup_seconds:.1f} s)")
    assert worker.pid != os.getpid() and worker.is_alive()
    groups = worker.generate(PROMPTS[:2], 2, SamplingParams(max_tokens=12))
    assert all(g.policy_version == 0 for g in groups)
    assert logprob_diffs(groups, params[0]).max() < 1e-3
    worker.load_weights(Weights(1, hf_dir=v1))
    groups = worker.generate(PROMPTS[:2], 2, SamplingParams(max_tokens=12))
    assert worker.policy_version == 1 and all(g.policy_version == 1 for g in groups)
    assert logprob_diffs(groups, params[1]).max() < 1e-3
    assert worker.ping()["policy_version"] == 1
    with pytest.raises(ValueError, match="outside") as info:  # errors in the child come back typed
      worker.generate([np.array([1, 999])], 1, SamplingParams())
    assert "check_prompts" in "\n".join(info.value.__notes__)  # with the child's traceback
    with pytest.raises(FileNotFoundError, match="config.json"):
      worker.load_weights(Weights(2, hf_dir=os.path.dirname(v1)))
    with pytest.raises(ValueError, match="has neither"):
      worker.load_weights(Weights(2, params={"w": np.zeros(2)}))
    assert worker.is_alive() and worker.policy_version == 1
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerDied):
      worker.generate(PROMPTS[:1], 1, SamplingParams(max_tokens=4))
    with pytest.raises(WorkerDied):
      worker.load_weights(Weights(2, hf_dir=v1))
    assert not worker.is_alive()
  finally:
    start = time.monotonic()
    worker.close()
    assert time.monotonic() - start < 10


def test_engine_core_in_its_own_process_generates_and_reloads(setup):
  """vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, the GPU setting of
  `workers.vllm_engine_settings`): the reload RPC (a function shipped to vLLM's worker) still loads
  the new weights, and one call of many prompts (a pool worker's merged requests) comes back whole."""
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import backends as workers  # pylint: disable=g-import-not-at-top
  _, params, publisher = setup
  v0 = publish_next(publisher, params[0])
  v1 = publish_next(publisher, params[1])
  c = defaults.base_config()
  c.rollout.backend, c.model.max_len, c.rollout.vllm_max_num_seqs = "vllm", 128, 64
  c.rollout.vllm_engine_process = "true"
  settings = workers.vllm_engine_settings(c, on_cpu=True)
  assert settings["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
  worker = VllmWorkerProcess(v0, startup_timeout_s=600, policy_version=0, seed=0, **settings)
  try:
    print(f"\nvLLM worker with its engine core in a process of its own: start-up "
          f"{worker.startup_seconds:.1f} s")
    prompts = PROMPTS * 8  # 24 prompts x 2 samples in one call
    groups = worker.generate(prompts, 2, SamplingParams(max_tokens=12))
    assert len(groups) == 24 and all(g.policy_version == 0 for g in groups)
    for g, p in zip(groups, prompts):
      np.testing.assert_array_equal(g.prompt_tokens, p)
    assert logprob_diffs(groups, params[0]).max() < 1e-3
    worker.load_weights(Weights(1, hf_dir=v1))
    groups = worker.generate(PROMPTS, 2, SamplingParams(max_tokens=12))
    assert all(g.policy_version == 1 for g in groups)
    assert logprob_diffs(groups, params[1]).max() < 1e-3
  finally:
    worker.close(timeout_s=30)


def test_worker_process_startup_timeout(setup):
  _, _, publisher = setup
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="startup_timeout_s"):
    VllmWorkerProcess(publisher.latest.location, startup_timeout_s=0.5)
  assert time.monotonic() - start < 10


def test_worker_process_startup_failure_is_reported(setup):
  _, _, publisher = setup
  with pytest.raises(WorkerDied, match="failed to start(.|\n)*logprobs_mode"):
    VllmWorkerProcess(publisher.latest.location, logprobs_mode="bogus", startup_timeout_s=120)


def test_worker_process_from_an_unguarded_script_and_request_timeout(setup, tmp_path):
  """The worker's child is a fresh interpreter: a script without `if __name__ == "__main__":` is
  not re-run in it. A request past request_timeout_s kills the child and raises WorkerDied."""
  _, _, publisher = setup
  script = tmp_path / "unguarded.py"
  script.write_text(textwrap.dedent("""\
      import sys
      import numpy as np
      from jaxreplay.rollout.base import SamplingParams
      from jaxreplay.rollout.vllm.engine import VllmWorkerProcess, WorkerDied
      print("top level ran", flush=True)
      worker = VllmWorkerProcess(sys.argv[1], max_model_len=128, max_num_seqs=4)
      groups = worker.generate([np.array([1, 5, 6])], 2, SamplingParams(max_tokens=4))
      print("completions", len(groups[0].completions), flush=True)
      worker.request_timeout_s = 1e-3
      try:
        worker.generate([np.array([1, 5, 6])], 8, SamplingParams(max_tokens=100))
      except WorkerDied as e:
        print("died:", e, flush=True)
      print("alive", worker.is_alive(), flush=True)
      worker.close()
      """))
  repo = REPO
  out = subprocess.run([sys.executable, str(script), publisher.latest.location], capture_output=True,
                       text=True, timeout=600, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=repo))
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.count("top level ran") == 1
  assert "completions 2" in out.stdout
  assert "took more than 0.001 s; the child was killed" in out.stdout
  assert "alive False" in out.stdout


def test_benign_reload_warnings_are_filtered_and_others_kept():
  """vLLM's layerwise reload warns "<Layer>: Failed to load weights" for rotary embeddings (a
  computed buffer) and a tied LM head on every refresh; those go, any other layer's stays."""
  import logging  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm import engine as engine_lib  # pylint: disable=g-import-not-at-top

  def record(layer):
    return logging.LogRecord(worker_side._RELOAD_LOGGER, logging.WARNING, __file__, 1,  # pylint: disable=protected-access
                             "%s: Failed to load weights", (layer,), None)
  tied = worker_side._BenignReloadWarnings(tied_head=True)  # pylint: disable=protected-access
  assert not tied.filter(record("RotaryEmbedding"))
  assert not tied.filter(record("Llama3RotaryEmbedding"))
  assert not tied.filter(record("ParallelLMHead"))
  assert tied.filter(record("QKVParallelLinear")) and tied.filter(record("VocabParallelEmbedding"))
  assert tied.dropped == 3
  untied = worker_side._BenignReloadWarnings(tied_head=False)  # pylint: disable=protected-access
  assert untied.filter(record("ParallelLMHead"))  # an untied head must load: keep its warning
  other = logging.LogRecord("x", logging.WARNING, __file__, 1, "something else %s", ("a",), None)
  assert tied.filter(other)


def test_benign_startup_warnings_are_filtered_and_others_kept():
  import logging  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.vllm import engine as engine_lib  # pylint: disable=g-import-not-at-top
  f = engine_lib._BenignStartupWarnings(["Chat template warmup failed", "Using None for EOS"])  # pylint: disable=protected-access

  def record(msg):
    return logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, msg, (), None)
  assert not f.filter(record("Chat template warmup failed"))
  assert not f.filter(record("Using None for EOS token id because tokenizer is not initialized"))
  assert f.filter(record("Some other warning"))
  names = {name for name, _, _ in engine_lib._BENIGN_STARTUP}  # pylint: disable=protected-access
  assert {"vllm.renderers.base", "vllm.v1.worker.cpu_worker"} <= names
