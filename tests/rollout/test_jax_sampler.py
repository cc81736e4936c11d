"""Tests of the `jax` rollout backend: sampling math against numpy / vLLM, the sampler against the
exact distributions and log-probs of the full forward (`transformer.apply`)."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxreplay.models import hf_io
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout import jax_sampler
from jaxreplay.rollout.base import SamplingParams, TurnDriver, Weights, run_turns
from jaxreplay.rollout.jax_sampler import JaxSampler, filter_logits, sample_token
from tests.helpers import tolerances

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
  drawn_impossible = np.nonzero(counts * (probs == 0))[0]
  assert not drawn_impossible.size, f"drew tokens of probability 0: {drawn_impossible}"
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
    kept = want[np.isfinite(want)]  # logits / temperature: elementwise, JAX vs numpy
    np.testing.assert_allclose(g[np.isfinite(g)], kept, **tolerances.close(
        np.float32, 1, tolerances.tree_scale(kept)))
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
  """Same masks as vLLM's own torch implementation (temperature first, as its Sampler does)."""
  from tests.helpers.deps import require
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
  kept = ref[np.isfinite(ref)]  # elementwise, JAX vs torch
  np.testing.assert_allclose(got[np.isfinite(got)], kept, **tolerances.close(
      np.float32, 1, tolerances.tree_scale(kept)))


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
  want = np.log(probs[tokens])  # a log-softmax over the 16 logits, float32 vs float64
  np.testing.assert_allclose(lps, want, **tolerances.close(np.float32, 16, tolerances.tree_scale(want)))


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

# ---- the sampler on a tiny model ----------------------------------------------------------------

def tiny_model(seed=0, vocab=32):
  """2 layers, hidden 64, head_dim 32; std 0.2 spreads next-token probability over ~25 tokens."""
  cfg = presets.tiny(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=32)
  return cfg, transformer.init_params(cfg, jax.random.key(seed), std=0.2)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def sampler(model):
  """Shared by the sequence-level tests. They keep SETTINGS' filters (top-k and top-p on) and
  max_tokens <= 8, so the generation loop compiles once for all of them."""
  cfg, params = model
  return JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)


SETTINGS = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_tokens=8)
PROMPTS = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2, 6, 5, 3], np.int32),
           np.array([5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2], np.int32)]


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens):
  return transformer.apply(cfg, params, tokens)


def full_forward_logits(cfg, params, seqs, rows=40, pad_to=32):
  """float64 [len(seqs), pad_to, V] logits of right-padded sequences via `transformer.apply` (causal:
  padding never leaks back). The batch is padded to `rows` so that it compiles once."""
  batch = np.zeros((max(rows, len(seqs)), pad_to), np.int32)
  for i, seq in enumerate(seqs):
    batch[i, :len(seq)] = seq
  return np.asarray(_logits(cfg, params, jnp.asarray(batch)), np.float64)[:len(seqs)]


def processed(logits, s: SamplingParams):
  return np_probs(np_filter(logits, s.temperature, s.top_k, s.top_p))


@pytest.mark.parametrize("settings", [
    SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.95, max_tokens=2)], ids=str)
def test_sampled_distributions_are_exact(model, settings):
  """4000 two-token completions of one prompt against the exact (filtered) softmax of the full
  forward: the first token, the (first, second) pairs, the second token given the commonest
  first one."""
  cfg, params = model
  v = cfg.vocab_size
  s = JaxSampler(cfg, params, max_len=32, batch_size=1000, eos_token_ids=(), seed=1)
  prompt = PROMPTS[1]
  comps = s.generate([prompt], 4000, settings)[0].completions
  draws = np.stack([c.tokens for c in comps])
  chex.assert_shape(draws, (4000, 2))
  logits = full_forward_logits(cfg, params, [prompt] + [np.append(prompt, a) for a in range(v)])
  p1 = processed(logits[0, len(prompt) - 1], settings)
  p2 = np.stack([processed(logits[1 + a, len(prompt)], settings) for a in range(v)])  # [a, b]
  assert (p1 > 0).sum() >= 4  # a distribution worth testing
  assert chi2_pvalue(np.bincount(draws[:, 0], minlength=v), p1) > 1e-3
  assert chi2_pvalue(np.bincount(draws[:, 0] * v + draws[:, 1], minlength=v * v),
                     (p1[:, None] * p2).ravel()) > 1e-3
  top = np.argmax(np.bincount(draws[:, 0], minlength=v))
  assert chi2_pvalue(np.bincount(draws[draws[:, 0] == top, 1], minlength=v), p2[top]) > 1e-3


