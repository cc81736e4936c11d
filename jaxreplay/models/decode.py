"""KV-cache decoding: `init_cache`, `prefill` of right-padded prompts, one-token `decode_step`s,
and `extend` (tokens appended to a filled cache: the next turn of a multi-turn trajectory).

All shapes are static, so the three functions jit with `cfg` static (and the cache donated). Each row
keeps its own length: rows with different prompt lengths decode side by side, each writing its next
token at its own position.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxreplay.models import layout
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig


class KVCache(NamedTuple):
  """Per-layer keys / values and per-row fill levels.

  k, v: [L, B, max_len, Hkv, hd] in the compute dtype; keys are stored after q/k-norm and RoPE.
  lengths: int32 [B], the number of valid positions of each row (= the position the next token gets).
  """
  k: jax.Array
  v: jax.Array
  lengths: jax.Array


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` tokens (prompt + generated)."""
  if batch_size < 1 or max_len < 1:
    raise ValueError(f"batch_size={batch_size} and max_len={max_len} must both be >= 1")
  shape = (cfg.num_hidden_layers, batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim)
  # Two separate buffers (not one shared zeros array), so that the cache can be donated to jit.
  return KVCache(k=jnp.zeros(shape, cfg.compute_dtype), v=jnp.zeros(shape, cfg.compute_dtype),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def _check_cache(cfg: ModelConfig, cache: KVCache, batch_size: int, what: str) -> None:
  expected = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim)
  got = (cache.k.shape[0], cache.k.shape[1], cache.k.shape[3], cache.k.shape[4])
  if cache.k.ndim != 5 or got != expected:
    raise ValueError(f"{what}: cache k has shape {cache.k.shape}, expected "
                     f"[L={expected[0]}, B={batch_size}, max_len, Hkv={expected[2]}, hd={expected[3]}]; "
                     "build it with init_cache(cfg, batch_size, max_len)")


def prefill(cfg: ModelConfig, params: dict, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Runs right-padded prompts through the model and fills the cache from position 0.

  Args:
    tokens: int32 [B, Lp], row b's prompt in tokens[b, :lengths[b]], anything after (padding).
    lengths: int32 [B], true prompt lengths, 1 <= lengths[b] <= Lp.
    cache: from `init_cache(cfg, B, max_len)` with max_len >= Lp; its previous content is replaced.
  Returns:
    (float32 logits [B, V] at each row's last prompt token, the cache with lengths = `lengths`).
  """
  transformer.check_supported(cfg)
  params = layout.unpad(cfg, params, layers=False)
  b, lp = tokens.shape
  _check_cache(cfg, cache, b, "prefill")
  max_len = cache.k.shape[2]
  if lp > max_len:
    raise ValueError(f"prefill: prompt length {lp} exceeds the cache's max_len {max_len}; "
                     "build the cache with init_cache(cfg, batch_size, max_len >= prompt length)")
  lengths = lengths.astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(lp, dtype=jnp.int32), (b, lp))
  segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
  mask = transformer.attention_mask(segment_ids)
  dtype = cache.k.dtype

  def attend(q, k, v):
    out = transformer.attention(q, k, v, mask, cfg.attention, causal=True)
    return out, (k.astype(dtype), v.astype(dtype))

  def layer(x, lp_):
    return transformer.block(cfg, layout.unpad_layer(cfg, lp_), x, positions, attend)

  x, (ks, vs) = jax.lax.scan(layer, transformer.embed(cfg, params, tokens), params["layers"])
  last = jnp.clip(lengths - 1, 0, lp - 1)
  h = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, D]
  h = transformer.rms_norm(h, params["norm"], cfg.rms_norm_eps)
  logits = transformer.lm_head(cfg, params, h)
  k = jax.lax.dynamic_update_slice(cache.k, ks, (0, 0, 0, 0, 0))
  v = jax.lax.dynamic_update_slice(cache.v, vs, (0, 0, 0, 0, 0))
  return logits, KVCache(k=k, v=v, lengths=lengths)


def decode_step(cfg: ModelConfig, params: dict, tokens: jax.Array,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Appends one token per row at that row's position `cache.lengths[b]` and returns its logits.

  Args:
    tokens: int32 [B], the next token of every row.
    cache: filled by `prefill` (and earlier steps); every row needs lengths[b] < max_len (a write
      past the end is dropped by the scatter, so stop sampling before the cache is full).
  Returns:
    (float32 logits [B, V] for the token after `tokens`, the cache with lengths + 1).
  """
  transformer.check_supported(cfg)
  params = layout.unpad(cfg, params, layers=False)
  if tokens.ndim != 1:
    raise ValueError(f"decode_step: tokens must be int32 [batch], got shape {tokens.shape}")
  b = tokens.shape[0]
  _check_cache(cfg, cache, b, "decode_step")
  max_len = cache.k.shape[2]
  pos = cache.lengths.astype(jnp.int32)                            # [B]
  rows = jnp.arange(b)
  mask = (jnp.arange(max_len)[None, :] <= pos[:, None])[:, None, :]  # [B, 1, max_len]

  def layer(carry, xs):
    x, k_cache, v_cache = carry
    lp_, i = xs

    def attend(q, k, v):
      kc = k_cache.at[i, rows, pos].set(k[:, 0].astype(k_cache.dtype))
      vc = v_cache.at[i, rows, pos].set(v[:, 0].astype(v_cache.dtype))
      # One query per row: nothing for flash attention to tile, so cuDNN is never asked here.
      impl = "einsum" if cfg.attention == "einsum" else "xla"
      out = transformer.attention(q, kc[i].astype(q.dtype), vc[i].astype(q.dtype), mask, impl)
      return out, (kc, vc)

    x, (k_cache, v_cache) = transformer.block(cfg, layout.unpad_layer(cfg, lp_), x, pos[:, None],
                                              attend)
    return (x, k_cache, v_cache), None

  x = transformer.embed(cfg, params, tokens[:, None])
  layer_ids = jnp.arange(cfg.num_hidden_layers)
  (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], layer_ids))
  h = transformer.rms_norm(x[:, 0], params["norm"], cfg.rms_norm_eps)
  return transformer.lm_head(cfg, params, h), KVCache(k=k, v=v, lengths=pos + 1)


