"""Regime diagnostics, device side (`learner.diagnostics`): the gradient-noise estimates against
direct gradients and Monte Carlo, the off-policy statistics and the update KL against numpy."""
import dataclasses

import chex
import jax
import numpy as np
import pytest

from jaxreplay.learner import diagnostics
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs as logprobs_lib
from tests.helpers import tolerances
from tests.helpers.train_batches import CFG, B, T, one_device_setup


def test_noise_estimates_are_unbiased_monte_carlo():
  """Per-sample gradients G + noise with covariance diag(s^2): the two estimates average to |G|^2
  and tr(Sigma) over many batches (McCandlish et al. 2018, App. A)."""
  rng = np.random.default_rng(0)
  dim, big, k, trials = 5, 16, 4, 20000
  g_true = rng.normal(size=dim)
  scales = rng.uniform(0.5, 2.0, size=dim)
  samples = g_true + rng.normal(size=(trials, big, dim)) * scales
  small = samples.reshape(trials, k, big // k, dim).mean(axis=2)         # k micro-batch means
  sq_small = np.mean(np.sum(small ** 2, axis=-1), axis=1)
  sq_big = np.sum(samples.mean(axis=1) ** 2, axis=-1)
  g2, trace = diagnostics.noise_estimates(sq_small, sq_big, big // k, big)
  se_g2, se_tr = g2.std() / np.sqrt(trials), trace.std() / np.sqrt(trials)
  assert abs(g2.mean() - np.sum(g_true ** 2)) < 4 * se_g2
  assert abs(trace.mean() - np.sum(scales ** 2)) < 4 * se_tr


@pytest.fixture(scope="module")
def setup():
  return one_device_setup()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_gradient_norms_equal_direct_gradients(setup, aggregation):
  """grad_sq_big is |grad of the whole batch's loss|^2 and grad_sq_small the mean of each
  micro-batch's own loss gradient norm^2, computed here with jax.grad directly."""
  mesh, params, shardings, batch = setup
  loss_fn = trainer.make_loss_fn("grpo", aggregation=aggregation)
  k = 2
  fn = diagnostics.make_diagnostics_fn(CFG, loss_fn, mesh, shardings, splits=k, chunk_size=16)
  got = jax.device_get(fn(params, None, batch))

  def loss_of(p, b, normalizer=None):
    lfn = loss_fn if normalizer is None else dataclasses.replace(loss_fn, normalizer=normalizer)
    lp = logprobs_lib.token_logprobs(CFG, p, b.tokens, b.targets, b.positions, b.segment_ids)
    return lfn(lp, b)[0]

  sq = lambda g: float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g)))
  norm_big = float(B * T) if aggregation == "constant" else None
  g_big = jax.grad(loss_of)(params, batch, norm_big)
  smalls = []
  for i in range(k):
    mb = jax.tree.map(lambda x: np.asarray(x)[i::k], batch)
    norm = float(B // k * T) if aggregation == "constant" else None
    smalls.append(sq(jax.grad(loss_of)(params, mb, norm)))
  want_big, want_small = sq(g_big), float(np.mean(smalls))
  n = T * CFG.vocab_size  # each element sums over tokens and logits
  np.testing.assert_allclose(got["grad_sq_big"], want_big, **tolerances.close(np.float32, n))
  np.testing.assert_allclose(got["grad_sq_small"], want_small, **tolerances.close(np.float32, n))
  rows = float(np.sum(np.asarray(batch.completion_mask).sum(axis=1) > 0))
  assert got["batch_rollouts"] == rows and got["micro_rollouts"] == rows / k


def _np_off_policy(lp, blp, mask, eps=0.2):
  m = mask > 0
  log_r = (lp - blp)[m].astype(np.float64)
  r = np.exp(log_r)
  seq = np.array([np.sum((lp - blp)[i][m[i]]) for i in range(lp.shape[0]) if m[i].any()])
  w = np.exp(seq - seq.max())
  return {"behaviour_kl_k3": np.mean(r - 1 - log_r),
          "ratio_p05": np.quantile(r, 0.05), "ratio_p50": np.quantile(r, 0.5),
          "ratio_p95": np.quantile(r, 0.95),
          "ratio_outside_clip": np.mean((r < 1 - eps) | (r > 1 + eps)),
          "is_ess": w.sum() ** 2 / (len(w) * np.sum(w ** 2))}


class OffPolicyStatsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_against_numpy(self):
    rng = np.random.default_rng(5)
    lp = rng.normal(-2, 1, size=(6, 10)).astype(np.float32)
    blp = (lp + rng.normal(0, 0.3, size=lp.shape)).astype(np.float32)
    mask = (rng.random(lp.shape) < 0.7).astype(np.float32)
    mask[-1] = 0.0  # a row without completion tokens counts for nothing
    got = self.variant(diagnostics.off_policy_stats)(lp, blp, mask)
    want = _np_off_policy(lp, blp, mask)
    for key, value in want.items():
      np.testing.assert_allclose(got[key], value, **tolerances.close(
          np.float32, mask.size, max(abs(value), 1e-3)), err_msg=key)

  @chex.variants(with_jit=True, without_jit=True)
  def test_on_policy_batch(self):
    lp = np.full((3, 4), -1.5, np.float32)
    got = self.variant(diagnostics.off_policy_stats)(lp, lp, np.ones((3, 4), np.float32))
    chex.assert_trees_all_close(got, {"behaviour_kl_k3": 0.0, "ratio_p05": 1.0, "ratio_p50": 1.0,
                                      "ratio_p95": 1.0, "ratio_outside_clip": 0.0, "is_ess": 1.0})


def test_policy_kl_against_numpy():
  rng = np.random.default_rng(2)
  a = jax.nn.log_softmax(rng.normal(size=(2, 3, 7)), axis=-1)
  b = jax.nn.log_softmax(rng.normal(size=(2, 3, 7)), axis=-1)
  mask = np.array([[1, 1, 0], [0, 1, 1]], np.float32)
  pa, pb = np.exp(np.asarray(a, np.float64)), np.exp(np.asarray(b, np.float64))
  per_pos = np.sum(pa * (np.log(pa) - np.log(pb)), axis=-1)
  want = np.sum(per_pos * mask) / mask.sum()
  np.testing.assert_allclose(diagnostics.policy_kl(a, b, mask), want, **tolerances.close(
      np.float32, a.size, want))  # float32 sums over every position's 7 log-probs vs float64
  assert float(diagnostics.policy_kl(a, a, mask)) == pytest.approx(0.0, abs=1e-7)
