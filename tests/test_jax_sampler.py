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

@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.9), (1.3, 7, 0.8),
    (0.5, 1, 1.0), (1.0, 0, 1e-3), (2.0, 63, 0.5), (1.0, 64, 0.99)])
def test_filter_logits_matches_numpy(temperature, top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32) * 3
  got = np.asarray(jax.jit(filter_logits)(jnp.asarray(logits), temperature,
                                          top_k if top_k else None, top_p if top_p < 1 else None))
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
  got = np.asarray(filter_logits(jnp.asarray(logits), temps, ks, ps))
  for i in range(4):
    want = np_filter(logits[i], temps[i], int(ks[i]), float(ps[i]))
    np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
  # top_p=1.0 keeps every token even where a float32 cumsum saturates at 1.0 before the tail.
  steep = jnp.asarray([[30.0, 0.0, -30.0, -60.0]])
  assert np.isfinite(np.asarray(filter_logits(steep, 1.0, None, 1.0))).all()


def test_filter_logits_ties():
  logits = jnp.asarray([[2.0, 0.0, 2.0, 1.0, 2.0, -1.0]])
  # top-k: every token tied with the k-th value is kept (vLLM: mask logits < k-th value).
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 1.0, 2, None))[0],
                                [True, False, True, False, True, False])
  # top-p: three tied tokens of prob ~0.29 each: two reach 0.5, the third tie is kept as well.
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 1.0, None, 0.5))[0],
                                [True, False, True, False, True, False])
  equal = jnp.zeros((1, 4))
  assert np.isfinite(np.asarray(filter_logits(equal, 1.0, None, 0.25))).sum() == 4  # all tied
  uneven = jnp.log(jnp.asarray([[0.5, 0.25, 0.125, 0.125]]))
  np.testing.assert_array_equal(np.isfinite(filter_logits(uneven, 1.0, None, 0.74))[0],
                                [True, True, False, False])
  np.testing.assert_array_equal(np.isfinite(filter_logits(uneven, 1.0, None, 0.76))[0],
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
  got = np.asarray(filter_logits(jnp.asarray(logits), temps, ks, ps))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
  np.testing.assert_allclose(got[np.isfinite(got)], ref[np.isfinite(ref)], rtol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 4, 1.0),
                                                     (0.6, 6, 0.8)])
def test_sample_token_distribution_and_logprobs(temperature, top_k, top_p):
  logits = np.random.default_rng(3).permutation(np.linspace(1.0, -1.0, 16)).astype(np.float32)
  n = 20000
  batch = jnp.broadcast_to(jnp.asarray(logits), (n, 16))
  tokens, lps = jax.jit(sample_token, static_argnums=(3, 4))(
      jax.random.key(0), batch, temperature, top_k or None, top_p if top_p < 1 else None)
  tokens, lps = np.asarray(tokens), np.asarray(lps)
  probs = np_probs(np_filter(logits, temperature, top_k, top_p))
  assert (probs > 0).sum() >= 3
  assert chi2_pvalue(np.bincount(tokens, minlength=16), probs) > 1e-3
  np.testing.assert_allclose(lps, np.log(probs[tokens]), atol=1e-5)


def test_sample_token_per_row_keys_and_greedy():
  logits = jnp.asarray(np.random.default_rng(4).normal(size=(5, 12)), jnp.float32)
  keys = jax.random.split(jax.random.key(1), 5)
  temps = jnp.asarray([1.0, 0.0, 1e-6, 0.5, 0.0])
  tokens, lps = sample_token(keys, logits, temps, None, 0.9)
  argmax = np.argmax(np.asarray(logits), axis=-1)
  greedy = np.asarray(temps) < jax_sampler.GREEDY_EPS
  np.testing.assert_array_equal(np.asarray(tokens)[greedy], argmax[greedy])
  np.testing.assert_array_equal(np.asarray(lps)[greedy], 0.0)
  assert (np.asarray(lps)[~greedy] < 0).all()
  # per-row keys: a row's draw depends only on its own key; raw uint32 keys work too.
  t2, _ = sample_token(jax.random.key_data(keys[:2]), logits[:2], temps[:2], None, 0.9)
  np.testing.assert_array_equal(np.asarray(t2), np.asarray(tokens)[:2])


# ---- the sampler on a tiny model ----------------------------------------------------------------

def tiny_model(vocab, layers, std, seed=0):
  cfg = models.presets.tiny(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=layers, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32)
  return cfg, models.init_params(cfg, jax.random.key(seed), std=std)


@pytest.fixture(scope="module")
def model():
  return tiny_model(vocab=32, layers=2, std=0.2)


