"""The optimizer (`learner.optim`): learning-rate schedules, AdamW with clipping and decay against
the written-out formula, the weight-decay mask."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxreplay.learner import optim


def test_schedules():
  s = optim.make_schedule(1.0, warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
  np.testing.assert_allclose([float(s(i)) for i in range(4)], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
  for i in (4, 9, 14, 20):
    frac = min(i - 4, 10) / 10
    want = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac))
    np.testing.assert_allclose(float(s(i)), want, rtol=1e-5)
  c = optim.make_schedule(0.5, warmup_steps=2)
  np.testing.assert_allclose([float(c(i)) for i in (0, 1, 2, 100)], [0.25, 0.5, 0.5, 0.5])
  assert float(optim.make_schedule(0.3)(0)) == pytest.approx(0.3)
  with pytest.raises(ValueError, match="total_steps > warmup_steps"):
    optim.make_schedule(1.0, 10, 5, "cosine")
  with pytest.raises(ValueError, match="schedule="):
    optim.make_schedule(1.0, schedule="linear")


def test_adamw_matches_numpy_formula():
  """Two AdamW steps with clipping and decay (not on norms), against the written-out formula."""
  lr, b1, b2, eps, wd, clip = 0.1, 0.9, 0.99, 1e-8, 0.1, 1.0
  opt = optim.make_optimizer(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, max_grad_norm=clip)
  params = {"w": jnp.array([1.0, -2.0]), "input_layernorm": jnp.array([1.0, 1.0])}
  grads = [{"w": jnp.array([3.0, 4.0]), "input_layernorm": jnp.array([0.0, 0.5])},
           {"w": jnp.array([0.1, -0.2]), "input_layernorm": jnp.array([0.3, 0.0])}]
  state = opt.init(params)
  p_np = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros(2) for k in p_np}
  v = {k: np.zeros(2) for k in p_np}
  for t, g in enumerate(grads, start=1):
    updates, state = opt.update(g, state, params)
    params = optax.apply_updates(params, updates)
    g_np = {k: np.asarray(x, np.float64) for k, x in g.items()}
    norm = np.sqrt(sum(np.sum(x ** 2) for x in g_np.values()))
    scale = min(1.0, clip / norm)
    for k in p_np:
      gk = g_np[k] * scale
      m[k] = b1 * m[k] + (1 - b1) * gk
      v[k] = b2 * v[k] + (1 - b2) * gk ** 2
      upd = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
      if k == "w":
        upd = upd + wd * p_np[k]
      p_np[k] = p_np[k] - lr * upd
  for k in p_np:
    np.testing.assert_allclose(np.asarray(params[k]), p_np[k], rtol=1e-5)


def test_weight_decay_mask():
  mask = optim.weight_decay_mask({"embed_tokens": 0, "norm": 0, "layers": {
      "q_proj": 0, "q_norm": 0, "q_bias": 0, "input_layernorm": 0}})
  assert mask == {"embed_tokens": True, "norm": False, "layers": {
      "q_proj": True, "q_norm": False, "q_bias": False, "input_layernorm": False}}