def recomputed_logprobs(cfg, params, prompt, tokens, s: SamplingParams):
  logits = full_forward_logits(cfg, params, [np.concatenate([prompt, tokens])])[0]
  out = []
  for t, tok in enumerate(tokens):
    f = np_filter(logits[len(prompt) - 1 + t], s.temperature, s.top_k, s.top_p)
    out.append(f[tok] - f.max() - np.log(np.exp(f - f.max()).sum()))
  return np.array(out)


def test_logprobs_equal_full_forward_with_processing(model, sampler):
  cfg, params = model
  groups = sampler.generate(PROMPTS, 3, SETTINGS)  # 9 rows: two batches of 8, prompt lengths 3-12
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
  hot = dataclasses.replace(SETTINGS, temperature=1.5)
  free = sampler.generate(PROMPTS, 8, hot)
  counts = np.bincount(np.concatenate([c.tokens for g in free for c in g.completions]),
                       minlength=32)
  stop = tuple(int(t) for t in np.argsort(-counts)[:2])  # the two commonest tokens
  groups = sampler.generate(PROMPTS, 8, dataclasses.replace(hot, stop_token_ids=stop))
  reasons = set()
  for c in (c for g in groups for c in g.completions):
    reasons.add(c.finish_reason)
    assert len(c.tokens) == len(c.logprobs) <= hot.max_tokens
    assert not np.isin(c.tokens[:-1], stop).any()  # nothing after the first stop token
    if c.finish_reason == "stop":
      assert c.tokens[-1] in stop
    else:
      assert len(c.tokens) == hot.max_tokens and c.tokens[-1] not in stop
  assert reasons == {"stop", "length"}
  # The sampler's eos ids stop completions on top of the request's stop ids.
  eos = JaxSampler(sampler.cfg, sampler._params, 48, batch_size=8, eos_token_ids=stop)
  eos_comps = [c for g in eos.generate(PROMPTS, 8, hot) for c in g.completions]
  assert any(c.finish_reason == "stop" and c.tokens[-1] in stop for c in eos_comps)


def test_max_tokens_respected(sampler):
  for max_tokens in (1, 3, 5):
    groups = sampler.generate(PROMPTS, 2, dataclasses.replace(SETTINGS, max_tokens=max_tokens))
    assert all(len(c.tokens) == len(c.logprobs) == max_tokens and c.finish_reason == "length"
               for g in groups for c in g.completions)


def test_greedy_equals_argmax_of_full_forward(model, sampler):
  cfg, params = model
  groups = sampler.generate(PROMPTS, 2, dataclasses.replace(SETTINGS, temperature=0.0))
  for g, prompt in zip(groups, PROMPTS):
    a, b = g.completions
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, 0.0)
    logits = full_forward_logits(cfg, params, [np.concatenate([prompt, a.tokens])])[0]
    np.testing.assert_array_equal(
        a.tokens, np.argmax(logits[len(prompt) - 1:len(prompt) - 1 + len(a.tokens)], axis=-1))


def test_deterministic_given_seed(model):
  cfg, params = model
  make = lambda seed=0: JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(),
                                   seed=seed)
  toks = lambda groups: np.stack([c.tokens for g in groups for c in g.completions])
  one, two = make(), make()
  first, second = toks(one.generate(PROMPTS, 2, SETTINGS)), toks(one.generate(PROMPTS, 2, SETTINGS))
  np.testing.assert_array_equal(toks(two.generate(PROMPTS, 2, SETTINGS)), first)
  np.testing.assert_array_equal(toks(two.generate(PROMPTS, 2, SETTINGS)), second)
  assert (first != second).any()  # each call draws new samples
  assert (toks(make(7).generate(PROMPTS, 2, SETTINGS)) != first).any()
  assert (toks(make().generate(PROMPTS, 2, dataclasses.replace(SETTINGS, seed=5))) != first).any()
  # Row r's draws depend on (seed, call, r) only, not on the other rows of its batch.
  np.testing.assert_array_equal(toks(make().generate(PROMPTS[:1], 2, SETTINGS)), first[:2])


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


