"""Tests of partial rollouts (`rollout.partial`): the chunked requests in flight (`InFlight`), and a
real JAX sampler in a pool whose request is continued across a weight refresh: each token carries
the version that sampled it, the prefix is never regenerated, and every token's log-prob is its
own version's given the whole context (the prefix's KV recomputed under the new weights)."""
import dataclasses

import jax
import numpy as np
import pytest

from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.rollout import partial
from jaxreplay.rollout.base import Completion, Group, PromptBatch, SamplingParams, Weights
from jaxreplay.rollout.pool import WorkerPool
from tests.helpers import tolerances
from tests.helpers.pool_fakes import Recorder


def _batch(prompts, n=2, max_tokens=10):
  return PromptBatch([np.asarray(p, np.int32) for p in prompts], n,
                     SamplingParams(max_tokens=max_tokens), meta=len(prompts))


def _answer(chunk, lengths, version, stop_at=()):
  """One group per context of `chunk`: `lengths[i]` tokens (7s), "stop" for the indices in
  `stop_at`, else "length"."""
  out = []
  for i, (ctx, k) in enumerate(zip(chunk.contexts, lengths)):
    c = Completion(np.full(k, 7, np.int32), np.full(k, -0.5, np.float32),
                   "stop" if i in stop_at else "length")
    out.append(Group(ctx, [c], version, i))
  return out


def test_in_flight_chunks_room_and_finishing():
  held = partial.InFlight(chunk_tokens=4, requests_per_call=2)
  assert held.has_room() and held.rows == 0
  held.add(_batch([[1, 2], [3]], n=2, max_tokens=6))  # 4 rows
  assert held.has_room()  # a second request of 4 rows fits 2 requests' rows
  held.add(_batch([[5]], n=4, max_tokens=6))
  assert not held.has_room() and held.rows == 8 and held.requests == 2
  (chunk,) = held.chunks()
  assert chunk.sampling.max_tokens == 4 and len(chunk.contexts) == 8
  np.testing.assert_array_equal(chunk.contexts[2], [3])  # prompt-major, n per prompt
  # Rows 0 and 1 stop (request 0's first prompt), the others gain 4 of their 6 tokens.
  assert held.absorb(chunk, _answer(chunk, [2, 3, 4, 4, 4, 4, 4, 4], 5, stop_at=(0, 1)), 5,
                     seconds=1.0) == 29
  assert held.started_rows() == 6 and held.rows == 6 and held.pop_finished() == []
  (chunk,) = held.chunks()
  assert chunk.sampling.max_tokens == 2  # the room left (6 - 4) caps the chunk
  np.testing.assert_array_equal(chunk.contexts[0], [3, 7, 7, 7, 7])  # prompt + tokens so far
  held.absorb(chunk, _answer(chunk, [2] * 6, 6), 6, seconds=1.0)
  first, second = held.pop_finished()
  assert held.requests == 0 and held.rows == 0 and held.has_room()
  assert first.policy_version == 5 and first.num_tokens == 2 + 3 + 6 + 6
  g0, g1 = first.groups
  assert [c.finish_reason for c in g0.completions + g1.completions] == ["stop"] * 2 + ["length"] * 2
  np.testing.assert_array_equal(g1.completions[0].versions, [5] * 4 + [6] * 2)
  np.testing.assert_array_equal(g0.completions[1].versions, [5] * 3)
  assert second.groups[0].policy_version == 5 and len(second.groups[0].completions) == 4
  # seconds shared by tokens: 1 s over 29 tokens, then 1 s over 12 tokens
  np.testing.assert_allclose(first.seconds + second.seconds, 2.0)
  np.testing.assert_allclose(first.seconds, 13 / 29 + 4 / 12)
  assert partial.distinct_versions(first.groups) == 1 + 1 + 2 + 2


