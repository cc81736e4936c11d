"""The functional Qwen3 / Qwen2.5 / Llama-3 decoder over a parameter pytree.

Parameters are a nested dict (see WORKSPACE.md) whose leaves, shapes and initialisation come from
the table in `layout.py`; per-layer arrays are stacked on axis 0 and the forward `jax.lax.scan`s
over them. Linear kernels are stored [in, out].

Numerics follow transformers: RMSNorm normalises in float32 and multiplies by `weight` (not 1 + weight);
RoPE is the split-half (rotate_half) layout with transformers' inv_freq (default or llama3 scaling);
Qwen3 applies q_norm / k_norm per head before RoPE; Qwen2 has q/k/v biases; the MLP is SwiGLU.
Matmuls run in `cfg.compute_dtype` with float32 accumulation; attention softmax and logits are float32.
Attention runs the kernel `cfg.attention` names (`attention`: jax.nn.dot_product_attention, XLA or
cuDNN flash attention; `einsum_attention` is the reference), masked by segment ids (packed rows).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay.infra import sharding
from jaxreplay.models import layout
from jaxreplay.models.lora import LoraKernel
from jaxreplay.models.config import ATTENTION_IMPLEMENTATIONS, ModelConfig

# Masked attention scores get this finite value (not -inf), so a fully masked row (padding) yields a
# uniform softmax instead of NaN.
MASK_VALUE = float(np.finfo(np.float32).min)

Params = dict
# attend(q [B,T,Hq,hd], k [B,T,Hkv,hd], v [B,T,Hkv,hd]) -> (out [B,T,Hq,hd], aux); lets decode.py
# route K/V through its cache (aux carries what it needs back) while sharing the rest of the layer.
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


# The layout's names that callers (decode.py, tests) reach through this module.
check_supported = layout.check_supported
param_shapes = layout.param_shapes


# ---- parameters ---------------------------------------------------------------------------------

def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random parameters in `cfg.params_dtype`, each leaf filled as its `layout.Rule.init` says.

  N(0, std) for matrices, ones for norms, zeros for biases; `std` defaults to transformers'
  `initializer_range`. `rng` is split once per leaf, in jax's (sorted-key) leaf order. Works under
  `jax.eval_shape` (no allocation).
  """
  rules: Params = {}
  for rule in layout.rules_for(cfg):
    layout.set_leaf(rules, rule.path, rule)
  flat, treedef = jax.tree_util.tree_flatten(rules, is_leaf=lambda x: isinstance(x, layout.Rule))
  keys = jax.random.split(rng, len(flat))
  dtype = cfg.params_dtype
  leaves = []
  for key, rule in zip(keys, flat):
    shape = rule.jax_shape(cfg)
    if rule.init == "ones":
      leaves.append(jnp.ones(shape, dtype))
    elif rule.init == "zeros":
      leaves.append(jnp.zeros(shape, dtype))
    elif rule.init == "normal":
      leaves.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    else:
      raise ValueError(f"{rule.hf_name}: unknown init {rule.init!r}")
  return jax.tree_util.tree_unflatten(treedef, leaves)


# ---- building blocks ----------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis: normalise in float32, cast back to x.dtype, then multiply by weight."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return x32.astype(x.dtype) * weight.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """float32 [head_dim // 2] inverse frequencies, as transformers computes them (default / llama3)."""
  dim = cfg.head_dim
  inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  inv_freq = inv_freq.astype(np.float32)
  scaling = cfg.rope_scaling_dict
  if scaling is None or scaling.get("rope_type", "default") == "default":
    return inv_freq
  if scaling["rope_type"] != "llama3":
    raise ValueError(f"unsupported rope scaling {scaling!r}; supported: default, llama3")
  factor = scaling["factor"]
  low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_context_len = scaling["original_max_position_embeddings"]
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  wavelen = (2 * math.pi / inv_freq).astype(np.float32)
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = ((old_context_len / wavelen - low_freq_factor) /
            (high_freq_factor - low_freq_factor)).astype(np.float32)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [B, T, H, hd] by int positions [B, T] (split-half layout); computed in float32."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]          # [B, T, 1, hd]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


