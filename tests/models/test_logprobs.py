"""Log-probs of the policy (`models.logprobs`).

The sampling-mask bias (issue 27, item 2): rollouts sampled with temperature / top-k / top-p store
the log-probs of the processed distribution they were drawn from; the trainer's log-probs
(`LogprobProcessing`, trainer.sampling_logprobs="processed") are of the same distribution, so the
importance ratio on fresh rollouts is 1, with the JAX sampler and with vLLM. Chunked log-probs
(`token_logprobs`: never the full [B, T, V] logits) equal the full forward's, remat modes agree."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.config import defaults
from jaxreplay.data import collate as collate_lib
from jaxreplay.data.experience import to_rollouts
from jaxreplay.infra import sharding
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs
from jaxreplay.models.logprobs import LogprobProcessing, token_logprobs
from jaxreplay.rollout.base import SamplingParams
from jaxreplay.rollout.jax_sampler import JaxSampler
from tests.helpers import tolerances
from tests.helpers.deps import require
from tests.helpers.hf_reference import random_tokens, setup

CFG = presets.tiny(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
PROMPTS = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2, 6, 5, 3], np.int32),
           np.array([5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], np.int32)]
SETTINGS = [SamplingParams(temperature=1.0, top_p=0.8, max_tokens=10),
            SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_tokens=10),
            SamplingParams(temperature=1.3, top_k=5, max_tokens=10)]


@pytest.fixture(scope="module")
def params():
  # std 0.2 spreads next-token probability over ~25 tokens, so the filters cut real mass
  return transformer.init_params(CFG, jax.random.key(0), std=0.2)


def processing_of(s: SamplingParams) -> LogprobProcessing:
  return LogprobProcessing(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def np_processed_logprob(logits, target, temperature, top_k=0, top_p=1.0):
  """float64 log q(target): temperature, top-k (ties kept), top-p (smallest prefix with mass >=
  top_p, ties with the last kept token kept), the target kept in any case."""
  x = np.asarray(logits, np.float64) / temperature
  keep = np.ones(x.shape, bool)
  if 0 < top_k < x.size:
    keep &= x >= np.sort(x)[::-1][top_k - 1]
  if top_p < 1.0:
    y = np.where(keep, x, -np.inf)
    probs = np.exp(y - y.max())
    probs /= probs.sum()
    cum, last = 0.0, None
    for i in np.argsort(-probs, kind="stable"):
      cum, last = cum + probs[i], probs[i]
      if cum >= top_p:
        break
    keep &= probs >= last
  keep[target] = True
  y = np.where(keep, x, -np.inf)
  return y[target] - y.max() - np.log(np.sum(np.exp(y[keep] - y.max())))


class ProcessedLogprobsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_logprobs_vs_numpy_and_identity(self):
    p = transformer.init_params(CFG, jax.random.key(1), std=0.2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (3, 12)).astype(np.int32)
    targets = rng.integers(0, CFG.vocab_size, (3, 12)).astype(np.int32)  # some outside the nucleus
    logits = np.asarray(transformer.apply(CFG, p, tokens), np.float64)
    for proc in (LogprobProcessing(0.7, 8, 0.9), LogprobProcessing(1.0, 0, 0.6),
                 LogprobProcessing(1.4, 4, 1.0)):
      fn = self.variant(functools.partial(token_logprobs, CFG, chunk_size=5, return_entropy=True,
                                          processing=proc))
      lp, ent = fn(p, tokens, targets)
      want = np.array([[np_processed_logprob(logits[b, t], targets[b, t], proc.temperature,
                                             proc.top_k, proc.top_p) for t in range(12)]
                       for b in range(3)])
      np.testing.assert_allclose(lp, want, **tolerances.close(np.float32, CFG.hidden_size, 10.0))
      self.assertTrue(np.all(np.isfinite(np.asarray(ent))) and np.all(np.asarray(ent) >= 0))
    # identity processing (and "raw") is the plain computation, bit for bit
    plain = self.variant(functools.partial(token_logprobs, CFG, chunk_size=5))(p, tokens, targets)
    same = self.variant(functools.partial(token_logprobs, CFG, chunk_size=5,
                                          processing=LogprobProcessing()))(p, tokens, targets)
    chex.assert_trees_all_equal(plain, same)

  def test_gradients_are_finite_and_flow_through_kept_logits(self):
    p = transformer.init_params(CFG, jax.random.key(2), std=0.2)
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 8)).astype(np.int32)
    proc = LogprobProcessing(0.8, 6, 0.7)
    g = jax.grad(lambda q: jnp.sum(token_logprobs(CFG, q, tokens, tokens, chunk_size=4,
                                                  processing=proc)))(p)
    leaves = jax.tree.leaves(g)
    self.assertTrue(all(np.all(np.isfinite(np.asarray(x))) for x in leaves))
    self.assertGreater(sum(float(jnp.sum(jnp.abs(x))) for x in leaves), 0.0)

  def test_processing_from_config(self):
    c = defaults.base_config()
    self.assertIsNone(trainer.logprob_processing(c))  # temperature 1, no filter: the raw softmax
    c.rollout.top_p, c.rollout.temperature = 0.9, 0.8
    self.assertEqual(trainer.logprob_processing(c), LogprobProcessing(0.8, 0, 0.9))
    c.trainer.sampling_logprobs = "raw"
    self.assertIsNone(trainer.logprob_processing(c))
    with pytest.raises(ValueError, match="greedy"):
      LogprobProcessing(temperature=0.0)


def trainer_logprobs(groups, params, processing):
  """The trainer's log-probs of fresh groups through the run's path: rollouts -> collate ->
  `trainer.make_logprob_fn`; returns (trainer, behaviour, mask), float64 [B, T]."""
  zeros = np.zeros((len(groups), len(groups[0].completions)), np.float32)
  batch = collate_lib.collate(to_rollouts(groups, zeros, zeros, list(range(len(groups)))),
                              buckets=(32,), pad_id=0)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  fn = trainer.make_logprob_fn(CFG, mesh, sharding.param_shardings(params, mesh), chunk_size=32,
                               logprob_processing=processing)
  lp = np.asarray(fn(params, batch), np.float64)
  return lp, np.asarray(batch.behaviour_logprobs, np.float64), batch.completion_mask > 0


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_jax_sampler_fresh_ratio_is_one(params, settings):
  sampler = JaxSampler(CFG, params, max_len=32, batch_size=16, eos_token_ids=(), seed=3)
  groups = sampler.generate(PROMPTS, 5, settings)
  lp, behaviour, mask = trainer_logprobs(groups, params, processing_of(settings))
  log_ratio = (lp - behaviour)[mask]
  np.testing.assert_allclose(log_ratio, 0.0, **tolerances.close(np.float32, CFG.hidden_size, 10.0))
  # ...and against the raw softmax at temperature 1 the ratio is biased (issue 27's bug)
  raw, _, _ = trainer_logprobs(groups, params, None)
  assert np.abs(raw - behaviour)[mask].mean() > 0.05


@pytest.mark.slow
def test_vllm_fresh_ratio_is_one(params, tmp_path):
  """The vLLM CPU engine (float32) stores processed log-probs: the processed trainer log-probs
  match them (within the engine's own float32 numerics, as tests/rollout/vllm/test_engine.py measures)."""
  require("vllm")
  from jaxreplay.rollout.vllm.engine import VllmEngine  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.weights.file_publisher import FilePublisher  # pylint: disable=g-import-not-at-top
  publisher = FilePublisher(CFG, root=str(tmp_path), keep=2)
  engine = VllmEngine(publisher.publish(params, version=0).hf_dir, max_model_len=64, max_num_seqs=32,
                      seed=0)
  try:
    for settings in SETTINGS[:2]:
      groups = engine.generate(PROMPTS, 5, settings)
      lp, behaviour, mask = trainer_logprobs(groups, params, processing_of(settings))
      log_ratio = (lp - behaviour)[mask]
      # the engine's float32 kernels differ from XLA's: its own tolerance (V * D reductions)
      np.testing.assert_allclose(log_ratio, 0.0, **tolerances.close(
          np.float32, CFG.vocab_size * CFG.hidden_size, 10.0))
      raw, _, _ = trainer_logprobs(groups, params, None)
      assert np.abs(raw - behaviour)[mask].mean() > 0.05
  finally:
    engine.close()
    publisher.close()


# ---- chunked log-probs against the full forward (`logprobs.token_logprobs`) ----------------------

apply = jax.jit(transformer.apply, static_argnums=0)


def _walk_shapes(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield tuple(getattr(v.aval, "shape", ()))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _walk_shapes(inner)


def test_token_logprobs_chunked():
  """chunk_size 5 does not divide T = 13; row 1 is right-padded; grads under remat and without."""
  cfg, _, params = setup("qwen3_untied_mha")
  bsz, t, chunk = 2, 13, 5
  tokens = jnp.asarray(random_tokens(cfg, (bsz, t), seed=8))
  targets = jnp.asarray(random_tokens(cfg, (bsz, t), seed=9))
  seg = jnp.asarray(np.arange(t)[None] < np.array([[t], [9]]), jnp.int32)
  mask = seg > 0

  @functools.partial(jax.jit, static_argnums=0)
  def chunked(c, p):
    return logprobs.token_logprobs(c, p, tokens, targets, segment_ids=seg, chunk_size=chunk,
                                   return_entropy=True)

  lp, ent = chunked(cfg, params)
  chex.assert_shape([lp, ent], (bsz, t))
  assert lp.dtype == ent.dtype == jnp.float32
  assert bool(jnp.isfinite(lp).all() & jnp.isfinite(ent).all())
  full = np.asarray(apply(cfg, params, tokens, None, seg), np.float64)
  logz = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
  ref_lp = np.take_along_axis(full, np.asarray(targets)[..., None], -1)[..., 0] - logz
  probs = np.exp(full - logz[..., None])
  ref_ent = -(probs * np.log(probs)).sum(-1)
  assert ref_ent.min() > 0.05, "near one-hot distributions would make the entropy check weak"
  # float32 (chunked, over the V logits) against float64 numpy.
  tol = lambda ref: tolerances.close(np.float32, cfg.vocab_size, tolerances.tree_scale(ref))
  np.testing.assert_allclose(lp, ref_lp, **tol(ref_lp))
  np.testing.assert_allclose(ent, ref_ent, **tol(ref_ent))
  np.testing.assert_allclose(logprobs.logprobs_from_logits(jnp.asarray(full), targets), ref_lp,
                             **tol(ref_lp))
  np.testing.assert_allclose(logprobs.entropy_from_logits(jnp.asarray(full)), ref_ent,
                             **tol(ref_ent))

  def chunked_loss(c, p):
    lp, ent = logprobs.token_logprobs(c, p, tokens, targets, segment_ids=seg, chunk_size=chunk,
                                      return_entropy=True)
    return jnp.sum((lp + 0.1 * ent) * mask)

  def full_loss(c, p):
    logits = transformer.apply(c, p, tokens, None, seg)
    lp = logprobs.logprobs_from_logits(logits, targets)
    return jnp.sum((lp + 0.1 * logprobs.entropy_from_logits(logits)) * mask)

  grad = lambda f, c: jax.jit(jax.grad(f, argnums=1), static_argnums=0)(c, params)
  g_full = grad(full_loss, cfg)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(g_full))
  for c in (cfg, cfg.replace(remat=True)):
    # Each gradient element sums over the B*T tokens and the V logits (chunked vs whole).
    chex.assert_trees_all_close(grad(chunked_loss, c), g_full, **tolerances.close(
        np.float32, tokens.size * cfg.vocab_size, tolerances.tree_scale(g_full)))

  # Forward and backward never hold more than one [B, chunk, V] block of logits.
  d, v = cfg.hidden_size, cfg.vocab_size

  def logit_blocks(fn):  # arrays with a vocab axis, other than the embedding / head kernels
    shapes = _walk_shapes(jax.make_jaxpr(jax.grad(fn, argnums=1), static_argnums=0)(cfg, params).jaxpr)
    return [s for s in shapes if v in s and s not in ((d, v), (v, d))]

  big = [s for s in logit_blocks(chunked_loss) if np.prod(s) > bsz * chunk * v]
  assert not big, f"arrays larger than one chunk of logits: {big}"
  assert any(np.prod(s) > bsz * chunk * v for s in logit_blocks(full_loss)), \
      "the shape check must see the full-logits path"


@pytest.mark.parametrize("t", [5, 13])  # one chunk (T <= chunk 8), two chunks
def test_token_logprobs_remat_modes(t):
  """remat auto / always / never give the same log-probs, entropies and gradients; "auto"
  checkpoints the LM head only when there are two or more chunks."""
  cfg, _, params = setup("qwen3_untied_mha")
  tokens = jnp.asarray(random_tokens(cfg, (2, t), seed=11))
  targets = jnp.asarray(random_tokens(cfg, (2, t), seed=12))

  def loss(p, remat):
    lp, ent = logprobs.token_logprobs(cfg, p, tokens, targets, chunk_size=8, return_entropy=True,
                                      remat=remat)
    return jnp.sum(lp * jnp.cos(jnp.arange(t))) + 0.1 * jnp.sum(ent), (lp, ent)

  out = {m: jax.jit(jax.value_and_grad(functools.partial(loss, remat=m), has_aux=True))(params)
         for m in logprobs.REMAT_MODES}
  for m in ("always", "never"):
    chex.assert_trees_all_close(out[m], out["auto"], **tolerances.close(
        np.float32, tokens.size * cfg.vocab_size, tolerances.tree_scale(out["auto"])))
  text = lambda m: str(jax.make_jaxpr(jax.grad(lambda p: loss(p, m)[0]))(params))
  assert "checkpoint" in text("always") or "remat" in text("always")
  assert "checkpoint" not in text("never") and "remat" not in text("never")
  assert (("checkpoint" in text("auto") or "remat" in text("auto")) == (t > 8))
  with pytest.raises(ValueError, match="remat"):
    logprobs.token_logprobs(cfg, params, tokens, targets, remat="sometimes")


def test_token_logprobs_errors():
  cfg, _, params = setup("qwen3_untied_mha")
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="chunk_size"):
    logprobs.token_logprobs(cfg, params, tokens, tokens, chunk_size=0)
  with pytest.raises(ValueError, match="targets shape"):
    logprobs.token_logprobs(cfg, params, tokens, tokens[:, :3])
  with pytest.raises(ValueError, match="positions has shape"):
    transformer.apply(cfg, params, tokens, positions=jnp.zeros((1, 3), jnp.int32))