@pytest.fixture(scope="module")
def sampler(model):
  """Shared by the sequence-level tests; they all use SETTINGS' shape so the loop compiles once."""
  cfg, params = model
  return JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)


SETTINGS = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_tokens=8)
PROMPTS = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2, 6, 5, 3], np.int32),
           np.array([5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], np.int32)]


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens):
  return models.apply(cfg, params, tokens)


def full_forward_logits(cfg, params, seqs, pad_to=32):
  """float64 [N, pad_to, V] logits of right-padded sequences (causal: padding never leaks back)."""
  batch = np.zeros((len(seqs), pad_to), np.int32)
  for i, s in enumerate(seqs):
    batch[i, :len(s)] = s
  return np.asarray(_logits(cfg, params, jnp.asarray(batch)), np.float64)


def exact_probs(cfg, params, prompt, s: SamplingParams):
  last = full_forward_logits(cfg, params, [prompt])[0, len(prompt) - 1]
  return np_probs(np_filter(last, s.temperature, s.top_k, s.top_p))


@pytest.mark.parametrize("settings", [
    SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.95, max_tokens=1)], ids=str)
def test_first_token_distribution_is_exact(model, settings):
  cfg, params = model
  s = JaxSampler(cfg, params, max_len=32, batch_size=1000, eos_token_ids=(), seed=1)
  prompt = PROMPTS[1]
  draws = np.array([c.tokens[0] for c in s.generate([prompt], 4000, settings)[0].completions])
  probs = exact_probs(cfg, params, prompt, settings)
  assert (probs > 0).sum() >= 4  # a distribution worth testing
  assert chi2_pvalue(np.bincount(draws, minlength=cfg.vocab_size), probs) > 1e-3


def test_two_token_joint_distribution_is_exact():
  cfg, params = tiny_model(vocab=8, layers=1, std=0.3, seed=3)
  settings = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=2)
  prompt = np.array([1, 4, 2, 6], np.int32)
  s = JaxSampler(cfg, params, max_len=32, batch_size=1000, eos_token_ids=(), seed=2)
  comps = s.generate([prompt], 4000, settings)[0].completions
  assert all(len(c.tokens) == 2 for c in comps)
  pairs = np.array([c.tokens[0] * 8 + c.tokens[1] for c in comps])
  seqs = [prompt] + [np.append(prompt, a) for a in range(8)]
  logits = full_forward_logits(cfg, params, seqs)
  filt = lambda x: np_probs(np_filter(x, settings.temperature, 0, settings.top_p))
  p1 = filt(logits[0, len(prompt) - 1])
  joint = np.concatenate([p1[a] * filt(logits[1 + a, len(prompt)]) for a in range(8)])
  assert (joint > 0.01).sum() >= 6
  assert chi2_pvalue(np.bincount(pairs, minlength=64), joint) > 1e-3


def recomputed_logprobs(cfg, params, prompt, tokens, s: SamplingParams):
  logits = full_forward_logits(cfg, params, [np.concatenate([prompt, tokens])])[0]
  out = []
  for t, tok in enumerate(tokens):
    f = np_filter(logits[len(prompt) - 1 + t], s.temperature, s.top_k, s.top_p)
    out.append(f[tok] - np.log(np.exp(f - f.max()).sum()) - f.max())
  return np.array(out)


def test_logprobs_equal_full_forward_with_processing(model, sampler):
  cfg, params = model
  groups = sampler.generate(PROMPTS, 3, SETTINGS)
  assert [g.prompt_index for g in groups] == [0, 1, 2]
  for g, prompt in zip(groups, PROMPTS):
    np.testing.assert_array_equal(g.prompt_tokens, prompt)
    assert g.policy_version == 0 and len(g.completions) == 3
    for c in g.completions:
      assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32
      assert len(c.tokens) == len(c.logprobs) == SETTINGS.max_tokens
      assert c.finish_reason == "length"
      np.testing.assert_allclose(c.logprobs, recomputed_logprobs(cfg, params, prompt, c.tokens,
                                                                 SETTINGS), atol=1e-4)