def _matmul_2d(x: jax.Array, kernel: jax.Array, contract_kernel_dim: int) -> jax.Array:
  """x [..., K] @ kernel (contracted on `contract_kernel_dim`, 0: [K, N], 1: [N, K]) -> float32 [..., N].

  The leading axes are flattened into one before the dot: a rank-2 dot_general (and its two
  rank-2 gradients) maps onto the backend's GEMM, while XLA's CPU backend runs the gradient of a
  dot with two or more free axes (`einsum("bti,io->bto")`: the kernel gradient contracts over b
  and t) 3-4x slower (measured: bench/bench_train_step.py, docs/benchmarks.md "Train step vs the PyTorch peer").
  """
  lead = x.shape[:-1]
  y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), kernel,
                          (((1,), (contract_kernel_dim,)), ((), ())),
                          preferred_element_type=jnp.float32)
  return y.reshape(*lead, y.shape[-1])


def _dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., in] @ kernel [in, out] in x.dtype with float32 accumulation.

  A `lora.LoraKernel` (`lora.attach`) adds its low-rank term: x @ w + scale * (x @ a) @ b, the
  rank-r product x @ a rounded to x.dtype as vLLM's LoRA kernels do, both terms summed in float32.
  """
  if isinstance(kernel, LoraKernel):
    y = _matmul_2d(x, kernel.w.astype(x.dtype), 0)
    xa = _matmul_2d(x, kernel.a.astype(x.dtype), 0).astype(x.dtype)
    return (y + kernel.scale * _matmul_2d(xa, kernel.b.astype(x.dtype), 0)).astype(x.dtype)
  return _matmul_2d(x, kernel.astype(x.dtype), 0).astype(x.dtype)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """bool [B, T, T]: query t sees key s iff s <= t (array order) and both are in one nonzero segment."""
  t = segment_ids.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None] & same & (segment_ids[:, None, :] != 0)


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention written out with einsums: the reference of `attention`.

  q [B, T, Hq, hd], k/v [B, S, Hkv, hd], mask bool [B, T, S] -> [B, T, Hq, hd] in q.dtype.
  Scores and softmax are float32 and materialised whole ([B, Hkv, Hq/Hkv, T, S] float32: 2.4 GB per
  row and layer for Qwen3-8B at 4.6k tokens); masked scores are MASK_VALUE so fully masked rows
  (padding) stay finite.
  """
  b, t, hq, hd = q.shape
  hkv = k.shape[2]
  q = q.reshape(b, t, hkv, hq // hkv, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (hd ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, hq, hd).astype(q.dtype)


# The einsum is the reference; callers of the old name get it.
dot_product_attention = einsum_attention


def resolve_attention(implementation: str, dtype: Any) -> str:
  """The kernel that `implementation` ("auto" | "xla" | "cudnn" | "einsum") means here.

  "auto" is "cudnn" (flash attention) on a GPU backend with a 16-bit compute dtype, else "xla".
  """
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r}: expected one of "
                     f"{ATTENTION_IMPLEMENTATIONS} (config key model.attention)")
  if implementation != "auto":
    return implementation
  if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2:
    return "cudnn"
  return "xla"


_WARNED: set[str] = set()  # cuDNN fallbacks already reported in this process (one warning each)


def _gpu_compute_capability() -> Optional[tuple[int, ...]]:
  """The first GPU's compute capability, or None when JAX has no GPU (or does not say)."""
  try:
    if jax.default_backend() != "gpu":
      return None
    return tuple(int(x) for x in str(jax.devices()[0].compute_capability).split("."))
  except Exception:  # pylint: disable=broad-except
    return None


