"""The functional model (`models.transformer`) against transformers' own Qwen3 / Qwen2 / Llama
(torch CPU, float32), and its internal consistency: padding and packing, remat, bf16, attention
kernels (KV-cache decoding: test_decode.py; chunked log-probs: test_logprobs.py)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import hf_io, presets, transformer
from jaxreplay.models.config import ModelConfig
from tests.helpers import tolerances
from tests.helpers.deps import require
from tests.helpers.hf_reference import CONFIGS, random_tokens, setup, small

torch = require("torch")
transformers = require("transformers")

apply = jax.jit(transformer.apply, static_argnums=0)


# ---- against transformers -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
  cfg, model, params = setup(name)
  tokens = random_tokens(cfg, (2, 48))
  with torch.no_grad():
    ref = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
  ours = np.asarray(apply(cfg, params, jnp.asarray(tokens)))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  scale = max(1.0, float(np.abs(ref).max()))
  assert scale > 2.0, "random weights should give O(1) logits, else the comparison is weak"
  err = float(np.abs(ours - ref).max())
  assert err <= 1e-4 * scale, f"{name}: max |diff| {err} (max |logit| {scale})"


@pytest.mark.parametrize("name", ["qwen3_tied_hd32", "qwen2_untied_bias"])
def test_hf_io_table_agrees_with_reference_mapping(name):
  cfg, model, params = setup(name)
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  chex.assert_trees_all_equal(hf_io.from_hf_state_dict(cfg, sd), params)


def test_llama3_inv_freq_matches_transformers():
  cfg, model, _ = setup("llama3_scaled")
  ref = model.model.rotary_emb.inv_freq.numpy()
  ours = transformer.rope_inv_freq(cfg)
  np.testing.assert_allclose(ours, ref, **tolerances.close(np.float32))  # elementwise, JAX vs torch
  plain = transformer.rope_inv_freq(cfg.replace(rope_scaling=None))
  assert (ours < plain * 0.99).any() and (ours == plain).any(), "scaling must touch some bands only"


def test_bfloat16_compute_close_to_float32():
  cfg, _, params = setup("qwen3_tied_hd32")
  tokens = jnp.asarray(random_tokens(cfg, (2, 48), seed=1))
  ref = apply(cfg, params, tokens)
  bf16 = cfg.replace(dtype="bfloat16")
  out = apply(bf16, params, tokens)
  assert out.dtype == jnp.float32
  assert not np.array_equal(np.asarray(out), np.asarray(ref)), "bf16 compute path was not taken"
  scale = float(jnp.abs(ref).max())
  assert float(jnp.abs(out - ref).max()) <= 0.1 * scale
  assert float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1))) >= 0.9
  hidden = jax.eval_shape(lambda p: transformer.hidden_states(bf16, p, tokens), params)
  assert hidden.dtype == jnp.bfloat16 and hidden.shape == (2, 48, cfg.hidden_size)
  stored = jax.eval_shape(lambda: transformer.init_params(
      cfg.replace(param_dtype="bfloat16"), jax.random.key(0)))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(stored))


# ---- padding and packing ------------------------------------------------------------------------

def test_padding_and_packing():
  cfg, _, params = setup("qwen2_untied_bias")
  a, b = random_tokens(cfg, (1, 5), seed=5), random_tokens(cfg, (1, 7), seed=6)
  alone_a, alone_b = apply(cfg, params, jnp.asarray(a)), apply(cfg, params, jnp.asarray(b))
  # Row 0: a right-padded with junk; row 1: a and b packed, positions reset; row 2: all padding.
  tokens = random_tokens(cfg, (3, 12), seed=7)
  tokens[0, :5] = a[0]
  tokens[1, :5], tokens[1, 5:] = a[0], b[0]
  seg = np.zeros((3, 12), np.int32)
  seg[0, :5] = 1
  seg[1, :5], seg[1, 5:] = 1, 2
  pos = np.tile(np.arange(12, dtype=np.int32), (3, 1))
  pos[1, 5:] = np.arange(7)
  out = apply(cfg, params, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  assert bool(jnp.isfinite(out).all()), "padded and fully padded rows must stay finite"
  # Attention over other key sets (padding, packing) reassociates the sums of the hidden_size-wide
  # matmuls and the attention reductions.
  tol = lambda ref: tolerances.close(np.float32, cfg.hidden_size, tolerances.tree_scale(ref))
  chex.assert_trees_all_close(out[0, :5], alone_a[0], **tol(alone_a[0]))
  chex.assert_trees_all_close(out[1, :5], alone_a[0], **tol(alone_a[0]))
  chex.assert_trees_all_close(out[1, 5:], alone_b[0], **tol(alone_b[0]))
  # Without the segment boundary, b's logits would differ: the test can see a broken mask.
  merged = apply(cfg, params, jnp.asarray(tokens[1:2]), jnp.asarray(pos[1:2]))
  assert float(jnp.abs(merged[0, 5:] - alone_b[0]).max()) > 1e-2


# ---- remat --------------------------------------------------------------------------------------

def test_remat_same_logits():
  """(Grads with remat: test_token_logprobs_chunked.)"""
  cfg, _, params = setup("llama3_scaled")
  tokens = jnp.asarray(random_tokens(cfg, (2, 16), seed=10))
  remat = cfg.replace(remat=True)
  ref = apply(cfg, params, tokens)
  chex.assert_trees_all_close(apply(remat, params, tokens), ref, **tolerances.close(
      np.float32, cfg.hidden_size, tolerances.tree_scale(ref)))
  text = lambda c: str(jax.make_jaxpr(lambda p: transformer.hidden_states(c, p, tokens))(params))
  assert "checkpoint" in text(remat) or "remat" in text(remat)
  assert "checkpoint" not in text(cfg) and "remat" not in text(cfg)


def test_scan_unroll_same_logits():
  """scan_unroll 1 (rolled), 2 and 0 (auto: all layers when <= 4) give the same logits and grads."""
  cfg, _, params = setup("llama3_scaled")
  tokens = jnp.asarray(random_tokens(cfg, (2, 16), seed=13))
  assert cfg.replace(scan_unroll=0).layer_unroll == min(cfg.num_hidden_layers, 4) or \
      cfg.num_hidden_layers > 4
  assert cfg.replace(scan_unroll=1).layer_unroll == 1
  assert cfg.replace(scan_unroll=0, remat=True).layer_unroll == 1  # remat keeps the rolled loop
  loss = lambda c, p: jnp.sum(jnp.sin(apply(c, p, tokens)))
  ref = jax.value_and_grad(loss, argnums=1)(cfg.replace(scan_unroll=1), params)
  # Each gradient element sums over the B*T tokens and the V logits (reassociated by the unroll).
  tol = tolerances.close(jnp.float32, n=tokens.size * cfg.vocab_size, scale=tolerances.tree_scale(ref))
  for k in (0, 2):
    chex.assert_trees_all_close(jax.value_and_grad(loss, argnums=1)(cfg.replace(scan_unroll=k),
                                                                    params), ref, **tol)
  with pytest.raises(ValueError, match="scan_unroll"):
    cfg.replace(scan_unroll=-1)


# ---- parameters ---------------------------------------------------------------------------------

def test_param_tree_layout():
  cfg = presets.tiny()
  params = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.key(0)))
  assert set(params) == {"embed_tokens", "layers", "norm"}  # tied: no lm_head
  assert set(params["layers"]) == {
      "input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
      "post_attention_layernorm", "gate_proj", "up_proj", "down_proj"}
  chex.assert_shape(params["layers"]["q_proj"], (2, 128, 4 * 32))
  chex.assert_shape(params["layers"]["k_norm"], (2, 32))
  qwen2 = transformer.init_params(CONFIGS["qwen2_untied_bias"], jax.random.key(0))
  np.testing.assert_array_equal(qwen2["layers"]["input_layernorm"], 1.0)
  np.testing.assert_array_equal(qwen2["layers"]["q_bias"], 0.0)
  assert 0.015 < float(jnp.std(qwen2["layers"]["q_proj"])) < 0.025  # initializer_range 0.02
  assert {"q_bias", "k_bias", "v_bias"} <= set(qwen2["layers"])
  assert "q_norm" not in qwen2["layers"] and qwen2["lm_head"].shape == (64, 101)
  with pytest.raises(ValueError, match="o_proj bias"):
    transformer.init_params(small("llama", attention_bias=True), jax.random.key(0))
  for c in [presets.tiny(), *CONFIGS.values()]:  # one layout with the HF name table
    assert transformer.param_shapes(c) == hf_io.param_shapes(c)


# ---- attention kernels --------------------------------------------------------------------------

def _packed_segments():
  """Row 0: one sequence then padding; row 1: two packed sequences; row 2: all padding."""
  seg = np.zeros((3, 12), np.int32)
  seg[0, :7] = 1
  seg[1, :5], seg[1, 5:11] = 1, 2
  return seg


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_attention_xla_matches_einsum_reference(dtype, tol):
  rng = np.random.default_rng(0)
  b, t, hq, hkv, hd = 3, 12, 6, 2, 16
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, hd)), dtype) for h in (hq, hkv, hkv))
  mask = transformer.attention_mask(jnp.asarray(_packed_segments()))

  def loss(impl, q, k, v):
    out = transformer.attention(q, k, v, mask, impl, causal=True).astype(jnp.float32)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

  ref_grads, ref = jax.grad(functools.partial(loss, "einsum"), argnums=(0, 1, 2), has_aux=True)(
      q, k, v)
  for impl in ("xla", "auto"):  # "auto" is XLA on CPU
    grads, out = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert out.shape == (b, t, hq, hd)
    chex.assert_trees_all_close(out, ref, atol=tol, rtol=tol)  # every row, padding included
    chex.assert_trees_all_close(grads, ref_grads, atol=tol, rtol=tol)
  # The mask is used: without it the output of the packed row's second sequence changes.
  free = transformer.attention(q, k, v, jnp.ones_like(mask), "xla")
  assert float(jnp.abs(free[1, 5:11].astype(jnp.float32) - ref[1, 5:11]).max()) > 10 * tol


@pytest.mark.parametrize("name", ["qwen3_tied_hd32", "qwen2_tied_gqa4"])
def test_model_logits_same_under_every_attention_kernel(name):
  cfg, _, params = setup(name)
  seg = _packed_segments()
  pos = np.where(seg > 0, np.arange(12, dtype=np.int32)[None], 0).astype(np.int32)
  pos[1, 5:11] = np.arange(6)  # the second packed sequence restarts at 0
  tokens = jnp.asarray(random_tokens(cfg, seg.shape, seed=3))
  args = (tokens, jnp.asarray(pos), jnp.asarray(seg))
  ref = apply(cfg.replace(attention="einsum"), params, *args)
  for impl in ("xla", "auto"):
    chex.assert_trees_all_close(apply(cfg.replace(attention=impl), params, *args), ref,
                                **tolerances.close(np.float32, cfg.hidden_size,
                                                   tolerances.tree_scale(ref)))


def test_attention_choice_and_errors():
  assert ModelConfig().attention == "auto"
  assert transformer.resolve_attention("auto", jnp.bfloat16) == (
      "cudnn" if jax.default_backend() == "gpu" else "xla")
  assert transformer.resolve_attention("auto", jnp.float32) == "xla"
  with pytest.raises(ValueError, match="model.attention"):
    ModelConfig(attention="flash")
  with pytest.raises(ValueError, match="model.dtype='bfloat16'"):
    ModelConfig(attention="cudnn", dtype="float32")
  if jax.default_backend() != "gpu":
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    mask = transformer.attention_mask(jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="model.attention='xla'"):
      transformer.attention(q, q, q, mask, "cudnn", causal=True)
    # "auto" never asks for cuDNN off GPU; asked for it explicitly, a failure falls back nowhere.
    assert transformer.attention(q, q, q, mask, "auto", causal=True).shape == q.shape
