"""Tests of the `jax` rollout backend: sampling math against numpy / vLLM, the sampler against the
exact distributions and log-probs of the full forward (`models.apply`)."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxreplay import models
from jaxreplay.rollout import jax_sampler
from jaxreplay.rollout.base import SamplingParams
from jaxreplay.rollout.jax_sampler import JaxSampler, filter_logits, sample_token

# ---- numpy references ---------------------------------------------------------------------------


def np_filter(logits, temperature, top_k=0, top_p=1.0):
  """One row, float64: temperature, top-k (ties with the k-th kept), top-p (smallest prefix with
  mass >= top_p, ties with the last kept token kept)."""
  x = np.asarray(logits, np.float64) / temperature
  v = x.shape[-1]
  if 0 < top_k < v:
    x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
  if top_p < 1.0:
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    cum, last = 0.0, None
    for i in np.argsort(-probs, kind="stable"):
      cum, last = cum + probs[i], probs[i]
      if cum >= top_p:
        break
    x = np.where(probs < last, -np.inf, x)
  return x


def np_probs(filtered):
  p = np.exp(filtered - filtered.max())
  return p / p.sum()


def chi2_pvalue(counts, probs, min_expected=5.0):
  """Pearson chi-square p-value of counts against probs; cells with small expectation are pooled.
  Fails outright when a token of probability 0 was drawn."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  assert counts[probs == 0].sum() == 0, f"drew tokens of probability 0: {np.nonzero(counts * (probs == 0))}"
  n = counts.sum()
  big = probs * n >= min_expected
  obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
  exp = np.append(probs[big] * n, probs[~big & (probs > 0)].sum() * n)
  keep = exp > 0
  if keep.sum() < 2:  # one cell: nothing to test beyond the zero-probability check above
    return 1.0
  return stats.chisquare(obs[keep], exp[keep]).pvalue


# ---- filter_logits / sample_token ---------------------------------------------------------------

_filter = jax.jit(filter_logits)  # None (a filter off) is an empty pytree: jit keeps it None
_sample = jax.jit(sample_token)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.9), (1.3, 7, 0.8),
    (0.5, 1, 1.0), (1.0, 0, 1e-3), (2.0, 63, 0.5), (1.0, 64, 0.99)])