def test_weight_refresh_in_memory_and_from_hf(model, tmp_path):
  cfg, params = model
  greedy = dataclasses.replace(SETTINGS, temperature=0.0)
  first_greedy = lambda p: [int(np.argmax(full_forward_logits(cfg, p, [q])[0, len(q) - 1]))
                            for q in PROMPTS]
  _, new_params = tiny_model(seed=1)
  assert first_greedy(new_params) != first_greedy(params)
  hf_io.save_hf(cfg, params, str(tmp_path / "v0"))
  hf_io.save_hf(cfg, new_params, str(tmp_path / "v5"))
  s = JaxSampler.from_hf(str(tmp_path / "v0"), max_len=48, batch_size=8, eos_token_ids=())
  heads = lambda groups: [int(g.completions[0].tokens[0]) for g in groups]
  before = s.generate(PROMPTS, 1, greedy)
  assert [g.policy_version for g in before] == [0] * 3 and heads(before) == first_greedy(params)
  s.load_weights(Weights(3, params=new_params))
  after = s.generate(PROMPTS, 1, greedy)
  assert [g.policy_version for g in after] == [3] * 3 and heads(after) == first_greedy(new_params)
  s.load_weights(Weights(4, hf_dir=str(tmp_path / "v0")))
  assert heads(s.generate(PROMPTS, 1, greedy)) == first_greedy(params) and s.policy_version == 4
  s.load_weights(Weights(5, hf_dir=str(tmp_path / "v5")))
  groups = s.generate(PROMPTS, 1, greedy)
  assert heads(groups) == first_greedy(new_params) and groups[0].policy_version == 5
  other = tiny_model(vocab=48)
  hf_io.save_hf(*other, str(tmp_path / "other"))
  with pytest.raises(ValueError, match="differs from this sampler"):
    s.load_weights(Weights(6, hf_dir=str(tmp_path / "other")))
  with pytest.raises(ValueError, match="neither params nor hf_dir"):
    s.load_weights(Weights(7))
  s.close()
  with pytest.raises(ValueError, match="closed"):
    s.generate(PROMPTS, 1, greedy)


