"""Per-token log-probs (and entropy) without materialising [B, T, V] logits.

`token_logprobs` runs the trunk once (`transformer.hidden_states`) and then the LM head chunk by chunk
over the sequence axis under `jax.lax.map`; each chunk's function is `jax.checkpoint`ed (`remat`), so
the backward pass recomputes that chunk's [B, chunk, V] logits instead of keeping all of them.
With one chunk (T <= chunk_size) the checkpoint saves no peak memory (the backward needs the whole
[B, T, V] logits either way) and costs a second LM-head matmul and log-softmax; `remat="auto"`
(the default) then skips it.

`processing` (a `LogprobProcessing`) gives the log-probs of the distribution a sampler with that
temperature / top-k / top-p draws from (`filter_logits`, the samplers' own filter), instead of
log_softmax of the raw logits; see `LogprobProcessing` for why the training ratio needs it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

REMAT_MODES = ("auto", "always", "never")
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS (= rollout.base.GREEDY_EPS): samplers are greedy below it

import jax
import jax.numpy as jnp

from jaxreplay.models import layout
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig


def _per_row(x):
  """A scalar or [...] setting as an array broadcastable against logits [..., V]."""
  return jnp.asarray(x)[..., None] if jnp.ndim(x) else jnp.asarray(x)


def filter_logits(logits: jax.Array, temperature, top_k=None, top_p=None) -> jax.Array:
  """Temperature, then top-k, then top-p (vLLM's order); removed tokens get -inf.

  The one definition of the samplers' truncation (`rollout.jax_sampler` samples with it, the
  trainer recomputes it with `LogprobProcessing`); `rollout/jax_sampler.py`'s docstring states the
  tie rules (ties at the k-th value and at the top-p cutoff are kept).

  Args:
    logits: float [..., V] raw model logits.
    temperature: float scalar or [...], > 0 (greedy is handled by the sampler).
    top_k: None (off) or int scalar or [...]; values <= 0 or >= V disable it for that row.
    top_p: None (off) or float scalar or [...] in (0, 1]; 1.0 disables it for that row.
  Returns:
    float32 [..., V]: the tempered logits, -inf where filtered out. Every row keeps >= 1 token.
  """
  x = logits.astype(jnp.float32) / _per_row(temperature).astype(jnp.float32)
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


@dataclasses.dataclass(frozen=True)
class LogprobProcessing:
  """The sampling distribution whose log-probs the trainer computes (hashable: a jit static).

  Both samplers store "processed" log-probs (`rollout.jax_sampler`, vLLM's
  `logprobs_mode="processed_logprobs"`): those of q = softmax(filter(logits / temperature)), the
  truncated distribution each token was actually drawn from. That is the right behaviour policy of
  the importance ratio (the samples come from q, not from the full softmax). The ratio's numerator
  must then be the policy being trained in the same form: the trainer's own logits through the same
  temperature and top-k / top-p filter, log q_theta(y) = z_y / T - logsumexp_{kept}(z / T). Storing
  full-distribution behaviour log-probs instead would also give a ratio of 1 on fresh rollouts, but
  a wrong one: the tokens were not drawn from the full distribution, and the tokens outside the
  nucleus, which the sampler can never produce, would silently drop out of the objective. With the
  raw trainer log-probs (the behaviour before issue 27) the ratio on fresh rollouts is
  p_theta(y) / q(y) = (mass of the kept set) < 1 for top-p < 1, and (for T != 1) tempered on top:
  the clip and every off-policy correction see a bias that is not staleness.

  The kept set is recomputed from the trainer's logits (no gradient through the choice), united with
  the target token: a stale token that fell out of the current nucleus keeps a finite log-prob
  (its share of kept set + itself) rather than -inf; on fresh rollouts the target is always in the
  sampler's kept set, so with the trainer's logits equal to the sampler's the sets agree and the
  ratio is 1. Gradients flow through the kept logits (renormalised over the kept set) and 1/T.

  temperature: >= GREEDY_EPS. top_k: 0 = off. top_p: 1.0 = off.
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= GREEDY_EPS:
      raise ValueError(f"temperature={self.temperature} must be >= {GREEDY_EPS} (below it the "
                       "samplers are greedy: there is no sampling distribution to train on)")
    if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 and top_p={self.top_p} in (0, 1]")

  @property
  def is_identity(self) -> bool:
    """Whether the processed distribution is the raw softmax (temperature 1, no filter)."""
    return self.temperature == 1.0 and self.top_k == 0 and self.top_p >= 1.0


def logprobs_from_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Reference: log_softmax(logits)[..., targets]; logits [..., V], int targets [...] -> float32 [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy_from_logits(logits: jax.Array) -> jax.Array:
  """Entropy (nats) of softmax(logits) over the last axis; [..., V] -> float32 [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _processed_stats(logits: jax.Array, targets: jax.Array, processing: LogprobProcessing,
                     return_entropy: bool):
  """logits f32 [B, C, V] -> (log q_theta(targets), entropy of q_theta or None), q_theta the
  processed distribution (LogprobProcessing) with the target kept."""
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.bool_)
  top_k = processing.top_k if processing.top_k > 0 else None
  top_p = processing.top_p if processing.top_p < 1.0 else None
  kept = jnp.isfinite(filter_logits(jax.lax.stop_gradient(logits), processing.temperature,
                                    top_k, top_p)) | onehot
  x = jnp.where(kept, logits / jnp.float32(processing.temperature), -jnp.inf)
  logp_all = jax.nn.log_softmax(x, axis=-1)
  logp = jnp.sum(jnp.where(onehot, logp_all, 0.0), axis=-1)
  if not return_entropy:
    return logp, None
  return logp, -jnp.sum(jnp.where(kept, jnp.exp(logp_all) * logp_all, 0.0), axis=-1)


def _chunk_stats(cfg: ModelConfig, params: dict, h: jax.Array, targets: jax.Array,
                 return_entropy: bool, processing: Optional[LogprobProcessing] = None):
  """h [B, C, D], targets [B, C] -> (logprobs f32 [B, C], entropy f32 [B, C] or None)."""
  logits = transformer.lm_head(cfg, params, h)  # f32 [B, C, V]
  if processing is not None:
    return _processed_stats(logits, targets, processing, return_entropy)
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
                   processing: Optional[LogprobProcessing] = None,
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
    processing: None (log_softmax of the raw logits), or the sampling distribution whose
      log-probs (and entropy) to return (`LogprobProcessing`); one whose `is_identity` holds is
      treated as None (the same computation, bit for bit).
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
  if processing is not None and processing.is_identity:
    processing = None
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
    return _chunk_stats(cfg, params, xs[0], xs[1], return_entropy, processing)

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