def test_filter_logits_matches_numpy(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32) * 3
  got = np.asarray(_filter(jnp.asarray(logits), temperature, top_k if top_k else None,
                           top_p if top_p < 1 else None))
  for row, g in zip(logits, got):
    want = np_filter(row, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(g), np.isinf(want))
    np.testing.assert_allclose(g[np.isfinite(g)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    assert np.isfinite(g).sum() >= 1


def test_filter_logits_per_row_settings_and_disabled_values():
  logits = np.random.default_rng(1).normal(size=(4, 32)).astype(np.float32)
  temps = np.array([0.5, 1.0, 1.5, 0.8], np.float32)
  ks = np.array([0, 3, 32, 10], np.int32)        # 0 and >= V disable top-k for that row
  ps = np.array([0.7, 1.0, 0.95, 0.3], np.float32)  # 1.0 disables top-p for that row
  got = np.asarray(_filter(jnp.asarray(logits), temps, ks, ps))
  for i in range(4):
    want = np_filter(logits[i], temps[i], int(ks[i]), float(ps[i]))
    np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
  # top_p=1.0 keeps every token even where a float32 cumsum saturates at 1.0 before the tail.
  steep = jnp.asarray([[30.0, 0.0, -30.0, -60.0]])
  assert np.isfinite(np.asarray(_filter(steep, 1.0, None, 1.0))).all()


def test_filter_logits_ties():
  logits = jnp.asarray([[2.0, 0.0, 2.0, 1.0, 2.0, -1.0]])
  # top-k: every token tied with the k-th value is kept (vLLM: mask logits < k-th value).
  np.testing.assert_array_equal(np.isfinite(_filter(logits, 1.0, 2, None))[0],
                                [True, False, True, False, True, False])
  # top-p: three tied tokens of prob ~0.29 each: two reach 0.5, the third tie is kept as well.
  np.testing.assert_array_equal(np.isfinite(_filter(logits, 1.0, None, 0.5))[0],
                                [True, False, True, False, True, False])
  equal = jnp.zeros((1, 4))
  assert np.isfinite(np.asarray(_filter(equal, 1.0, None, 0.25))).sum() == 4  # all tied
  uneven = jnp.log(jnp.asarray([[0.5, 0.25, 0.125, 0.125]]))
  np.testing.assert_array_equal(np.isfinite(_filter(uneven, 1.0, None, 0.74))[0],
                                [True, True, False, False])
  np.testing.assert_array_equal(np.isfinite(_filter(uneven, 1.0, None, 0.76))[0],
                                [True, True, True, True])  # the last two are tied


def test_filter_logits_matches_vllm():
  """Same masks as vLLM's own torch implementation (temperature applied first, as its Sampler does)."""
  from conftest import require
  torch = require("torch")
  ops = require("vllm.v1.sample.ops.topk_topp_sampler")
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(8, 50)).astype(np.float32) * 2
  temps = rng.uniform(0.3, 1.5, size=8).astype(np.float32)
  ks = np.array([50, 3, 10, 50, 1, 20, 50, 7], np.int32)  # vLLM's "off" is k = V
  ps = np.array([0.9, 1.0, 0.5, 0.2, 0.9, 0.99, 1.0, 0.6], np.float32)
  ref = ops.apply_top_k_top_p_pytorch(torch.from_numpy(logits / temps[:, None]),
                                      torch.from_numpy(ks), torch.from_numpy(ps)).numpy()
  got = np.asarray(_filter(jnp.asarray(logits), temps, ks, ps))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
  np.testing.assert_allclose(got[np.isfinite(got)], ref[np.isfinite(ref)], rtol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 4, 1.0),
                                                     (0.6, 6, 0.8)])
def test_sample_token_distribution_and_logprobs(temperature, top_k, top_p):
  logits = np.random.default_rng(3).permutation(np.linspace(1.0, -1.0, 16)).astype(np.float32)
  n = 20000
  batch = jnp.broadcast_to(jnp.asarray(logits), (n, 16))
  tokens, lps = _sample(jax.random.key(0), batch, temperature, top_k or None,
                        top_p if top_p < 1 else None)
  tokens, lps = np.asarray(tokens), np.asarray(lps)
  probs = np_probs(np_filter(logits, temperature, top_k, top_p))
  assert (probs > 0).sum() >= 3
  assert chi2_pvalue(np.bincount(tokens, minlength=16), probs) > 1e-3
  np.testing.assert_allclose(lps, np.log(probs[tokens]), atol=1e-5)


def test_sample_token_per_row_keys_and_greedy():
  logits = jnp.asarray(np.random.default_rng(4).normal(size=(5, 12)), jnp.float32)
  keys = jax.random.split(jax.random.key(1), 5)
  temps = jnp.asarray([1.0, 0.0, 1e-6, 0.5, 0.0])
  tokens, lps = _sample(keys, logits, temps, None, 0.9)
  argmax = np.argmax(np.asarray(logits), axis=-1)
  greedy = np.asarray(temps) < jax_sampler.GREEDY_EPS
  np.testing.assert_array_equal(np.asarray(tokens)[greedy], argmax[greedy])
  np.testing.assert_array_equal(np.asarray(lps)[greedy], 0.0)
  assert (np.asarray(lps)[~greedy] < 0).all()
  # per-row keys: a row's draw depends only on its own key; raw uint32 keys work too.
  t2, _ = _sample(jax.random.key_data(keys[:2]), logits[:2], temps[:2], None, 0.9)
  np.testing.assert_array_equal(np.asarray(t2), np.asarray(tokens)[:2])


# ---- the sampler on a tiny model ----------------------------------------------------------------

