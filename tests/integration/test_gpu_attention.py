"""GPU path (issue 28), item 5, proven on CPU: cuDNN attention without a dense bias for unpacked
rows (the lengths the train step passes, the masking against the reference attention, the fallback),
and the memory plan's count of the dense bias packed rows keep."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.models import presets
from jaxreplay.config import memory_plan
from jaxreplay.models import transformer

TINY = presets.tiny()


# ---- 5. cuDNN attention without a dense bias --------------------------------------------------------


@pytest.fixture
def pretend_cudnn(monkeypatch):
  """jax's trace-time cuDNN checks answer as on an sm_90 GPU with cuDNN 9.20, so that the cuDNN
  attention call traces on CPU (it cannot run here)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 92000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda cap: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda cap: False)
  return fa


def _cudnn_eqns(jaxpr, out=None):
  """Every cuDNN attention equation in `jaxpr` and its sub-jaxprs (scan, remat, cond, ...)."""
  out = [] if out is None else out
  for eqn in jaxpr.eqns:
    if "dot_product_attention" in eqn.primitive.name or "cudnn" in eqn.primitive.name:
      out.append(eqn)
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (list, tuple)) else [value]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          _cudnn_eqns(getattr(inner, "jaxpr", inner), out)
  return out


def _packed_batch(cfg, rows, t, lengths_per_row):
  """A packed Batch: row r holds segments of the given lengths (positions restart, 0 = padding)."""
  from jaxreplay.learner import batch as batch_lib  # pylint: disable=g-import-not-at-top
  tokens = np.zeros((rows, t), np.int32)
  positions, segments = np.zeros_like(tokens), np.zeros_like(tokens)
  mask = np.zeros((rows, t), np.float32)
  rng = np.random.default_rng(0)
  for r, lengths in enumerate(lengths_per_row):
    at = 0
    for k, n in enumerate(lengths):
      tokens[r, at:at + n] = rng.integers(3, cfg.vocab_size, n)
      positions[r, at:at + n] = np.arange(n)
      segments[r, at:at + n] = k + 1
      mask[r, at + 1:at + n - 1] = 1.0
      at += n
  targets = np.concatenate([tokens[:, 1:], np.zeros((rows, 1), np.int32)], axis=1)
  per_token = np.where(segments > 0, 0.5, 0.0).astype(np.float32)
  return batch_lib.Batch(tokens=tokens, positions=positions, segment_ids=segments, targets=targets,
                         completion_mask=mask, behaviour_logprobs=np.zeros_like(mask),
                         advantages=per_token, rewards=per_token,
                         policy_version=np.zeros((rows, t), np.int32))


def _unpacked(batch):
  """The same arrays with per-row advantages (Batch.packed False): one sequence per row."""
  return batch._replace(advantages=batch.advantages[:, 0], rewards=batch.rewards[:, 0],
                        policy_version=batch.policy_version[:, 0])


def test_train_step_gives_cudnn_no_dense_bias_for_unpacked_rows(pretend_cudnn):
  """The jitted train step with model.attention=cudnn in bf16, traced as for a GPU: on unpacked
  rows the cuDNN calls (forward and backward) get sequence lengths and PADDING_CAUSAL, and no
  [B, 1, T, S] operand (no bias, no bias gradient); packed rows still pass the segment mask as a
  bias (counted in the memory plan)."""
  from jaxreplay.infra import sharding  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import loss_fn as loss_fn_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import optim, trainer  # pylint: disable=g-import-not-at-top
  cfg = TINY.replace(dtype="bfloat16", attention="cudnn")
  rows, t = 4, 64
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  opt = optim.make_optimizer(1e-3)
  state = jax.eval_shape(lambda: trainer.init_train_state(cfg, opt, jax.random.PRNGKey(0),
                                                          mesh=mesh))
  step = trainer.make_train_step(cfg, opt, loss_fn_lib.make_loss_fn("grpo"), mesh,
                                 trainer.state_shardings(state, mesh), chunk_size=32, donate=False)
  packed = _packed_batch(cfg, rows, t, [[20, 30], [64], [10, 10, 10], [5]])
  single = _unpacked(_packed_batch(cfg, rows, t, [[50], [64], [12], [1]]))
  found = {}
  for name, batch in (("unpacked", single), ("packed", packed)):
    eqns = _cudnn_eqns(step.trace(state, batch).jaxpr.jaxpr)
    assert len(eqns) >= 2, name  # the forward and its backward
    found[name] = eqns
  for eqn in found["unpacked"]:
    shapes = [tuple(v.aval.shape) for v in eqn.invars + eqn.outvars]
    assert not [s for s in shapes if len(s) == 4 and s[1] == 1 and s[2:] == (t, t)], shapes
    assert eqn.params["variadic_args"] == (False, False)  # no bias, no dropout
    assert str(eqn.params["mask_type"]).endswith("PADDING_CAUSAL")
    assert (rows,) in shapes  # the sequence lengths
  biased = [e for e in found["packed"]
            if (rows, 1, t, t) in [tuple(v.aval.shape) for v in e.invars + e.outvars]]
  assert biased and all(e.params["variadic_args"][0] for e in found["packed"])