def test_in_flight_refuses_malformed_answers():
  held = partial.InFlight(chunk_tokens=3)
  held.add(_batch([[1]], n=1))
  (chunk,) = held.chunks()
  with pytest.raises(RuntimeError, match="1 continued sequences"):
    held.absorb(chunk, [], 0, 0.0)
  with pytest.raises(RuntimeError, match="held version 1"):
    held.absorb(chunk, _answer(chunk, [3], 0), 1, 0.0)
  with pytest.raises(RuntimeError, match="returned 4 tokens"):
    held.absorb(chunk, _answer(chunk, [4], 0), 0, 0.0)
  assert [b.meta for b in held.drain()] == [1] and held.requests == 0
  with pytest.raises(ValueError, match="chunk_tokens"):
    partial.InFlight(0)


class _Recording:
  """A JAX sampler that records each call's contexts and runs `after(calls)` after each call."""

  def __init__(self, sampler, after):
    self.sampler, self.after, self.calls = sampler, after, []

  def __getattr__(self, name):
    return getattr(self.sampler, name)

  def generate(self, prompts, n, sampling):
    self.calls.append(([np.asarray(p).copy() for p in prompts], self.sampler.policy_version))
    out = self.sampler.generate(prompts, n, sampling)
    self.after(len(self.calls))
    return out


def test_jax_sampler_request_continued_across_a_refresh():
  from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  cfg = presets.tiny()
  params = {0: transformer.init_params(cfg, jax.random.key(0)),
            1: transformer.init_params(cfg, jax.random.key(1))}
  sampling = SamplingParams(temperature=1.0, max_tokens=12)
  prompt = np.array([1, 5, 6, 7], np.int32)
  sent = []

  def source(i):
    if sent:
      return None
    sent.append(i)
    return PromptBatch([prompt], 3, sampling, meta=0)

  rec, pool, workers = Recorder(), None, []

  def refresh_after_two_chunks(calls):
    if calls == 2:
      pool.refresh(Weights(1, params=params[1], cfg=cfg))

  def make_worker(i):
    workers.append(_Recording(JaxSampler(cfg, params[0], max_len=32, batch_size=4,
                                         eos_token_ids=(), seed=i), refresh_after_two_chunks))
    return workers[-1]

  pool = WorkerPool(make_worker, 1, source, rec.sink, initial_weights=Weights(0, params=params[0]),
                    partial_chunk_tokens=4)
  pool.start()
  try:
    rec.wait_for(lambda ds: len(ds) >= 1, timeout=300)
    pool.raise_if_failed()
    m = pool.metrics()
  finally:
    pool.stop(30)
  (d,) = rec.deliveries
  (g,) = d.groups
  assert d.policy_version == 0 and g.policy_version == 0 and m["continued"] == 3
  calls = workers[0].calls
  assert [v for _, v in calls] == [0, 0, 1]
  for j, c in enumerate(g.completions):
    assert len(c.tokens) == 12 and c.finish_reason == "length"
    np.testing.assert_array_equal(c.versions, [0] * 8 + [1] * 4)
    for k, (contexts, _) in enumerate(calls):  # nothing regenerated
      np.testing.assert_array_equal(contexts[j], np.r_[prompt, c.tokens[:4 * k]])
    seq = np.r_[prompt, c.tokens]
    for version in (0, 1):  # each token's log-prob is its own version's, given the whole context
      lp = np.asarray(logprobs_lib.token_logprobs(cfg, params[version], seq[None, :-1],
                                                  seq[None, 1:]))[0, prompt.size - 1:]
      mine = c.versions == version
      tol = tolerances.close(np.float32, cfg.hidden_size * cfg.num_hidden_layers, 10.0)
      np.testing.assert_allclose(c.logprobs[mine], lp[mine], atol=tol["atol"], rtol=0)
      # ... and not the other version's (the two random policies differ by far more)
      assert np.abs(c.logprobs[~mine] - lp[~mine]).max() > 100 * tol["atol"]
  # The three samples of the prompt differ (each row its own noise).
  assert len({tuple(c.tokens) for c in g.completions}) == 3
