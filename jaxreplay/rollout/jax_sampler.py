"""The `jax` rollout backend: batched sampling with the KV-cache decoder of `jaxreplay.models`.

Sampling order (vLLM's, `vllm/v1/sample/sampler.py`): temperature, then top-k, then top-p.
  1. logits / temperature;
  2. top-k: keep the tokens whose tempered logit is >= the k-th largest (ties at the k-th value
     are all kept, as in vLLM);
  3. top-p (nucleus) on the distribution left after top-k: keep the smallest prefix of tokens, in
     decreasing probability, whose cumulative probability is >= top_p; the most likely token is
     always kept. Tokens tied with the least likely kept token are kept too, so the filter does not
     depend on how a sort orders equal values (vLLM's own tie-break is its sort order; the two agree
     whenever the boundary probability is not tied).
Removed tokens get logit -inf; the sampling distribution is softmax of what remains.

Log-probs. Each sampled token carries its log-prob under the distribution it was actually drawn
from, after temperature, top-k and top-p ("processed" log-probs, vLLM's
`logprobs_mode="processed_logprobs"`): that is the behaviour policy pi_old of the importance ratio.
Temperature < 1e-5 (vLLM's `_SAMPLING_EPS`) means greedy: the argmax of the raw logits, with
log-prob 0.0 (the greedy policy puts all its mass on that token).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay import models
from jaxreplay.rollout.base import Completion, Group, SamplingParams

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily.


# ---- pure sampling math -------------------------------------------------------------------------

def _per_row(x, logits):
  """A scalar or [...] setting as an array broadcastable against logits [..., V]."""
  return jnp.asarray(x)[..., None] if jnp.ndim(x) else jnp.asarray(x)


def filter_logits(logits: jax.Array, temperature, top_k=None, top_p=None) -> jax.Array:
  """Temperature, then top-k, then top-p; removed tokens get -inf.

  Args:
    logits: float [..., V] raw model logits.
    temperature: float scalar or [...], > 0 (greedy is handled by `sample_token`).
    top_k: None (off) or int scalar or [...]; values <= 0 or >= V disable it for that row.
    top_p: None (off) or float scalar or [...] in (0, 1]; 1.0 disables it for that row.
  Returns:
    float32 [..., V]: the tempered logits, -inf where filtered out. Every row keeps >= 1 token.
  """
  x = logits.astype(jnp.float32) / _per_row(temperature, logits).astype(jnp.float32)
  if top_k is None and top_p is None:
    return x
  vocab = x.shape[-1]
  neg_inf = jnp.float32(-jnp.inf)
  desc = -jnp.sort(-x, axis=-1)  # [..., V], decreasing
  if top_k is not None:
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), x.shape[:-1])
    k = jnp.where((k <= 0) | (k >= vocab), vocab, k)
    kth = jnp.take_along_axis(desc, (k - 1)[..., None], axis=-1)  # [..., 1]
    x = jnp.where(x < kth, neg_inf, x)
    desc = jnp.where(desc < kth, neg_inf, desc)
  if top_p is not None:
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), x.shape[:-1])[..., None]
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    # Keep while the mass before a token is < p: the smallest prefix reaching >= p. `p >= 1`
    # disables the filter (float cumsums can reach 1.0 before the tail and would cut it).
    keep = (mass_before < p) | (p >= 1.0)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)  # keep is a prefix
    cutoff = jnp.take_along_axis(desc, num_keep - 1, axis=-1)
    x = jnp.where(x < cutoff, neg_inf, x)
  return x


def sample_token(rng: jax.Array, logits: jax.Array, temperature, top_k=None, top_p=None):
  """Draws one token per row and returns its processed log-prob.

  Args:
    rng: one PRNG key (noise for all rows from it) or a key array of shape [B] (one per row);
      typed keys (`jax.random.key`) or raw uint32 keys (`jax.random.PRNGKey`).
    logits: float [B, V] raw model logits.
    temperature: float scalar or [B]; rows with temperature < 1e-5 are greedy.
    top_k, top_p: as in `filter_logits` (None disables the filter for all rows).
  Returns:
    tokens int32 [B]; logprobs float32 [B]: log-prob of each token under the distribution it was
    sampled from (after temperature, top-k, top-p); 0.0 for greedy rows.
  """
  if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy = temperature < GREEDY_EPS
  safe_t = jnp.where(greedy, 1.0, temperature)
  filtered = filter_logits(logits, safe_t, top_k, top_p)
  if rng.ndim == 0:
    gumbel = jax.random.gumbel(rng, filtered.shape, jnp.float32)
  else:
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[-1:], jnp.float32))(rng)
  sampled = jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)  # Gumbel-max: exact
  logp = jax.nn.log_softmax(filtered, axis=-1)
  sampled_lp = jnp.take_along_axis(logp, sampled[:, None], axis=-1)[:, 0]
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  tokens = jnp.where(greedy, argmax, sampled)
  return tokens, jnp.where(greedy, 0.0, sampled_lp).astype(jnp.float32)