def test_stop_tokens_end_completions_and_are_kept(sampler):
  settings = dataclasses.replace(SETTINGS, temperature=1.5, top_k=0, top_p=1.0)
  # Stop on the two tokens sampled most often without stopping.
  free = sampler.generate(PROMPTS, 8, dataclasses.replace(settings, top_k=12, top_p=0.9))
  counts = np.bincount(np.concatenate([c.tokens for g in free for c in g.completions]),
                       minlength=32)
  stop = tuple(int(t) for t in np.argsort(-counts)[:2])
  groups = sampler.generate(PROMPTS, 8, dataclasses.replace(SETTINGS, stop_token_ids=stop))
  reasons = set()
  for c in (c for g in groups for c in g.completions):
    reasons.add(c.finish_reason)
    assert len(c.tokens) == len(c.logprobs) <= SETTINGS.max_tokens
    assert not np.isin(c.tokens[:-1], stop).any()  # nothing after the first stop token
    if c.finish_reason == "stop":
      assert c.tokens[-1] in stop
    else:
      assert len(c.tokens) == SETTINGS.max_tokens and c.tokens[-1] not in stop
  assert reasons == {"stop", "length"}
  # eos ids given to the sampler act as stop tokens too.
  eos = JaxSampler(sampler.cfg, sampler._params, 48, batch_size=8, eos_token_ids=stop)
  eos_groups = eos.generate(PROMPTS, 8, SETTINGS)
  assert any(c.finish_reason == "stop" for g in eos_groups for c in g.completions)


def test_max_tokens_respected(sampler):
  for g in sampler.generate(PROMPTS[:1], 2, dataclasses.replace(SETTINGS, max_tokens=3)):
    assert all(len(c.tokens) == 3 and c.finish_reason == "length" for c in g.completions)


def test_greedy_equals_argmax_of_full_forward(model, sampler):
  cfg, params = model
  groups = sampler.generate(PROMPTS, 2, dataclasses.replace(SETTINGS, temperature=0.0))
  for g, prompt in zip(groups, PROMPTS):
    a, b = g.completions
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, 0.0)
    logits = full_forward_logits(cfg, params, [np.concatenate([prompt, a.tokens])])[0]
    np.testing.assert_array_equal(a.tokens, np.argmax(logits[len(prompt) - 1:-1][:len(a.tokens)],
                                                      axis=-1))


def test_deterministic_given_seed(model, sampler):
  cfg, params = model
  other = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)
  fresh = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)
  reseeded = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=7)
  toks = lambda groups: np.stack([c.tokens for g in groups for c in g.completions])
  first, second = toks(other.generate(PROMPTS, 2, SETTINGS)), toks(other.generate(PROMPTS, 2, SETTINGS))
  np.testing.assert_array_equal(toks(fresh.generate(PROMPTS, 2, SETTINGS)), first)
  np.testing.assert_array_equal(toks(fresh.generate(PROMPTS, 2, SETTINGS)), second)
  assert (first != second).any()  # each call draws new samples
  assert (toks(reseeded.generate(PROMPTS, 2, SETTINGS)) != first).any()
  seeded = dataclasses.replace(SETTINGS, seed=5)
  assert (toks(JaxSampler(cfg, params, 48, 8, eos_token_ids=()).generate(PROMPTS, 2, seeded))
          != first).any()
  # A row's draws depend on (seed, call, row index) only: prompts alone give the same rows.
  alone = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)
  np.testing.assert_array_equal(toks(alone.generate(PROMPTS, 2, SETTINGS)), first)


def test_bad_inputs_raise_clear_errors(model, sampler):
  cfg, params = model
  with pytest.raises(ValueError, match=r"prompt 1 has 44 tokens and max_tokens=8.*max_len=48"):
    sampler.generate([PROMPTS[0], np.ones(44, np.int32)], 1, SETTINGS)
  with pytest.raises(ValueError, match="vocab_size=32"):
    sampler.generate([np.array([3, 40])], 1, SETTINGS)
  with pytest.raises(ValueError, match="non-empty"):
    sampler.generate([np.array([], np.int32)], 1, SETTINGS)
  with pytest.raises(ValueError, match="n=0"):
    sampler.generate(PROMPTS, 0, SETTINGS)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    JaxSampler(cfg, params, max_len=10_000)
  assert sampler.generate([], 2, SETTINGS) == []


def test_set_params_switches_policy_and_version(model):
  cfg, params = model
  s = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=())
  greedy = dataclasses.replace(SETTINGS, temperature=0.0)
  before = s.generate(PROMPTS, 1, greedy)
  _, new_params = tiny_model(vocab=32, layers=2, std=0.2, seed=1)
  s.set_params(new_params, version=3)
  after = s.generate(PROMPTS, 1, greedy)
  assert [g.policy_version for g in before] == [0] * 3 and [g.policy_version for g in after] == [3] * 3
  want = [np.argmax(full_forward_logits(cfg, new_params, [p])[0, len(p) - 1]) for p in PROMPTS]
  assert [g.completions[0].tokens[0] for g in after] == want
  s.close()
  with pytest.raises(ValueError, match="closed"):
    s.generate(PROMPTS, 1, greedy)