def cudnn_problem(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: Any,
                  with_bias: bool, compute_capability: Optional[tuple[int, ...]] = None
                  ) -> Optional[str]:
  """Why cuDNN flash attention would reject q [B, T, Hq, hd] / k [B, S, Hkv, hd] in `dtype`, or
  None: bf16 / f16 only; head_dim a multiple of 8 and <= 128 (<= 256 on Hopper or later);
  query heads a multiple of key/value heads; with a bias (the dense-mask path) and a backward, T
  and S even. `compute_capability` (default: the first GPU's; None: unknown, 256 allowed)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention takes bfloat16 / float16)"
  _, t, hq, hd = q_shape
  s, hkv = k_shape[1], k_shape[2]
  cc = compute_capability if compute_capability is not None else _gpu_compute_capability()
  h_max = 256 if cc is None or cc >= (9, 0) else 128
  if hd % 8 or hd > h_max:
    return f"head_dim {hd} (cuDNN needs a multiple of 8, at most {h_max} on this GPU)"
  if hq % hkv:
    return f"{hq} query heads over {hkv} key/value heads (not a multiple)"
  if with_bias and (t % 2 or s % 2):
    return f"odd sequence lengths T={t}, S={s} with a mask (cuDNN's bias gradient needs even ones)"
  return None


def _cudnn_fallback(implementation: str, q, k, reason: str) -> None:
  """Explicit "cudnn": ValueError naming the fix. "auto": one warning per reason and process."""
  if implementation != "auto":
    raise ValueError(f"cuDNN attention rejected q {q.shape} {q.dtype}, k {k.shape}: {reason}; set "
                     "model.attention='xla' (or 'auto', which falls back to it)")
  key = f"{q.shape[1:]}|{k.shape[1:]}|{q.dtype}|{reason}"
  if key not in _WARNED:
    _WARNED.add(key)
    logging.warning("cuDNN attention rejected q %s %s, k %s (%s); using XLA attention",
                    q.shape, q.dtype, k.shape, reason)


def cudnn_call_args(mask: jax.Array, causal: bool,
                    lengths: Optional[jax.Array]) -> dict[str, Any]:
  """The masking arguments `attention` hands `jax.nn.dot_product_attention` for cuDNN: with
  `lengths` (one right-padded sequence per row) and `causal`, `is_causal` + per-row query / key
  lengths (cuDNN's PADDING_CAUSAL mask: no bias, no bias gradient); otherwise the dense mask
  [B, 1, T, S], which cuDNN turns into an additive bias in the compute dtype and whose gradient
  its backward computes (`memory_plan.activation_bytes` counts both)."""
  if lengths is not None and causal:
    lengths = lengths.astype(jnp.int32)
    return dict(is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  return dict(mask=mask[:, None], is_causal=causal)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              implementation: str = "auto", causal: bool = False,
              lengths: Optional[jax.Array] = None) -> jax.Array:
  """Grouped-query attention with `jax.nn.dot_product_attention` (or the einsum reference).

  q [B, T, Hq, hd], k/v [B, S, Hkv, hd] (one dtype), mask bool [B, T, S] (True: query t sees key s;
  any segment / padding / causal pattern) -> [B, T, Hq, hd] in q.dtype.

  implementation: "xla" (jax's XLA attention: softmax in float32; it still materialises the
    [B, Hkv, G, T, S] float32 scores), "cudnn" (cuDNN flash attention, GPU only, bf16/f16: the
    scores never exist whole), "einsum" (`einsum_attention`), or "auto" (`resolve_attention`).
    cuDNN's constraints are checked first (`cudnn_problem`); when cuDNN cannot take the shapes
    or dtypes (that check, or jax's at trace time), "auto" falls back to "xla" with one warning
    per process, an explicit "cudnn" raises ValueError naming the fix.
  causal: the mask is also causal with queries and keys aligned (T == S, training / prefill); lets
    cuDNN skip the upper triangle. The mask must already contain the causal pattern.
  lengths: int32 [B] when every row is one sequence right-padded to T (key s visible to query t iff
    s <= t < lengths): with `causal`, cuDNN then masks by lengths instead of a [B, 1, T, S] bias
    (`cudnn_call_args`). The mask must agree; the XLA and einsum kernels use the mask.

  Rows whose mask is all False (padding) give finite outputs (the output there is unspecified:
  callers mask those positions out).
  """
  impl = resolve_attention(implementation, q.dtype)
  if impl == "einsum":
    return einsum_attention(q, k, v, mask)
  mask4 = mask[:, None]  # [B, 1, T, S], broadcast over heads
  if impl == "xla":
    return jax.nn.dot_product_attention(q, k, v, mask=mask4, implementation="xla")
  masking = cudnn_call_args(mask, causal, lengths)
  problem = cudnn_problem(q.shape, k.shape, q.dtype, with_bias="mask" in masking)
  if problem is None:
    q, k, v = sharding.constrain_rows(q, k, v)  # cuDNN's partitioner needs one sharding for all
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **masking)
    except (ValueError, NotImplementedError, RuntimeError) as e:
      problem = str(e)
  _cudnn_fallback(implementation, q, k, problem)
  return jax.nn.dot_product_attention(q, k, v, mask=mask4, implementation="xla")


def project_qkv(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array):
  """x [B, T, D] (already input-normed) -> q [B,T,Hq,hd], k, v [B,T,Hkv,hd]; q/k normed and rotated."""
  b, t, _ = x.shape
  hd = cfg.head_dim
  q, k, v = _dense(x, lp["q_proj"]), _dense(x, lp["k_proj"]), _dense(x, lp["v_proj"])
  if cfg.attention_bias:
    q = q + lp["q_bias"].astype(q.dtype)
    k = k + lp["k_bias"].astype(k.dtype)
    v = v + lp["v_bias"].astype(v.dtype)
  q = q.reshape(b, t, cfg.num_attention_heads, hd)
  k = k.reshape(b, t, cfg.num_key_value_heads, hd)
  v = v.reshape(b, t, cfg.num_key_value_heads, hd)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  inv_freq = rope_inv_freq(cfg)
  return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(lp: Params, x: jax.Array) -> jax.Array:
  """SwiGLU: down(silu(gate(x)) * up(x)); x [B, T, D]."""
  return _dense(jax.nn.silu(_dense(x, lp["gate_proj"])) * _dense(x, lp["up_proj"]), lp["down_proj"])


def block(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array,
          attend: AttendFn) -> tuple[jax.Array, Any]:
  """One decoder layer (pre-norm attention + pre-norm MLP) on x [B, T, D] with one layer's params.

  Returns (x [B, T, D], the aux output of `attend`)."""
  h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
  q, k, v = project_qkv(cfg, lp, h, positions)
  a, aux = attend(q, k, v)
  x = x + _dense(a.reshape(*a.shape[:2], -1), lp["o_proj"])
  h = rms_norm(x, lp["post_attention_layernorm"], cfg.rms_norm_eps)
  return x + mlp(lp, h), aux


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
  """int tokens [B, T] -> [B, T, D] in the compute dtype."""
  return jnp.take(params["embed_tokens"], tokens, axis=0).astype(cfg.compute_dtype)


def lm_head(cfg: ModelConfig, params: Params, h: jax.Array) -> jax.Array:
  """Final-normed hidden [..., D] -> float32 logits [..., V] (tied: embed_tokens transposed)."""
  dtype = h.dtype
  if cfg.tie_word_embeddings:
    return _matmul_2d(h, params["embed_tokens"].astype(dtype), 1)
  return _matmul_2d(h, params["lm_head"].astype(dtype), 0)


# ---- the model ----------------------------------------------------------------------------------

def _defaults(tokens, positions, segment_ids):
  b, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  for name, x in (("positions", positions), ("segment_ids", segment_ids)):
    if x.shape != (b, t):
      raise ValueError(f"{name} has shape {x.shape}, expected the tokens' shape {(b, t)}")
  return positions, segment_ids


def hidden_states(cfg: ModelConfig, params: Params, tokens: jax.Array,
                  positions: Optional[jax.Array] = None,
                  segment_ids: Optional[jax.Array] = None,
                  single_sequence_rows: bool = False) -> jax.Array:
  """Final-normed hidden states [B, T, D] in the compute dtype.

  tokens int32 [B, T]; positions int32 [B, T] (default arange) feed RoPE; segment_ids int32 [B, T]
  (default all ones), 0 = padding: a token attends to earlier tokens of its own nonzero segment.
  single_sequence_rows: every row is one sequence right-padded (segment ids 1 then 0, an unpacked
  `Batch`): cuDNN attention then masks by row lengths, with no dense bias (`attention`).
  """
  layout.check_supported(cfg)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, seq] int32, got shape {tokens.shape}")
  positions, segment_ids = _defaults(tokens, positions, segment_ids)
  params = layout.unpad(cfg, params, layers=False)
  mask = attention_mask(segment_ids)
  lengths = None  # only where cuDNN is asked: other kernels trace exactly as before
  if single_sequence_rows and resolve_attention(cfg.attention, cfg.compute_dtype) == "cudnn":
    # >= 1: an all-padding row attends its first token (finite, masked out by the callers) rather
    # than nothing (cuDNN's output for an empty row is not specified).
    lengths = jnp.maximum(jnp.sum(segment_ids > 0, axis=1, dtype=jnp.int32), 1)
  attend = lambda q, k, v: (attention(q, k, v, mask, cfg.attention, causal=True, lengths=lengths),
                            None)

  def layer(x, lp):
    return block(cfg, layout.unpad_layer(cfg, lp), x, positions, attend)

  if cfg.remat:
    layer = jax.checkpoint(layer, prevent_cse=False)
  x, _ = jax.lax.scan(layer, embed(cfg, params, tokens), params["layers"], unroll=cfg.layer_unroll)
  return rms_norm(x, params["norm"], cfg.rms_norm_eps)


def apply(cfg: ModelConfig, params: Params, tokens: jax.Array,
          positions: Optional[jax.Array] = None,
          segment_ids: Optional[jax.Array] = None,
          single_sequence_rows: bool = False) -> jax.Array:
  """float32 logits [B, T, V]; arguments as in `hidden_states`. Materialises all of [B, T, V]:
  for training use `logprobs.token_logprobs`, which chunks over T."""
  params = layout.unpad(cfg, params, layers=False)
  return lm_head(cfg, params, hidden_states(cfg, params, tokens, positions, segment_ids,
                                            single_sequence_rows))
