"""Per-token log-probs (and entropy) without materialising [B, T, V] logits.

`token_logprobs` runs the trunk once (`transformer.hidden_states`) and then the LM head chunk by chunk
over the sequence axis under `jax.lax.map`; each chunk's function is `jax.checkpoint`ed, so the backward
pass recomputes that chunk's [B, chunk, V] logits instead of keeping all of them.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxreplay.models import layout
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig


def logprobs_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Reference: log_softmax(logits)[..., targets]; logits [..., V], int targets [...] -> float32 [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis; [..., V] -> float32 [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _chunk_stats(cfg: ModelConfig, params: dict, h: jax.Array, targets: jax.Array,
                 return_entropy: bool):
  """h [B, C, D], targets [B, C] -> (logprobs f32 [B, C], entropy f32 [B, C] or None)."""
  logits = transformer.lm_head(cfg, params, h)  # f32 [B, C, V]
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  if not return_entropy:
    return logp, None
  # -sum p log p from log-probs, not logsumexp - E[logit]: no cancellation when one token dominates.
  return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def token_logprobs(cfg: ModelConfig, params: dict, tokens: jax.Array, targets: jax.Array,
                   positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                   chunk_size: int = 512, return_entropy: bool = False):
  """log p(targets[b, t] | tokens[b, :t+1]) for every position.

  Args:
    tokens, targets: int32 [B, T] (targets are usually tokens shifted left by one).
    positions, segment_ids: as in `transformer.hidden_states` (0 = padding; padded positions give
      finite values that callers mask out).
    chunk_size: positions per LM-head chunk; at most [B, chunk_size, V] float32 logits exist at a
      time, forward and backward. T is padded up to a multiple of the chunk (then sliced back).
    return_entropy: also return the entropy (nats) of the full next-token distribution.
  Returns:
    float32 [B, T] log-probs, and float32 [B, T] entropies when `return_entropy`.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  if targets.shape != tokens.shape:
    raise ValueError(f"targets shape {targets.shape} must equal tokens shape {tokens.shape}")
  params = layout.unpad(cfg, params, layers=False)
  h = transformer.hidden_states(cfg, params, tokens, positions, segment_ids)  # [B, T, D]
  b, t, d = h.shape
  chunk = min(chunk_size, t)
  n = -(-t // chunk)
  pad = n * chunk - t
  targets = targets.astype(jnp.int32)
  if pad:
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h_chunks = h.reshape(b, n, chunk, d).swapaxes(0, 1)           # [n, B, C, D]
  t_chunks = targets.reshape(b, n, chunk).swapaxes(0, 1)        # [n, B, C]

  @jax.checkpoint
  def one_chunk(xs):
    return _chunk_stats(cfg, params, xs[0], xs[1], return_entropy)

  logp, ent = jax.lax.map(one_chunk, (h_chunks, t_chunks))
  logp = logp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  if not return_entropy:
    return logp
  return logp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
