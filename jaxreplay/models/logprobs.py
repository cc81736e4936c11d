"""Per-token log-probs (and entropy) without materialising [B, T, V] logits.

`token_logprobs` runs the trunk once (`transformer.hidden_states`) and then the LM head chunk by chunk
over the sequence axis under `jax.lax.map`; each chunk's function is `jax.checkpoint`ed (`remat`), so
the backward pass recomputes that chunk's [B, chunk, V] logits instead of keeping all of them.
With one chunk (T <= chunk_size) the checkpoint saves no peak memory (the backward needs the whole
[B, T, V] logits either way) and costs a second LM-head matmul and log-softmax; `remat="auto"`
(the default) then skips it.
"""
from __future__ import annotations

from typing import Optional

REMAT_MODES = ("auto", "always", "never")

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
  # The target's entry through a one-hot product, not take_along_axis: the same value (the other
  # terms are exact zeros), and its gradient is a dense multiply where take_along_axis's is a
  # scatter, which XLA's CPU backend runs ~1.7x slower for the whole LM-head backward.
  logp = jnp.sum(logp_all * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp_all.dtype),
                 axis=-1)
  if not return_entropy:
    return logp, None
  # -sum p log p from log-probs, not logsumexp - E[logit]: no cancellation when one token dominates.
  return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def token_logprobs(cfg: ModelConfig, params: dict, tokens: jax.Array, targets: jax.Array,
                   positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                   chunk_size: int = 512, return_entropy: bool = False, remat: str = "auto",
                   single_sequence_rows: bool = False):
  """log p(targets[b, t] | tokens[b, :t+1]) for every position.

  Args:
    tokens, targets: int32 [B, T] (targets are usually tokens shifted left by one).
    positions, segment_ids: as in `transformer.hidden_states` (0 = padding; padded positions give
      finite values that callers mask out).
    chunk_size: positions per LM-head chunk; with two or more chunks (and remat not "never") at
      most [B, chunk_size, V] float32 logits exist at a time, forward and backward. T is padded up
      to a multiple of the chunk (then sliced back).
    return_entropy: also return the entropy (nats) of the full next-token distribution.
    remat: recompute each chunk's logits in the backward pass ("always"), never ("never": all of
      [B, T, V] is kept from the forward to the backward), or "auto": only when there are two or
      more chunks (with one, the backward holds all of [B, T, V] anyway). Values are identical.
    single_sequence_rows: every row is one right-padded sequence (an unpacked batch): lets cuDNN
      attention mask by lengths instead of a dense bias (`transformer.hidden_states`).
  Returns:
    float32 [B, T] log-probs, and float32 [B, T] entropies when `return_entropy`.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  if remat not in REMAT_MODES:
    raise ValueError(f"remat={remat!r}: expected one of {REMAT_MODES}")
  if targets.shape != tokens.shape:
    raise ValueError(f"targets shape {targets.shape} must equal tokens shape {tokens.shape}")
  params = layout.unpad(cfg, params, layers=False)
  h = transformer.hidden_states(cfg, params, tokens, positions, segment_ids,
                                single_sequence_rows)  # [B, T, D]
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

  def one_chunk(xs):
    return _chunk_stats(cfg, params, xs[0], xs[1], return_entropy)

  if remat == "always" or (remat == "auto" and n > 1):
    one_chunk = jax.checkpoint(one_chunk)
  if n == 1:  # no loop: [B, T, V] in one piece
    logp, ent = jax.tree.map(lambda x: x[None], one_chunk((h_chunks[0], t_chunks[0])))
  else:
    logp, ent = jax.lax.map(one_chunk, (h_chunks, t_chunks))
  logp = logp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  if not return_entropy:
    return logp
  return logp, ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