def extend(cfg: ModelConfig, params: dict, tokens: jax.Array, lengths: jax.Array,
           cache: KVCache) -> tuple[jax.Array, KVCache]:
  """Appends right-padded tokens to every row of a filled cache (a multi-turn trajectory's next
  observation, prefilled into the cache the previous turns left).

  Args:
    tokens: int32 [B, La]; row b appends tokens[b, :lengths[b]] at positions cache.lengths[b]
      onwards, each attending to the row's cached tokens and causally to the ones appended
      before it (anything after lengths[b] is padding).
    lengths: int32 [B], 0 <= lengths[b] <= La (0: the row is left as it is).
    cache: filled by `prefill` / `decode_step` / `extend`; cache.lengths + lengths <= max_len
      (writes past the end are dropped).
  Returns:
    (float32 logits [B, V] after each row's last appended token (unspecified for lengths 0), the
    cache with lengths + `lengths`).
  """
  transformer.check_supported(cfg)
  params = layout.unpad(cfg, params, layers=False)
  b, la = tokens.shape
  _check_cache(cfg, cache, b, "extend")
  max_len = cache.k.shape[2]
  lengths = lengths.astype(jnp.int32)
  start = cache.lengths.astype(jnp.int32)
  positions = start[:, None] + jnp.arange(la, dtype=jnp.int32)[None, :]       # [B, La]
  rows = jnp.arange(b)[:, None]
  mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]          # [B, La, max_len]
  impl = "einsum" if cfg.attention == "einsum" else "xla"

  def layer(carry, xs):
    x, k_cache, v_cache = carry
    lp_, i = xs

    def attend(q, k, v):
      kc = k_cache.at[i, rows, positions].set(k.astype(k_cache.dtype), mode="drop")
      vc = v_cache.at[i, rows, positions].set(v.astype(v_cache.dtype), mode="drop")
      out = transformer.attention(q, kc[i].astype(q.dtype), vc[i].astype(q.dtype), mask, impl)
      return out, (kc, vc)

    x, (k_cache, v_cache) = transformer.block(cfg, layout.unpad_layer(cfg, lp_), x, positions,
                                              attend)
    return (x, k_cache, v_cache), None

  x = transformer.embed(cfg, params, tokens)
  layer_ids = jnp.arange(cfg.num_hidden_layers)
  (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), (params["layers"], layer_ids))
  last = jnp.clip(lengths - 1, 0, la - 1)
  h = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  h = transformer.rms_norm(h, params["norm"], cfg.rms_norm_eps)
  return transformer.lm_head(cfg, params, h), KVCache(k=k, v=v, lengths=start + lengths)
