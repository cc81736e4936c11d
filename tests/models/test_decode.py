"""KV-cache decoding (`models.decode`): prefill + decode steps equal the full forward; cache errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import decode, transformer
from tests.helpers.deps import require
from tests.helpers.hf_reference import random_tokens, setup

torch = require("torch")
transformers = require("transformers")

apply = jax.jit(transformer.apply, static_argnums=0)
# The sampler donates the cache: the tests do too (k and v must be distinct buffers).
prefill = jax.jit(decode.prefill, static_argnums=0, donate_argnums=4)
decode_step = jax.jit(decode.decode_step, static_argnums=0, donate_argnums=3)


@pytest.mark.parametrize("name", ["qwen3_tied_hd32", "llama3_scaled"])
def test_decode_matches_full_forward(name):
  cfg, _, params = setup(name)
  lengths = np.array([5, 9, 2], np.int32)
  steps, lp, max_len = 6, 9, 16
  prompts = random_tokens(cfg, (3, lp), seed=2)
  gen = random_tokens(cfg, (3, steps), seed=3)
  # Full sequences prompt_b + gen_b, right-padded with other junk than the prompts' padding.
  full = random_tokens(cfg, (3, lp + steps), seed=4)
  for b, n in enumerate(lengths):
    full[b, :n] = prompts[b, :n]
    full[b, n:n + steps] = gen[b]
  ref = np.asarray(apply(cfg, params, jnp.asarray(full)))

  cache = decode.init_cache(cfg, 3, max_len)
  assert cache.k.shape == (cfg.num_hidden_layers, 3, max_len, cfg.num_key_value_heads, cfg.head_dim)
  logits, cache = prefill(cfg, params, jnp.asarray(prompts), jnp.asarray(lengths), cache)
  got, want = [np.asarray(logits)], [ref[np.arange(3), lengths - 1]]
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  for j in range(steps):
    logits, cache = decode_step(cfg, params, jnp.asarray(gen[:, j]), cache)
    got.append(np.asarray(logits))
    want.append(ref[np.arange(3), lengths + j])
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + steps)
  got, want = np.stack(got), np.stack(want)
  scale = max(1.0, float(np.abs(want).max()))
  assert float(np.abs(got - want).max()) <= 1e-4 * scale


def test_cache_shape_errors():
  cfg, _, params = setup("qwen3_tied_hd32")
  cache = decode.init_cache(cfg, 2, 4)
  with pytest.raises(ValueError, match="max_len"):
    decode.prefill(cfg, params, jnp.zeros((2, 6), jnp.int32), jnp.array([6, 6]), cache)
  with pytest.raises(ValueError, match="init_cache"):
    decode.decode_step(cfg, params, jnp.zeros((3,), jnp.int32), cache)


extend = jax.jit(decode.extend, static_argnums=0, donate_argnums=4)


@pytest.mark.parametrize("name", ["qwen3_tied_hd32", "llama3_scaled"])
def test_extend_equals_prefilling_the_whole_sequence(name):
  """Prefill, a decode step, then appended chunks of different lengths per row (0: the row waits):
  the logits after each row's last appended token equal the full forward's at that position, and
  a decode step after the extend continues from the right place."""
  cfg, _, params = setup(name)
  lengths = np.array([4, 7, 2], np.int32)
  full = random_tokens(cfg, (3, 24), seed=5)
  ref = np.asarray(apply(cfg, params, jnp.asarray(full)))
  scale = max(1.0, float(np.abs(ref).max()))
  cache = decode.init_cache(cfg, 3, 24)
  _, cache = prefill(cfg, params, jnp.asarray(full[:, :8]), jnp.asarray(lengths), cache)
  at = lengths.copy()
  for appended in ([3, 0, 5], [1, 4, 0], [6, 2, 3]):
    appended = np.asarray(appended, np.int32)
    chunk = np.zeros((3, 8), np.int32)
    for b in range(3):
      chunk[b, :appended[b]] = full[b, at[b]:at[b] + appended[b]]
    logits, cache = extend(cfg, params, jnp.asarray(chunk), jnp.asarray(appended), cache)
    at = at + appended
    np.testing.assert_array_equal(np.asarray(cache.lengths), at)
    rows = appended > 0
    got = np.asarray(logits)[rows]
    want = ref[np.arange(3)[rows], at[rows] - 1]
    assert float(np.abs(got - want).max()) <= 1e-4 * scale
  logits, cache = decode_step(cfg, params, jnp.asarray(full[np.arange(3), at]), cache)
  want = ref[np.arange(3), at]
  assert float(np.abs(np.asarray(logits) - want).max()) <= 1e-4 * scale
