"""The functional model against transformers' own Qwen3 / Qwen2 / Llama (torch CPU, float32), and
its internal consistency: KV-cache decoding, padding and packing, chunked log-probs, remat, bf16."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import require
import tolerances
from jaxreplay.models import decode, hf_io, logprobs, presets, transformer
from jaxreplay.models.config import ModelConfig

torch = require("torch")
transformers = require("transformers")

apply = jax.jit(transformer.apply, static_argnums=0)
# The sampler donates the cache: the tests do too (k and v must be distinct buffers).
prefill = jax.jit(decode.prefill, static_argnums=0, donate_argnums=4)
decode_step = jax.jit(decode.decode_step, static_argnums=0, donate_argnums=3)

_LLAMA3 = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}.items()))


def small(model_type, **kw):
  base = dict(model_type=model_type, vocab_size=101, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=True,
              qk_norm=model_type == "qwen3", attention_bias=model_type == "qwen2",
              max_position_embeddings=256)
  base.update(kw)
  return ModelConfig(**base)


CONFIGS = {
    # head_dim 32 != 64 / 4, GQA 2, tied.
    "qwen3_tied_hd32": small("qwen3", head_dim=32),
    # GQA ratio 1, untied, head_dim 24.
    "qwen3_untied_mha": small("qwen3", num_key_value_heads=4, head_dim=24, tie_word_embeddings=False),
    "qwen2_untied_bias": small("qwen2", tie_word_embeddings=False),
    # GQA ratio 4, tied, head_dim 32.
    "qwen2_tied_gqa4": small("qwen2", num_key_value_heads=1, head_dim=32),
    # llama3 scaling with original_max_position_embeddings 32 < T: all three frequency bands occur.
    "llama3_scaled": small("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                           head_dim=24,
                           rope_scaling=_LLAMA3, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "llama_tied_mha": small("llama", num_key_value_heads=4, rope_theta=500_000.0),
}


# ---- transformers reference ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def hf_model(cfg: ModelConfig, seed: int = 0):
  """A transformers model for `cfg` with all weights random (norms around 1, nonzero biases)."""
  d = cfg.to_hf_dict()
  hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
  assert type(model).__name__ == cfg.architecture
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.2 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise / np.sqrt(p.shape[1]))
  return model.eval().float()


def params_from_torch(cfg: ModelConfig, model) -> dict:
  """HF state dict -> the jaxreplay pytree (layers stacked, kernels transposed to [in, out])."""
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  n = cfg.num_hidden_layers

  def stack(suffix, transpose=False):
    arrs = [sd[f"model.layers.{i}.{suffix}"] for i in range(n)]
    return jnp.asarray(np.stack([a.T if transpose else a for a in arrs]))

  layers = {
      "input_layernorm": stack("input_layernorm.weight"),
      "post_attention_layernorm": stack("post_attention_layernorm.weight"),
  }
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    layers[name] = stack(f"self_attn.{name}.weight", transpose=True)
  for name in ("gate_proj", "up_proj", "down_proj"):
    layers[name] = stack(f"mlp.{name}.weight", transpose=True)
  if cfg.attention_bias:
    for x in "qkv":
      layers[f"{x}_bias"] = stack(f"self_attn.{x}_proj.bias")
  if cfg.qk_norm:
    layers["q_norm"] = stack("self_attn.q_norm.weight")
    layers["k_norm"] = stack("self_attn.k_norm.weight")
  params = {"embed_tokens": jnp.asarray(sd["model.embed_tokens.weight"]), "layers": layers,
            "norm": jnp.asarray(sd["model.norm.weight"])}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = jnp.asarray(sd["lm_head.weight"].T)
  return params


def setup(name):
  cfg = CONFIGS[name]
  model = hf_model(cfg)
  return cfg, model, params_from_torch(cfg, model)


def random_tokens(cfg, shape, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)


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


# ---- KV cache -----------------------------------------------------------------------------------

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


# ---- chunked log-probs --------------------------------------------------------------------------

def _walk_shapes(jaxpr):
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield tuple(getattr(v.aval, "shape", ()))
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _walk_shapes(inner)


def test_token_logprobs_chunked():
  """chunk_size 5 does not divide T = 13; row 1 is right-padded; grads under remat and without."""
  cfg, _, params = setup("qwen3_untied_mha")
  bsz, t, chunk = 2, 13, 5
  tokens = jnp.asarray(random_tokens(cfg, (bsz, t), seed=8))
  targets = jnp.asarray(random_tokens(cfg, (bsz, t), seed=9))
  seg = jnp.asarray(np.arange(t)[None] < np.array([[t], [9]]), jnp.int32)
  mask = seg > 0

  @functools.partial(jax.jit, static_argnums=0)
  def chunked(c, p):
    return logprobs.token_logprobs(c, p, tokens, targets, segment_ids=seg, chunk_size=chunk,
                                   return_entropy=True)

  lp, ent = chunked(cfg, params)
  chex.assert_shape([lp, ent], (bsz, t))
  assert lp.dtype == ent.dtype == jnp.float32
  assert bool(jnp.isfinite(lp).all() & jnp.isfinite(ent).all())
  full = np.asarray(apply(cfg, params, tokens, None, seg), np.float64)
  logz = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
  ref_lp = np.take_along_axis(full, np.asarray(targets)[..., None], -1)[..., 0] - logz
  probs = np.exp(full - logz[..., None])
  ref_ent = -(probs * np.log(probs)).sum(-1)
  assert ref_ent.min() > 0.05, "near one-hot distributions would make the entropy check weak"
  # float32 (chunked, over the V logits) against float64 numpy.
  tol = lambda ref: tolerances.close(np.float32, cfg.vocab_size, tolerances.tree_scale(ref))
  np.testing.assert_allclose(lp, ref_lp, **tol(ref_lp))
  np.testing.assert_allclose(ent, ref_ent, **tol(ref_ent))
  np.testing.assert_allclose(logprobs.logprobs_from_logits(jnp.asarray(full), targets), ref_lp,
                             **tol(ref_lp))
  np.testing.assert_allclose(logprobs.entropy_from_logits(jnp.asarray(full)), ref_ent,
                             **tol(ref_ent))

  def chunked_loss(c, p):
    lp, ent = logprobs.token_logprobs(c, p, tokens, targets, segment_ids=seg, chunk_size=chunk,
                                      return_entropy=True)
    return jnp.sum((lp + 0.1 * ent) * mask)

  def full_loss(c, p):
    logits = transformer.apply(c, p, tokens, None, seg)
    lp = logprobs.logprobs_from_logits(logits, targets)
    return jnp.sum((lp + 0.1 * logprobs.entropy_from_logits(logits)) * mask)

  grad = lambda f, c: jax.jit(jax.grad(f, argnums=1), static_argnums=0)(c, params)
  g_full = grad(full_loss, cfg)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(g_full))
  for c in (cfg, cfg.replace(remat=True)):
    # Each gradient element sums over the B*T tokens and the V logits (chunked vs whole).
    chex.assert_trees_all_close(grad(chunked_loss, c), g_full, **tolerances.close(
        np.float32, tokens.size * cfg.vocab_size, tolerances.tree_scale(g_full)))

  # Forward and backward never hold more than one [B, chunk, V] block of logits.
  d, v = cfg.hidden_size, cfg.vocab_size

  def logit_blocks(fn):  # arrays with a vocab axis, other than the embedding / head kernels
    shapes = _walk_shapes(jax.make_jaxpr(jax.grad(fn, argnums=1), static_argnums=0)(cfg, params).jaxpr)
    return [s for s in shapes if v in s and s not in ((d, v), (v, d))]

  big = [s for s in logit_blocks(chunked_loss) if np.prod(s) > bsz * chunk * v]
  assert not big, f"arrays larger than one chunk of logits: {big}"
  assert any(np.prod(s) > bsz * chunk * v for s in logit_blocks(full_loss)), \
      "the shape check must see the full-logits path"


@pytest.mark.parametrize("t", [5, 13])  # one chunk (T <= chunk 8), two chunks
def test_token_logprobs_remat_modes(t):
  """remat auto / always / never give the same log-probs, entropies and gradients; "auto"
  checkpoints the LM head only when there are two or more chunks."""
  cfg, _, params = setup("qwen3_untied_mha")
  tokens = jnp.asarray(random_tokens(cfg, (2, t), seed=11))
  targets = jnp.asarray(random_tokens(cfg, (2, t), seed=12))

  def loss(p, remat):
    lp, ent = logprobs.token_logprobs(cfg, p, tokens, targets, chunk_size=8, return_entropy=True,
                                      remat=remat)
    return jnp.sum(lp * jnp.cos(jnp.arange(t))) + 0.1 * jnp.sum(ent), (lp, ent)

  out = {m: jax.jit(jax.value_and_grad(functools.partial(loss, remat=m), has_aux=True))(params)
         for m in logprobs.REMAT_MODES}
  for m in ("always", "never"):
    chex.assert_trees_all_close(out[m], out["auto"], **tolerances.close(
        np.float32, tokens.size * cfg.vocab_size, tolerances.tree_scale(out["auto"])))
  text = lambda m: str(jax.make_jaxpr(jax.grad(lambda p: loss(p, m)[0]))(params))
  assert "checkpoint" in text("always") or "remat" in text("always")
  assert "checkpoint" not in text("never") and "remat" not in text("never")
  assert (("checkpoint" in text("auto") or "remat" in text("auto")) == (t > 8))
  with pytest.raises(ValueError, match="remat"):
    logprobs.token_logprobs(cfg, params, tokens, targets, remat="sometimes")


def test_token_logprobs_errors():
  cfg, _, params = setup("qwen3_untied_mha")
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="chunk_size"):
    logprobs.token_logprobs(cfg, params, tokens, tokens, chunk_size=0)
  with pytest.raises(ValueError, match="targets shape"):
    logprobs.token_logprobs(cfg, params, tokens, tokens[:, :3])
  with pytest.raises(ValueError, match="positions has shape"):
    transformer.apply(cfg, params, tokens, positions=jnp.zeros((1, 3), jnp.int32))


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