def _reference_and_call(q, k, v, segment_ids, single):
  mask = transformer.attention_mask(segment_ids)
  lengths = jnp.maximum(jnp.sum(segment_ids > 0, axis=1), 1) if single else None
  ref = transformer.einsum_attention(q, k, v, mask)
  args = transformer.cudnn_call_args(mask, True, lengths)
  return ref, jax.nn.dot_product_attention(q, k, v, implementation="xla", **args)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cudnn_masking_computes_the_reference_attention(layout):
  """The masking arguments handed to cuDNN (lengths + is_causal for one right-padded sequence per
  row; the segment mask for packed rows), run through XLA on CPU, equal `einsum_attention` at
  every valid position; padded positions stay finite (an all-padding row included)."""
  b, t, hq, hkv, hd = 4, 24, 4, 2, 16
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, hq, hd))
  k = jax.random.normal(keys[1], (b, t, hkv, hd))
  v = jax.random.normal(keys[2], (b, t, hkv, hd))
  if layout == "padded":
    lengths = [24, 17, 1, 0]
    seg = np.array([[1] * n + [0] * (t - n) for n in lengths], np.int32)
  else:
    seg = np.array([[1] * 10 + [2] * 8 + [0] * 6, [1] * 24, [1] * 3 + [2] * 3 + [3] * 3 + [0] * 15,
                    [0] * 24], np.int32)
  ref, got = _reference_and_call(q, k, v, jnp.asarray(seg), layout == "padded")
  valid = seg > 0
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=2e-5, rtol=2e-5)
  assert np.isfinite(np.asarray(got)).all()


def test_model_logits_unchanged_by_the_single_sequence_flag():
  """hidden_states / apply with single_sequence_rows on padded rows: the XLA kernel's logits
  equal the einsum reference's (valid positions), and equal the flag-off logits exactly."""
  params = transformer.init_params(TINY, jax.random.key(1))
  t = 16
  lengths = [16, 9, 3]
  tokens = np.array([[5 + (i * 7 + j) % 50 if j < n else 0 for j in range(t)]
                     for i, n in enumerate(lengths)], np.int32)
  seg = (tokens > 0).astype(np.int32)
  xla = TINY.replace(attention="xla")
  on = transformer.apply(xla, params, tokens, segment_ids=seg, single_sequence_rows=True)
  off = transformer.apply(xla, params, tokens, segment_ids=seg)
  ref = transformer.apply(TINY.replace(attention="einsum"), params, tokens, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
  np.testing.assert_allclose(np.asarray(on)[seg > 0], np.asarray(ref)[seg > 0], atol=1e-4)


def test_cudnn_constraints_are_checked_first_and_fall_back_once(monkeypatch, caplog):
  assert transformer.cudnn_problem((1, 8, 4, 32), (1, 8, 2, 32), jnp.float32, False).startswith(
      "dtype float32")
  assert "head_dim 12" in transformer.cudnn_problem((1, 8, 4, 12), (1, 8, 2, 12), jnp.bfloat16,
                                                    False)
  assert "at most 128" in transformer.cudnn_problem((1, 8, 4, 192), (1, 8, 2, 192), jnp.bfloat16,
                                                    False, compute_capability=(8, 0))
  assert transformer.cudnn_problem((1, 8, 4, 192), (1, 8, 2, 192), jnp.bfloat16, False,
                                   compute_capability=(9, 0)) is None
  assert "odd sequence" in transformer.cudnn_problem((1, 7, 4, 32), (1, 7, 2, 32), jnp.bfloat16,
                                                     True)
  assert transformer.cudnn_problem((1, 7, 4, 32), (1, 7, 2, 32), jnp.bfloat16, False) is None
  # head_dim 12 in bf16: an explicit "cudnn" names the fix; "auto" (resolved to cuDNN, as on a
  # GPU) computes XLA attention with one warning, however often it is traced.
  q = jax.random.normal(jax.random.key(0), (2, 8, 4, 12)).astype(jnp.bfloat16)
  k = jax.random.normal(jax.random.key(1), (2, 8, 2, 12)).astype(jnp.bfloat16)
  mask = transformer.attention_mask(jnp.ones((2, 8), jnp.int32))
  with pytest.raises(ValueError, match="head_dim 12.*model.attention='xla'"):
    transformer.attention(q, k, k, mask, "cudnn", causal=True)
  monkeypatch.setattr(transformer, "resolve_attention", lambda impl, dtype: "cudnn")
  monkeypatch.setattr(transformer, "_WARNED", set())
  want = jax.nn.dot_product_attention(q, k, k, mask=mask[:, None], implementation="xla")
  with caplog.at_level(logging.WARNING):
    for _ in range(3):
      got = transformer.attention(q, k, k, mask, "auto", causal=True)
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  warnings = [r for r in caplog.records if "cuDNN attention rejected" in r.getMessage()]
  assert len(warnings) == 1 and "head_dim 12" in warnings[0].getMessage()


def test_memory_plan_counts_the_dense_bias_of_packed_rows():
  """Without remat every layer keeps cuDNN's dense bias of packed rows, its gradient and the bool
  mask; with remat they are recomputed in the backward (XLA:GPU's compiled temporaries of the
  four GPU configs, bench/gpu_compile.py), so the plan adds nothing for them."""
  rows, t = 4, 4608
  for remat, per_layer in ((False, 2 * rows * t * t * 2 + rows * t * t), (True, 0)):
    cfg = presets.qwen3_8b(dtype="bfloat16", remat=remat)
    flash = memory_plan.activation_bytes(cfg, rows, t, 512, flash_attention=True)
    biased = memory_plan.activation_bytes(cfg, rows, t, 512, flash_attention=True, dense_bias=True)
    assert biased - flash == cfg.num_hidden_layers * per_layer, remat  # bias + gradient + mask
