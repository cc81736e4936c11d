"""Tests of jaxreplay.learner.losses against independent numpy references written with explicit loops."""
import dataclasses
import functools
import math

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.learner import algorithms
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import corrections
from jaxreplay.data import experience
from jaxreplay.learner import losses
from jaxreplay.learner import loss_fn as loss_fn_lib
from tests.helpers import tolerances
from tests.helpers.loss_references import (
    EPS_HIGH, EPS_LOW, np_aggregate, np_asymre_advantages, np_dual_clip_and_kl, np_grpo_advantages,
    np_grpo_ddof_advantages, np_loss, np_token_loss)

AGGS = ("token_mean", "sequence_mean", "constant")


# ----------------------------------------------------------------------------------------- inputs


# JAX float32 (jit or not) against float64 numpy: each loss, metric and gradient reduces over at
# most the N = 6 * 10 tokens of make_inputs (or the G rewards of a group).
N = 6 * 10


def tol(n, ref=1.0):
  """Tolerances for float32 results reduced over `n` terms of the size of `ref` (at least 1e-3:
  results near 0 are sums of terms of that size or more)."""
  return tolerances.close(np.float32, n, max(tolerances.tree_scale(ref), 1e-3))


def make_inputs(seed=0, num_rows=6, num_tokens=10):
  """Right-padded rows after a prompt prefix; row 2 has no completion token."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((num_rows, num_tokens), np.float32)
  for b in range(num_rows):
    if b == 2:
      continue
    start = rng.integers(0, 3)
    mask[b, start:rng.integers(start + 1, num_tokens + 1)] = 1.0
  lp = (-rng.uniform(0.05, 3.0, mask.shape)).astype(np.float32)
  return dict(
      logprobs=lp * mask,
      behaviour_logprobs=((lp + rng.normal(0.0, 0.3, mask.shape)) * mask).astype(np.float32),
      ref_logprobs=((lp + rng.normal(0.0, 0.5, mask.shape)) * mask).astype(np.float32),
      tis_logprobs=((lp + rng.normal(0.0, 0.4, mask.shape)) * mask).astype(np.float32),
      advantages=rng.normal(size=num_rows).astype(np.float32),
      mask=mask)


OPTIONS = {"plain": {}, "kl_tis": {"kl_coef": 0.05, "tis_cap": 1.3},
           "tis_uncapped": {"tis_cap": None}}


def loss_kwargs(option, x):
  """(static kwargs for the loss, array kwargs for the loss, kwargs for the numpy reference)."""
  opt = dict(OPTIONS[option])
  static, arrays, ref_kw = {}, {}, {}
  if "kl_coef" in opt:
    static["kl_coef"] = ref_kw["kl_coef"] = opt["kl_coef"]
    arrays["ref_logprobs"] = ref_kw["ref"] = x["ref_logprobs"]
  if "tis_cap" in opt:  # truncated IS: the correction's weights and clip denominator
    ref_kw["cap"] = opt["tis_cap"]
    arrays["proximal_logprobs"] = ref_kw["tis"] = x["tis_logprobs"]
    arrays["token_weights"] = corrections.truncated_is_weights(
        x["tis_logprobs"], x["behaviour_logprobs"], opt["tis_cap"])
  return static, arrays, ref_kw


class AdvantagesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_advantages_vs_numpy(self):
    rewards = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    rewards[3] = (rewards[3] > 0).astype(np.float32)  # a binary-reward group
    got = self.variant(losses.grpo_advantages)(rewards)
    self.assertEqual(got.dtype, jnp.float32)
    chex.assert_trees_all_close(got, np_grpo_advantages(rewards), **tol(8, rewards))

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_advantages_equal_rewards_are_exactly_zero(self):
    rewards = np.array([[0.1] * 16, [1.0] * 16, [0.0] * 8 + [1.0] * 8, [0.7] * 16], np.float32)
    got = np.asarray(self.variant(losses.grpo_advantages)(rewards))
    self.assertTrue(np.all(np.isfinite(got)))
    np.testing.assert_array_equal(got[[0, 1, 3]], 0.0)
    np.testing.assert_allclose(got[2], [-1.0] * 8 + [1.0] * 8, **tol(16))
    single = self.variant(losses.grpo_advantages)(np.array([[3.0], [-1.0]], np.float32))
    np.testing.assert_array_equal(single, 0.0)

  def test_grpo_advantages_int_rewards(self):
    rewards = np.array([[0, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    got = losses.grpo_advantages(rewards, eps=1e-3)
    chex.assert_trees_all_close(got, np_grpo_advantages(rewards, eps=1e-3), **tol(4))

  @chex.variants(with_jit=True, without_jit=True)
  def test_asymre_advantages_vs_numpy(self):
    rewards = np.random.default_rng(2).uniform(size=(3, 5)).astype(np.float32)
    for tau in (-0.1, 0.0, 0.25):
      got = self.variant(functools.partial(losses.asymre_advantages, tau=tau))(rewards)
      chex.assert_trees_all_close(got, np_asymre_advantages(rewards, tau), **tol(5))

  @chex.variants(with_jit=True, without_jit=True)
  def test_asymre_group_size_one_baseline_is_tau(self):
    rewards = np.array([[1.0], [0.0], [0.5]], np.float32)
    got = self.variant(losses.asymre_advantages)(rewards)
    chex.assert_trees_all_close(got, rewards + 0.1, **tol(1))

  def test_rewards_rank_and_dtype_errors(self):
    with pytest.raises(ValueError, match="rank"):
      losses.grpo_advantages(np.zeros((4,), np.float32))
    with pytest.raises(ValueError, match="rank"):
      losses.asymre_advantages(np.zeros((2, 2, 2), np.float32))
    with pytest.raises(ValueError, match="dtype"):
      losses.grpo_advantages(np.zeros((2, 2), np.complex64))


class BuildingBlocksTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*AGGS)
  def test_aggregate_vs_numpy(self, aggregation):
    x = make_inputs(3)
    per_token = np.random.default_rng(3).normal(size=x["mask"].shape).astype(np.float32)
    got = self.variant(functools.partial(losses.aggregate, aggregation=aggregation))(
        per_token, x["mask"])
    np.testing.assert_allclose(got, np_aggregate(per_token, x["mask"], aggregation), **tol(N, per_token))

  @chex.variants(with_jit=True, without_jit=True)
  def test_aggregate_custom_normalizer(self):
    x = make_inputs(4)
    per_token = np.random.default_rng(4).normal(size=x["mask"].shape).astype(np.float32)
    got = self.variant(functools.partial(losses.aggregate, aggregation="constant",
                                         normalizer=7.0))(per_token, x["mask"])
    np.testing.assert_allclose(got, np_aggregate(per_token, x["mask"], "constant", 7.0), **tol(N, per_token))

  @chex.variants(with_jit=True, without_jit=True)
  def test_k3_kl(self):
    rng = np.random.default_rng(5)
    lp, ref = (-rng.uniform(0.1, 2.0, (6, 10)).astype(np.float32) for _ in range(2))
    got = self.variant(losses.k3_kl)(lp, ref)
    want = np.zeros(lp.shape)
    for b in range(6):
      for t in range(10):
        d = float(ref[b, t]) - float(lp[b, t])
        want[b, t] = math.exp(d) - d - 1.0
    chex.assert_trees_all_close(got, want, **tol(1, want))
    self.assertTrue(np.all(np.asarray(got) >= 0))
    np.testing.assert_array_equal(self.variant(losses.k3_kl)(lp, lp), 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_clipped_surrogate(self):
    ratio = np.array([[0.5, 0.95, 1.05, 1.5]] * 2, np.float32)
    adv = np.array([2.0, -1.0], np.float32)
    fn = self.variant(functools.partial(losses.clipped_surrogate, eps_low=EPS_LOW, eps_high=EPS_HIGH))
    obj, clipped = fn(ratio, adv)
    chex.assert_trees_all_close(
        obj, np.array([[1.0, 1.9, 2.1, 2.6], [-0.9, -0.95, -1.05, -1.5]]), **tol(1, 2.6))
    np.testing.assert_array_equal(clipped, [[False, False, False, True], [True, False, False, False]])
    obj_2d, _ = fn(ratio, np.broadcast_to(adv[:, None], ratio.shape))
    chex.assert_trees_all_close(obj_2d, obj)


def over_aggregations(loss_fn, normalizer=None, grad=False, **static):
  """fn(*args, **arrays) -> {aggregation: loss_fn(...)} (or its grad wrt args[0]), one trace for all."""
  def fn(*args, **arrays):
    out = {}
    for agg in AGGS:
      f = functools.partial(loss_fn, aggregation=agg,
                            normalizer=normalizer if agg == "constant" else None, **static)
      if grad:
        out[agg] = jax.grad(lambda a: f(a, *args[1:], **arrays)[0])(args[0])
      else:
        out[agg] = f(*args, **arrays)
    return out
  return fn


class LossValuesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*OPTIONS)
  def test_grpo_loss_vs_numpy(self, option):
    x = make_inputs(10)
    static, arrays, ref_kw = loss_kwargs(option, x)
    normalizer = 50.0 if option == "kl_tis" else None
    fn = self.variant(over_aggregations(losses.grpo_loss, normalizer, eps_low=EPS_LOW,
                                        eps_high=EPS_HIGH, **static))
    got = fn(x["logprobs"], x["behaviour_logprobs"], x["advantages"], x["mask"], **arrays)
    for aggregation, (loss, aux) in got.items():
      want_loss, want_aux = np_loss(
          x["logprobs"], x["advantages"], x["mask"], "grpo", aggregation,
          normalizer if aggregation == "constant" else None, blp=x["behaviour_logprobs"], **ref_kw)
      self.assertEqual(loss.dtype, jnp.float32)
      np.testing.assert_allclose(loss, want_loss, **tol(N, want_loss), err_msg=aggregation)
      self.assertEqual(set(aux), set(want_aux))
      for k, v in want_aux.items():
        self.assertEqual(aux[k].dtype, jnp.float32, k)
        np.testing.assert_allclose(aux[k], v, **tol(N, v), err_msg=f"{aggregation} {k}")
      # The random inputs exercise both sides of the (asymmetric) clip range.
      self.assertGreater(float(aux["clip_fraction"]), 0.0)
    self.assertLess(float(got["token_mean"][0]), 1e3)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(False, True)
  def test_asymre_loss_vs_numpy(self, with_kl):
    x = make_inputs(11)
    kl = {"kl_coef": 0.2} if with_kl else {}
    arrays = {"ref_logprobs": x["ref_logprobs"]} if with_kl else {}
    got = self.variant(over_aggregations(losses.asymre_loss, **kl))(
        x["logprobs"], x["advantages"], x["mask"], **arrays)
    ref_kw = {"ref": x["ref_logprobs"], "kl_coef": 0.2} if with_kl else {}
    for aggregation, (loss, aux) in got.items():
      want_loss, want_aux = np_loss(x["logprobs"], x["advantages"], x["mask"], "asymre",
                                    aggregation, **ref_kw)
      np.testing.assert_allclose(loss, want_loss, **tol(N, want_loss), err_msg=aggregation)
      self.assertEqual(set(aux), set(want_aux))
      for k, v in want_aux.items():
        np.testing.assert_allclose(aux[k], v, **tol(N, v), err_msg=f"{aggregation} {k}")

  def test_asymre_monitoring_ratio(self):
    x = make_inputs(12)
    loss, aux = losses.asymre_loss(x["logprobs"], x["advantages"], x["mask"],
                                   behaviour_logprobs=x["behaviour_logprobs"])
    _, want = np_loss(x["logprobs"], x["advantages"], x["mask"], "grpo", "token_mean",
                      blp=x["behaviour_logprobs"])
    np.testing.assert_allclose(aux["ratio_mean"], want["ratio_mean"], **tol(N, want["ratio_mean"]))
    np.testing.assert_allclose(aux["ratio_max"], want["ratio_max"], **tol(N, want["ratio_max"]))
    np.testing.assert_allclose(loss, losses.asymre_loss(x["logprobs"], x["advantages"], x["mask"])[0])


def grad_scale(mask, aggregation, normalizer=None):
  """d aggregate / d per_token[b, t] for a {0, 1} mask, by cases."""
  num_rows, num_tokens = mask.shape
  scale = np.zeros(mask.shape)
  row_counts = [mask[b].sum() for b in range(num_rows)]
  valid_rows = sum(1 for n in row_counts if n > 0)
  for b in range(num_rows):
    for t in range(num_tokens):
      if mask[b, t] == 0:
        continue
      if aggregation == "token_mean":
        scale[b, t] = 1.0 / mask.sum()
      elif aggregation == "sequence_mean":
        scale[b, t] = 1.0 / (row_counts[b] * valid_rows)
      else:
        scale[b, t] = 1.0 / (normalizer or num_rows * num_tokens)
  return scale


class GradientsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_asymre_grad(self):
    x = make_inputs(20)
    grads = self.variant(over_aggregations(losses.asymre_loss, grad=True))(
        x["logprobs"], x["advantages"], x["mask"])
    for aggregation, grad in grads.items():
      want = -x["advantages"][:, None] * grad_scale(x["mask"], aggregation)
      chex.assert_trees_all_close(grad, want, **tol(N, want), custom_message=aggregation)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("plain", "kl", "tis")
  def test_grpo_grad_inside_and_outside_clip(self, option):
    # Rows: A > 0 and A < 0; columns: rho below, inside (twice) and above [0.9, 1.3], twice, then
    # on-policy and inside. The shapes match make_inputs (eager kernels are compiled per shape).
    rho = np.array([0.5, 0.95, 1.05, 1.5, 0.5, 0.95, 1.05, 1.5, 1.0, 1.2])
    adv = np.array([1.0, -1.0, 0.5, -2.0, 0.0, 3.0], np.float32)
    mask = np.ones((6, 10), np.float32)
    mask[2, 6:] = 0.0
    mask[4] = 0.0
    rng = np.random.default_rng(21)
    behaviour = (-rng.uniform(0.5, 2.0, mask.shape)).astype(np.float32)
    lp = (behaviour + np.log(rho)[None, :]).astype(np.float32)
    ref = (lp + rng.normal(0, 0.5, mask.shape)).astype(np.float32)
    tis = (behaviour + rng.normal(0, 0.4, mask.shape)).astype(np.float32)
    static, arrays = {}, {}
    if option == "kl":
      static, arrays = {"kl_coef": 0.3}, {"ref_logprobs": ref}
    if option == "tis":  # the "tis" correction's weights and clip denominator
      arrays = {"proximal_logprobs": tis,
                "token_weights": corrections.truncated_is_weights(tis, behaviour, 1.4)}
    fn = over_aggregations(losses.grpo_loss, grad=True, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                           **static)
    grads = self.variant(fn)(lp, behaviour, adv, mask, **arrays)

    old = tis if option == "tis" else behaviour
    want = np.zeros(mask.shape)  # the gradient of the per-token loss; grad_scale aggregates it
    num_clipped = 0
    for b in range(6):
      for t in range(10):
        if mask[b, t] == 0:
          continue
        r = math.exp(float(lp[b, t]) - float(old[b, t]))
        clipped_active = ((adv[b] > 0 and r > 1 + EPS_HIGH) or (adv[b] < 0 and r < 1 - EPS_LOW))
        num_clipped += clipped_active
        w = min(math.exp(float(tis[b, t]) - float(behaviour[b, t])), 1.4) if option == "tis" else 1.0
        want[b, t] = 0.0 if clipped_active else -w * adv[b] * r
        if option == "kl":
          want[b, t] += 0.3 * (1.0 - math.exp(float(ref[b, t]) - float(lp[b, t])))
    for aggregation, grad in grads.items():
      scaled = want * grad_scale(mask, aggregation)
      chex.assert_trees_all_close(grad, scaled, **tol(N, scaled), custom_message=aggregation)
    if option == "plain":
      self.assertEqual(num_clipped, 9)  # (A>0, rho=1.5) and (A<0, rho=0.5); row 2 ends at t=6
      aux = losses.grpo_loss(lp, behaviour, adv, mask, EPS_LOW, EPS_HIGH)[1]
      np.testing.assert_allclose(aux["clip_fraction"], num_clipped / mask.sum(), **tol(N))
      np.testing.assert_allclose(aux["ratio_max"], 1.5, **tol(N, 1.5))

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_on_policy_grad_is_reinforce(self):
    x = make_inputs(22)
    fn = lambda lp: losses.grpo_loss(lp, x["logprobs"], x["advantages"], x["mask"])[0]
    grad = self.variant(jax.grad(fn))(x["logprobs"])
    want = -x["advantages"][:, None] * x["mask"] / x["mask"].sum()
    chex.assert_trees_all_close(grad, want, **tol(N, want))


class EdgeCasesTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_empty_rows_contribute_nothing(self):
    x = make_inputs(30)
    keep = x["mask"].sum(axis=1) > 0
    self.assertFalse(keep.all())
    garbage = x["logprobs"].copy()
    garbage[~keep] = np.array([np.nan, np.inf, -np.inf, 80.0, -1e30, 0, 0, 0, 0, 0], np.float32)
    behaviour = x["behaviour_logprobs"].copy()
    behaviour[~keep] = -90.0
    normalizer = float(x["mask"].size)  # the same "constant" divisor after the cut
    args = (garbage, behaviour, x["advantages"], x["mask"])
    full = self.variant(over_aggregations(losses.grpo_loss, normalizer))(*args)
    cut = jax.jit(over_aggregations(losses.grpo_loss, normalizer))(
        x["logprobs"][keep], x["behaviour_logprobs"][keep], x["advantages"][keep], x["mask"][keep])
    chex.assert_trees_all_close(full, cut, **tol(N, full))
    grads = self.variant(over_aggregations(losses.grpo_loss, normalizer, grad=True))(*args)
    for grad in grads.values():
      self.assertTrue(np.all(np.isfinite(grad)))
      np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("grpo", "asymre")
  def test_all_zero_mask_is_finite(self, kind):
    x = make_inputs(31)
    mask = np.zeros_like(x["mask"])
    if kind == "grpo":
      loss_fn = functools.partial(losses.grpo_loss, kl_coef=0.1)
      args = (x["logprobs"], x["behaviour_logprobs"], x["advantages"], mask)
      arrays = {"ref_logprobs": x["ref_logprobs"], "proximal_logprobs": x["tis_logprobs"],
                "token_weights": corrections.truncated_is_weights(
                    x["tis_logprobs"], x["behaviour_logprobs"], 2.0)}
    else:
      loss_fn = functools.partial(losses.asymre_loss, kl_coef=0.1)
      args = (x["logprobs"], x["advantages"], mask)
      arrays = {"ref_logprobs": x["ref_logprobs"], "behaviour_logprobs": x["behaviour_logprobs"]}

    def fn(*a, **kw):
      return (over_aggregations(loss_fn)(*a, **kw),
              over_aggregations(loss_fn, grad=True)(*a, **kw))

    values, grads = self.variant(fn)(*args, **arrays)
    for aggregation in AGGS:
      loss, aux = values[aggregation]
      self.assertEqual(float(loss), 0.0)
      np.testing.assert_array_equal(grads[aggregation], 0.0)
      for k, v in aux.items():
        self.assertTrue(np.isfinite(v), f"{aggregation} {k}")
      self.assertEqual(float(aux["num_tokens"]), 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_inputs_give_float32(self):
    x = make_inputs(32)
    bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in x.items()}
    as64 = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in bf.items()}
    loss, aux = self.variant(losses.grpo_loss)(bf["logprobs"], bf["behaviour_logprobs"],
                                               bf["advantages"], bf["mask"])
    self.assertEqual(loss.dtype, jnp.float32)
    self.assertTrue(all(v.dtype == jnp.float32 for v in aux.values()))
    want, _ = np_loss(as64["logprobs"], as64["advantages"], as64["mask"], "grpo", "token_mean",
                      blp=as64["behaviour_logprobs"], eps_low=0.2, eps_high=0.2)  # the defaults
    np.testing.assert_allclose(loss, want, **tol(N, want))
    loss, _ = self.variant(losses.asymre_loss)(bf["logprobs"], bf["advantages"], bf["mask"])
    self.assertEqual(loss.dtype, jnp.float32)
    want, _ = np_loss(as64["logprobs"], as64["advantages"], as64["mask"], "asymre", "token_mean")
    np.testing.assert_allclose(loss, want, **tol(N, want))
    adv = losses.grpo_advantages(jnp.ones((2, 4), jnp.bfloat16))
    self.assertEqual(adv.dtype, jnp.float32)

  def test_bool_and_int_masks(self):
    x = make_inputs(33)
    want = losses.grpo_loss(x["logprobs"], x["behaviour_logprobs"], x["advantages"], x["mask"])
    for dtype in (np.bool_, np.int32):
      got = jax.jit(losses.grpo_loss)(x["logprobs"], x["behaviour_logprobs"], x["advantages"],
                             x["mask"].astype(dtype))
      chex.assert_trees_all_close(got, want)


class InputErrorsTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.x = make_inputs(40)

  def test_rank_shape_dtype_errors(self):
    x = self.x
    lp, blp, adv, mask = x["logprobs"], x["behaviour_logprobs"], x["advantages"], x["mask"]
    cases = {
        "advantages": lambda: losses.grpo_loss(lp, blp, adv[:, None], mask),
        "'logprobs'": lambda: losses.asymre_loss(lp[0], adv, mask[0]),
        "behaviour_logprobs": lambda: losses.grpo_loss(lp, blp[:, :-1], adv, mask),
        "'mask'": lambda: losses.asymre_loss(lp, adv, mask[:-1]),
        "int32": lambda: losses.asymre_loss(lp.astype(np.int32), adv, mask),
        "ref_logprobs": lambda: losses.grpo_loss(lp, blp, adv, mask, ref_logprobs=lp[None]),
        "proximal_logprobs": lambda: losses.grpo_loss(lp, blp, adv, mask, proximal_logprobs=lp.T),
        "one per row": lambda: losses.asymre_loss(lp, adv[:-1], mask),
    }
    for pattern, call in cases.items():
      with pytest.raises(losses.LossInputError, match=pattern):
        call()
    self.assertTrue(issubclass(losses.LossInputError, ValueError))
    self.assertTrue(issubclass(losses.LossInputError, AssertionError))

  def test_option_errors(self):
    x = self.x
    args = (x["logprobs"], x["behaviour_logprobs"], x["advantages"], x["mask"])
    with pytest.raises(ValueError, match="token_mean.*sequence_mean.*constant"):
      losses.grpo_loss(*args, aggregation="mean")
    with pytest.raises(ValueError, match="valid choices"):
      losses.asymre_loss(x["logprobs"], x["advantages"], x["mask"], aggregation="sum")
    with pytest.raises(ValueError, match="valid choices"):
      losses.aggregate(x["logprobs"], x["mask"], "tokens")
    with pytest.raises(ValueError, match="ref_logprobs"):
      losses.grpo_loss(*args, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
      losses.asymre_loss(x["logprobs"], x["advantages"], x["mask"], kl_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
      losses.grpo_loss(*args, dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_clamp must be >= 0"):
      losses.grpo_loss(*args, ref_logprobs=x["ref_logprobs"], kl_clamp=-1.0)
    with pytest.raises(ValueError, match="ddof=2"):
      losses.grpo_advantages(np.zeros((2, 4), np.float32), ddof=2)
    with pytest.raises(ValueError, match="normalizer"):
      losses.grpo_loss(*args, normalizer=10.0)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
      losses.aggregate(x["logprobs"], x["mask"], "constant", normalizer=0)
    with pytest.raises(ValueError, match="eps_low"):
      losses.grpo_loss(*args, eps_low=-0.1)


# ------------------------------------------------------------- the algorithm table and aux kinds


def as_batch(x):
  """make_inputs as a Batch (the token fields are unused by the losses)."""
  num_rows, num_tokens = x["mask"].shape
  ints = np.zeros((num_rows, num_tokens), np.int32)
  return batch_lib.Batch(tokens=ints, positions=ints, segment_ids=ints, targets=ints,
                         completion_mask=x["mask"], behaviour_logprobs=x["behaviour_logprobs"],
                         advantages=x["advantages"], rewards=np.zeros(num_rows, np.float32),
                         policy_version=np.zeros(num_rows, np.int32))


class AlgorithmsTest(chex.TestCase):

  def test_table(self):
    self.assertEqual(set(algorithms.ALGORITHMS), {"grpo", "asymre"})
    self.assertIs(algorithms.get("asymre"), algorithms.ALGORITHMS["asymre"])
    with pytest.raises(ValueError, match="'ppo' is unknown.*grpo.*asymre"):
      algorithms.get("ppo")
    with pytest.raises(ValueError, match="unknown"):
      experience.make_advantage_fn("ppo")

  @chex.variants(with_jit=True, without_jit=True)
  def test_advantages_equal_the_losses_functions(self):
    rewards = np.random.default_rng(50).normal(size=(3, 4)).astype(np.float32)
    rewards[1] = 0.5
    grpo, asymre = algorithms.ALGORITHMS["grpo"], algorithms.ALGORITHMS["asymre"]
    self.assertIs(grpo.advantages, losses.grpo_advantages)
    grpo_options = algorithms.GrpoOptions(adv_eps=1e-3, adv_std_ddof=1)
    asymre_options = algorithms.AsymreOptions(tau=0.25)
    got = self.variant(lambda r: (algorithms.advantages("grpo", r, grpo_options),
                                  algorithms.advantages("asymre", r, asymre_options)))(rewards)
    want = (losses.grpo_advantages(rewards, eps=1e-3, ddof=1),
            losses.asymre_advantages(rewards, tau=0.25))
    chex.assert_trees_all_equal(got, want)
    # experience.make_advantage_fn (numpy in, numpy out) takes the algorithm's options dataclass.
    chex.assert_trees_all_equal(experience.make_advantage_fn("grpo", grpo_options)(rewards),
                                np.asarray(want[0]))
    chex.assert_trees_all_equal(experience.make_advantage_fn("asymre", asymre_options)(rewards),
                                np.asarray(want[1]))
    chex.assert_trees_all_equal(experience.make_advantage_fn("asymre")(rewards),
                                np.asarray(asymre.advantages(rewards)))
    with pytest.raises(TypeError, match="loss 'asymre' takes AsymreOptions, got GrpoOptions"):
      experience.make_advantage_fn("asymre", grpo_options)(rewards)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*AGGS)
  def test_losses_equal_the_losses_functions(self, aggregation):
    x = make_inputs(51)
    batch = as_batch(x)
    normalizer = 40.0 if aggregation == "constant" else None
    common = dict(aggregation=aggregation, normalizer=normalizer, kl_coef=0.1)

    def fn(lp, batch, ref):
      table = (algorithms.loss(
                   "grpo", lp, batch, ref,
                   options=algorithms.GrpoOptions(eps_low=EPS_LOW, eps_high=EPS_HIGH), **common),
               algorithms.loss("asymre", lp, batch, ref, **common))
      direct = (losses.grpo_loss(lp, batch.behaviour_logprobs, batch.advantages,
                                 batch.completion_mask, EPS_LOW, EPS_HIGH, ref_logprobs=ref,
                                 **common),
                losses.asymre_loss(lp, batch.advantages, batch.completion_mask, ref_logprobs=ref,
                                   behaviour_logprobs=batch.behaviour_logprobs, **common))
      return table, direct

    table, direct = self.variant(fn)(x["logprobs"], batch, x["ref_logprobs"])
    chex.assert_trees_all_equal(table, direct)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(aggregation=AGGS, with_kl=(False, True))
  def test_grpo_tis_loss_and_grad_vs_numpy(self, aggregation, with_kl):
    """tis_cap = C: per token w = min(pi_theta / pi_sampler, C), loss -w A, gradient -w A."""
    cap, kl_coef = 1.2, 0.05
    x = make_inputs(52)
    lp, blp, ref, mask = (x[k].astype(np.float64) for k in (
        "logprobs", "behaviour_logprobs", "ref_logprobs", "mask"))
    adv = x["advantages"].astype(np.float64)[:, None]
    normalizer = 50.0 if aggregation == "constant" else None
    kw = dict(aggregation=aggregation, normalizer=normalizer, kl_coef=kl_coef if with_kl else 0.0,
              options=algorithms.GrpoOptions(eps_low=EPS_LOW, eps_high=EPS_HIGH),
              off_policy=corrections.OffPolicyOptions(tis_cap=cap))
    ref_arg = x["ref_logprobs"] if with_kl else None
    loss_fn = functools.partial(algorithms.loss, "grpo", **kw)

    def fn(lp, batch, ref):
      return loss_fn(lp, batch, ref), jax.grad(lambda a: loss_fn(a, batch, ref)[0])(lp)

    (loss, aux), grad = self.variant(fn)(x["logprobs"], as_batch(x), ref_arg)

    valid = mask > 0
    ratio = np.exp(lp - blp)
    w = np.minimum(ratio, cap)
    per_token, d_per_token = -w * adv, -w * adv
    if with_kl:
      k3 = np.exp(ref - lp) - (ref - lp) - 1.0
      per_token = per_token + kl_coef * k3
      d_per_token = d_per_token + kl_coef * (1.0 - np.exp(ref - lp))
    per_token, d_per_token = per_token * mask, d_per_token * mask
    np.testing.assert_allclose(loss, np_aggregate(per_token, mask, aggregation, normalizer),
                               **tol(N, per_token))
    chex.assert_trees_all_close(grad, d_per_token * grad_scale(mask, aggregation, normalizer),
                                **tol(N, d_per_token))
    np.testing.assert_allclose(aux["pg_loss"], np_aggregate(-w * adv * mask, mask, aggregation,
                                                            normalizer), **tol(N, -w * adv * mask))
    np.testing.assert_allclose(aux["tis_weight_mean"], w[valid].mean(), **tol(N, w))
    truncated = (ratio >= cap)[valid].mean()
    self.assertTrue(0.0 < truncated < 1.0)
    np.testing.assert_allclose(aux["tis_truncated_fraction"], truncated, **tol(N))
    # The clipped ratio is the trainer's own, exactly 1: the clip never binds.
    self.assertEqual(float(aux["clip_fraction"]), 0.0)
    self.assertEqual(float(aux["ratio_mean"]), 1.0)
    self.assertEqual(float(aux["ratio_max"]), 1.0)

  def test_every_statistic_has_a_kind(self):
    """AUX_KINDS declares exactly the keys the losses return, each with a valid kind."""
    x = make_inputs(53)
    returned = set()
    for kw in ({}, {"kl_coef": 0.1, "ref_logprobs": x["ref_logprobs"]}, {"dual_clip": 3.0}):
      returned |= set(losses.grpo_loss(x["logprobs"], x["behaviour_logprobs"], x["advantages"],
                                       x["mask"], **kw)[1])
    returned |= set(losses.asymre_loss(x["logprobs"], x["advantages"], x["mask"], kl_coef=0.1,
                                       ref_logprobs=x["ref_logprobs"],
                                       behaviour_logprobs=x["behaviour_logprobs"])[1])
    self.assertEqual(returned, set(losses.AUX_KINDS))
    self.assertTrue(set(losses.AUX_KINDS.values()) <= set(losses.AUX_KIND_NAMES))
    for mode, row in corrections.CORRECTIONS.items():  # each correction's, with either loss
      for name in algorithms.ALGORITHMS:
        aux = algorithms.loss(name, x["logprobs"], as_batch(x),
                              off_policy=corrections.OffPolicyOptions(mode))[1]
        self.assertEqual(set(aux) - set(losses.AUX_KINDS), set(row.aux), mode)
      self.assertTrue(set(row.aux.values()) <= set(losses.AUX_KIND_NAMES), mode)


# ------------------------------------------- conventions as options (issue 35), float64 references

def conventions_inputs(far=25.0):
  """make_inputs with ratios far from 1 (so the dual bound c = 2 or 3 binds on tokens with A < 0) and
  reference log-probs far from the policy's (so k3 passes K = 0.5, and |ref - lp| > 20 on two
  tokens, where verl clips the log-ratio before its exp: ref - lp = `far` on one of them, whose
  exp overflows float32 beyond 88)."""
  x = make_inputs(60)
  rng = np.random.default_rng(60)
  mask = x["mask"]
  blp = ((x["logprobs"] + rng.normal(0.0, 1.2, mask.shape)) * mask).astype(np.float32)
  ref = ((x["logprobs"] + rng.normal(0.0, 1.0, mask.shape)) * mask).astype(np.float32)
  rows, cols = np.nonzero(mask)
  for b in np.nonzero(x["advantages"] < 0)[0]:  # one token per A < 0 row at ratio e^1.6 > 3
    t = cols[rows == b][0]
    blp[b, t] = x["logprobs"][b, t] - 1.6
  ref[rows[0], cols[0]] = x["logprobs"][rows[0], cols[0]] + far
  ref[rows[-1], cols[-1]] = x["logprobs"][rows[-1], cols[-1]] - 30.0
  return dict(x, behaviour_logprobs=blp, ref_logprobs=ref)


class ConventionsTest(chex.TestCase):
  """trainer.adv_std_ddof, trainer.dual_clip and trainer.kl_clamp against float64 loops of TRL's and
  verl's formulas; every default leaves the loss exactly as without the option."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_adv_std_ddof_vs_numpy_and_the_trl_verl_factor(self):
    rewards = np.random.default_rng(61).normal(size=(5, 8)).astype(np.float32)
    rewards[3] = (rewards[3] > 0).astype(np.float32)
    rewards[4] = 0.25  # equal rewards: 0 whatever the ddof
    for ddof in (0, 1):
      options = algorithms.GrpoOptions(adv_std_ddof=ddof)
      got = self.variant(lambda r, o=options: algorithms.advantages("grpo", r, o))(rewards)
      chex.assert_trees_all_close(got, np_grpo_ddof_advantages(rewards, 1e-6, ddof), **tol(8, 2.0))
    # The sample std (TRL, verl) scales every advantage by sqrt(G / (G - 1)): x1.069 at G = 8.
    zero_eps = lambda ddof: np.asarray(losses.grpo_advantages(rewards[:4], eps=0.0, ddof=ddof))
    ratio = zero_eps(0) / zero_eps(1)
    np.testing.assert_allclose(ratio, math.sqrt(8 / 7), rtol=1e-5)
    self.assertAlmostEqual(math.sqrt(8 / 7), 1.069, places=3)
    chex.assert_trees_all_equal(self.variant(losses.grpo_advantages)(rewards),
                                self.variant(functools.partial(losses.grpo_advantages, ddof=0))(
                                    rewards))
    with pytest.raises(ValueError, match="trainer.adv_std_ddof=2"):
      algorithms.GrpoOptions(adv_std_ddof=2)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((2.0, 0.0), (0.0, 0.5), (2.0, 0.5), (3.0, 10.0))
  def test_dual_clip_and_kl_clamp_vs_verl(self, dual_clip, kl_clamp):
    x = conventions_inputs(far=100.0 if kl_clamp else 25.0)
    lp, blp, adv, ref, mask = (x[k] for k in ("logprobs", "behaviour_logprobs", "advantages",
                                              "ref_logprobs", "mask"))
    kl_coef, normalizer = 0.3, 40.0
    loss_fn = loss_fn_lib.make_loss_fn(
        "grpo", algorithms.GrpoOptions(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=dual_clip),
        kl_coef=kl_coef, kl_clamp=kl_clamp)

    def fn(lp, batch, ref):
      out = {}
      for agg in AGGS:
        f = dataclasses.replace(loss_fn, aggregation=agg,
                                normalizer=normalizer if agg == "constant" else None)
        out[agg] = (f(lp, batch, ref), jax.grad(lambda a, f=f: f(a, batch, ref)[0])(lp))
      return out

    got = self.variant(fn)(lp, as_batch(x), ref)
    per_token, d_per_token, binds = np_dual_clip_and_kl(
        lp, blp, adv, ref, mask, EPS_LOW, EPS_HIGH, dual_clip, kl_coef, kl_clamp)
    for agg, ((loss, aux), grad) in got.items():
      norm = normalizer if agg == "constant" else None
      want = np_aggregate(per_token, mask, agg, norm)
      np.testing.assert_allclose(loss, want, **tol(N, per_token), err_msg=agg)
      scaled = d_per_token * grad_scale(mask, agg, norm)
      chex.assert_trees_all_close(grad, scaled, **tol(N, scaled), custom_message=agg)
      self.assertTrue(np.all(np.isfinite(grad)), agg)
    aux = got["token_mean"][0][1]
    valid = mask > 0
    if dual_clip:
      self.assertTrue(0 < binds[valid].mean() < 1)  # the inputs exercise the bound
      np.testing.assert_allclose(aux["dual_clip_fraction"], binds[valid].mean(), **tol(N))
    else:
      self.assertNotIn("dual_clip_fraction", aux)
    k3 = np_dual_clip_and_kl(lp, blp, adv, ref, mask, 0.0, 0.0, 0.0, 1.0, kl_clamp)[0] - \
        np_dual_clip_and_kl(lp, blp, adv, ref, mask, 0.0, 0.0, 0.0, 0.0, kl_clamp)[0]
    np.testing.assert_allclose(aux["kl"], k3[valid].mean(), **tol(N, k3))
    if kl_clamp:
      self.assertLess(float(aux["kl"]), kl_clamp + 1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_defaults_leave_the_loss_unchanged(self):
    """dual_clip 0 / None and kl_clamp 0 are the loss without the options, bit for bit."""
    x = conventions_inputs()
    args = (x["logprobs"], x["behaviour_logprobs"], x["advantages"], x["mask"])
    fn = lambda **kw: self.variant(functools.partial(losses.grpo_loss, kl_coef=0.1, **kw))(
        *args, ref_logprobs=x["ref_logprobs"])
    plain = fn()
    chex.assert_trees_all_equal(fn(dual_clip=0.0, kl_clamp=0.0), plain)
    chex.assert_trees_all_equal(fn(dual_clip=None), plain)
    self.assertEqual(algorithms.GrpoOptions(dual_clip=None), algorithms.GrpoOptions())
    self.assertEqual(algorithms.GrpoOptions().loss_args(), {"eps_low": 0.2, "eps_high": 0.2})
    with pytest.raises(ValueError, match="trainer.dual_clip=1.0"):
      algorithms.GrpoOptions(dual_clip=1.0)
    with pytest.raises(ValueError, match="trainer.kl_clamp=-2"):
      loss_fn_lib.make_loss_fn(kl_clamp=-2.0)