def test_generate_requests_equals_one_generate_call_per_request(model, sampler):
  """Requests sampled together (12 rows in two batches of 8, the second padded; alone each is one
  padded batch) get exactly the completions of their own `generate` call at the same call index."""
  requests = [(PROMPTS[:2], 2, 5), ([PROMPTS[2]], 3, 9), (PROMPTS, 1, 6), ([PROMPTS[0]], 2, 0)]
  saved = sampler.call_count
  together = sampler.generate_requests(requests, SETTINGS)
  assert sampler.call_count == saved  # the call indices are the caller's
  assert [len(g) for g in together] == [2, 1, 3, 1]
  for (prompts, n, call), groups in zip(requests, together):
    sampler.call_count = call
    alone = sampler.generate(prompts, n, SETTINGS)
    for a, b in zip(alone, groups):
      np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
      assert a.prompt_index == b.prompt_index and a.policy_version == b.policy_version
      for x, y in zip(a.completions, b.completions, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
        assert x.finish_reason == y.finish_reason
  sampler.call_count = saved
  # Another call index draws other samples; the per-row keys are those of `generate`.
  other = sampler.generate_requests([(PROMPTS[:2], 2, 4)], SETTINGS)[0]
  assert any((a.tokens.shape != b.tokens.shape) or (a.tokens != b.tokens).any()
             for g, h in zip(other, together[0]) for a, b in zip(g.completions, h.completions))
  base = jax.random.fold_in(jax.random.key(3), 7)
  mixed = jax_sampler._row_keys(base, np.array([2, 2, 5]), np.array([0, 1, 0]))
  expect = [jax.random.fold_in(jax.random.fold_in(base, c), r) for c, r in ((2, 0), (2, 1), (5, 0))]
  np.testing.assert_array_equal(jax.random.key_data(mixed),
                                np.stack([jax.random.key_data(k) for k in expect]))
  with pytest.raises(ValueError, match="n=0"):
    sampler.generate_requests([(PROMPTS, 0, 1)], SETTINGS)
  with pytest.raises(ValueError, match="call index -1"):
    sampler.generate_requests([(PROMPTS, 1, -1)], SETTINGS)


# ---- multi-turn: the KV cache carried across turns ----------------------------------------------

OBSERVATIONS = (np.array([7, 8], np.int32), np.array([9, 10, 11, 12, 13], np.int32))


def _respond(turn, rows, turns):
  """Every row gets OBSERVATIONS[turn] after its turn `turn` (rows of odd index stop after one)."""
  return [OBSERVATIONS[turn] if turn < len(OBSERVATIONS) and not (turn and r % 2) else None
          for r in rows]


class _OneCallPerTurn:
  """The sampler without its `generate_turns`: `run_turns` then re-sends each conversation."""

  def __init__(self, sampler):
    self.sampler = sampler

  def generate(self, prompts, n, sampling):
    return self.sampler.generate(prompts, n, sampling)


def _trajectories(worker, n, sampling, max_total=40):
  driver = TurnDriver([len(p) for p in PROMPTS], n, sampling.max_tokens, max_total, _respond)
  run_turns(worker, PROMPTS, n, sampling, driver)
  return driver.completions()


def test_turns_from_the_cache_have_the_full_forward_logprobs(model, sampler):
  """Sampled multi-turn trajectories (the cache extended by each turn's last token and the
  observation): every policy token's log-prob is the full forward's over the whole conversation
  (prompt, earlier turns and observations re-read from scratch), and the observations sit where
  the driver put them."""
  cfg, params = model
  settings = SamplingParams(temperature=1.0, max_tokens=4)
  comps = _trajectories(sampler, 2, settings)
  seqs = [np.concatenate([PROMPTS[r // 2], c.tokens]) for r, c in enumerate(comps)]
  logits = full_forward_logits(cfg, params, seqs, rows=8, pad_to=48)
  for r, (c, seq) in enumerate(zip(comps, seqs)):
    lp_all = logits[r] - np.log(np.exp(logits[r] - logits[r].max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits[r].max(-1, keepdims=True)
    start = len(PROMPTS[r // 2])
    policy = np.flatnonzero(c.mask > 0)
    want = lp_all[start + policy - 1, seq[start + policy]]
    np.testing.assert_allclose(c.logprobs[policy], want, atol=2e-4)
    np.testing.assert_array_equal(c.logprobs[c.mask == 0], 0.0)
    assert len(c.turn_starts) == (2 if r % 2 else 3)
    for k, obs in enumerate(OBSERVATIONS[:len(c.turn_starts) - 1]):
      at = c.turn_starts[k + 1] - len(obs)
      np.testing.assert_array_equal(c.tokens[at:c.turn_starts[k + 1]], obs)
      np.testing.assert_array_equal(c.mask[at:c.turn_starts[k + 1]], 0.0)


def test_cache_across_turns_equals_re_prefilling_each_turn(model):
  """Greedy: the KV-cache path (`generate_turns`) and one `generate` call per turn with the whole
  conversation as the prompt (vLLM's way) write the same tokens, masks and turn starts, and the
  same log-probs up to float rounding."""
  cfg, params = model
  greedy = SamplingParams(temperature=0.0, max_tokens=4)
  cached = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)
  plain = JaxSampler(cfg, params, max_len=48, batch_size=8, eos_token_ids=(), seed=0)
  a = _trajectories(cached, 1, greedy)
  b = _trajectories(_OneCallPerTurn(plain), 1, greedy)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.mask, y.mask)
    np.testing.assert_array_equal(x.turn_starts, y.turn_starts)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-4)
    assert x.finish_reason == y.finish_reason
