"""The gradient-noise probe's statistics (`science.noise_stats`) against numpy on synthetic
per-example gradients of known variance: Gram blocks, the noise estimator, bootstrap variances, the
debiased bias, the layout estimate and its fit, the measured sigma^2 and the design table."""
import math

import numpy as np
import pytest

from jaxreplay.science import design
from jaxreplay.science import noise_stats


def _minibatch_means(rng, n, b, mean, sd):
  """n minibatch gradients [n, P], each the mean of b per-example gradients ~ N(mean, diag(sd^2))."""
  per_example = mean + sd * rng.standard_normal((n, b, mean.size))
  return per_example.mean(axis=1)


def test_gram_blocks_equal_matmul():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((5, 1001)).astype(np.float32)
  b = rng.standard_normal((3, 1001)).astype(np.float32)
  np.testing.assert_allclose(noise_stats.gram(a, chunk=97),
                             a.astype(np.float64) @ a.T.astype(np.float64), rtol=1e-12)
  np.testing.assert_allclose(noise_stats.gram(a, b, chunk=64), a.astype(np.float64) @ b.T,
                             rtol=1e-12)
  with pytest.raises(ValueError):
    noise_stats.gram(a, b[:, :10])


def test_noise_estimator_matches_numpy_and_known_variance():
  # Per-example gradients in P = 40 dimensions with per-coordinate std sd: the per-example noise
  # E||g - E g||^2 is sum(sd^2); a minibatch of B has it / B.
  rng = np.random.default_rng(1)
  p, b, n = 40, 8, 3000
  mean = rng.standard_normal(p)
  sd = rng.uniform(0.5, 2.0, p)
  grads = _minibatch_means(rng, n, b, mean, sd)
  out = noise_stats.minibatch_gradient_noise(grads.astype(np.float32), b)
  g32 = grads.astype(np.float32).astype(np.float64)
  numpy_var = float(np.sum(np.var(g32, axis=0, ddof=1)))       # 1/(n-1) sum ||g_i - g_bar||^2
  assert out["var_minibatch"] == pytest.approx(numpy_var, rel=1e-9)
  assert out["sigma2"] == pytest.approx(b * numpy_var, rel=1e-9)
  assert out["mean_sq_norm"] == pytest.approx(float(np.sum(g32.mean(0) ** 2)), rel=1e-9)
  # Known variance: sum(sd^2) per example. The estimate's relative std here is ~sqrt(2 sum sd^4 /
  # (n (sum sd^2)^2)) ~ 0.5%; 3% is > 5 standard deviations.
  assert out["sigma2"] == pytest.approx(float(np.sum(sd ** 2)), rel=0.03)


def test_noise_estimator_is_unbiased_at_small_n():
  # With n = 3 minibatches (ddof = 1 matters most), averaged over many independent repeats.
  rng = np.random.default_rng(2)
  p, b, n = 10, 4, 3
  sd = np.linspace(0.5, 1.5, p)
  est = [noise_stats.minibatch_gradient_noise(
      _minibatch_means(rng, n, b, np.ones(p), sd), b)["sigma2"] for _ in range(4000)]
  assert np.mean(est) == pytest.approx(float(np.sum(sd ** 2)), rel=0.03)


def test_variance_with_bootstrap_indices_matches_numpy():
  rng = np.random.default_rng(3)
  g = rng.standard_normal((12, 30))
  k = noise_stats.gram(g)
  idx = rng.integers(0, 12, 12)
  expected = float(np.sum(np.var(g[idx], axis=0, ddof=1)))
  assert noise_stats.variance_from_gram(k, idx) == pytest.approx(expected, rel=1e-10)
  assert noise_stats.variance_from_gram(k[:1, :1]) == 0.0


def test_paired_bias_debiased():
  # u_i = common_i + delta + own noise, v_i = common_i: the paired differences d_i have mean delta
  # and per-coordinate minibatch variance 0.25 / b.
  rng = np.random.default_rng(4)
  p, n, b = 25, 50, 8
  delta = np.full(p, 0.05)
  truth = float(np.sum(delta ** 2))                          # 0.0625
  floor = p * 0.25 / b / n                                   # tr Var(d_bar) = 0.0156

  def draw():
    common = _minibatch_means(rng, n, b, np.zeros(p), np.ones(p))
    own = _minibatch_means(rng, n, b, np.zeros(p), 0.5 * np.ones(p))
    return common + delta + own, common

  u, v = draw()
  d_gram = noise_stats.paired_difference_gram(
      noise_stats.gram(u), noise_stats.gram(u, v), noise_stats.gram(v))
  np.testing.assert_allclose(d_gram, noise_stats.gram(u - v), rtol=1e-9, atol=1e-9)
  raw, debiased = noise_stats.bias_sq_from_gram(d_gram)
  d = u - v
  assert raw == pytest.approx(float(np.sum(d.mean(0) ** 2)), rel=1e-9)
  assert debiased == pytest.approx(raw - float(np.sum(np.var(d, axis=0, ddof=1))) / n, rel=1e-9)
  # Over repeats: E raw = ||delta||^2 + tr Var(d_bar), E debiased = ||delta||^2 (each mean has a
  # standard error ~3e-4 here).
  reps = []
  for _ in range(2000):
    u, v = draw()
    reps.append(noise_stats.bias_sq_from_gram(noise_stats.paired_difference_gram(
        noise_stats.gram(u), noise_stats.gram(u, v), noise_stats.gram(v))))
  raw_mean, deb_mean = np.mean(reps, axis=0)
  assert deb_mean == pytest.approx(truth, abs=2e-3)
  assert raw_mean == pytest.approx(truth + floor, abs=2e-3)


def test_estimate_layout_bootstrap_and_fit():
  # Minibatch noise growing as sigma^2(s) = (1 + s)^0.5 per example at staleness s; pairs share
  # a common part so the bias of s against 0 is the mean shift 0.1 * s in one coordinate.
  rng = np.random.default_rng(5)
  grid, p, b, n = (0, 1, 2, 4, 8), 200, 4, 200
  common = _minibatch_means(rng, n, b, np.zeros(p), np.full(p, 0.03))
  grams, cross, per_s = {}, {}, {}
  for s in grid:
    sd = math.sqrt((1 + s) ** 0.5 / p - 0.03 ** 2)
    shift = np.zeros(p)
    shift[0] = 0.1 * s
    per_s[s] = common + shift + _minibatch_means(rng, n, b, np.zeros(p), np.full(p, sd))
  for s in grid:
    grams[s] = noise_stats.gram(per_s[s])
    cross[s] = noise_stats.gram(per_s[s], per_s[0])
  est = noise_stats.estimate_layout(grams, cross, grid, b, 100, np.random.default_rng(0))
  for i, s in enumerate(grid):
    assert est["sigma2"][i] == pytest.approx((1 + s) ** 0.5, rel=0.05)
    lo, hi = est["sigma2_ci"][i]
    assert lo < est["sigma2"][i] < hi
    bias = math.sqrt(max(est["bias_sq"][i], 0))
    assert bias == pytest.approx(0.1 * s, abs=0.03)
    if s:  # the centred bootstrap brackets the debiased estimate
      assert est["bias_ci"][i][0] < bias < est["bias_ci"][i][1]
  assert est["ratio"][0] == 1.0
  fit = est["fit"]
  ref = design.fit_power_law_noise(grid[1:], est["sigma2"][1:], variance=True)
  assert fit.alpha == pytest.approx(ref.alpha) and fit.r2 == pytest.approx(ref.r2)
  assert est["alpha_ci"][0] < fit.alpha < est["alpha_ci"][1]


def test_fit_with_alpha_near_zero_does_not_overflow():
  # design.fit_power_law_noise overflows computing tau = exp(-b / alpha) as alpha -> 0.
  fit = noise_stats.fit_power_law([1, 2, 4], [5.0, 5.0 * (1 + 1e-12), 5.0 * (1 + 2e-12)])
  assert abs(fit.alpha) < 1e-9 and fit.num_points == 3


def test_measured_sigma2_and_design():
  grid, s2 = (0, 1, 2, 4), (1.0, 3.0, 2.0, 4.0)
  f_max = noise_stats.measured_sigma2(grid, s2, tail_alpha=0.25, kind="max")
  assert f_max(0.5) == pytest.approx(2.0)                    # linear on [0, s_1]
  assert f_max(1.5) == pytest.approx(3.0)                    # running max, not the dip to 2
  assert f_max(2.0 * 2 ** 0.5) == pytest.approx((3.0 * 4.0) ** 0.5)  # log-log between 2 and 4
  assert f_max(16.0) == pytest.approx(4.0 * 4.0 ** 0.5)      # tail (x / 4)^(2 * 0.25)
  xs = np.linspace(0.01, 30, 500)
  assert np.all(np.diff([f_max(x) for x in xs]) >= -1e-12)
  f_mean = noise_stats.measured_sigma2(grid, s2, tail_alpha=0.0, kind="mean")
  assert f_mean(1.0) == pytest.approx(2.0)                   # mean of 1 -> 3 over [0, 1]
  k = math.log(2.0 / 3.0) / math.log(2.0)                    # the piece 3 x^k on [1, 2]
  piece_1_2 = 3.0 / (k + 1.0) * (2.0 ** (k + 1.0) - 1.0)
  assert f_mean(8.0) == pytest.approx((2.0 + piece_1_2 + 6.0 + 16.0) / 8.0)  # tail constant 4
  # Constant noise: no interior optimum (x* = inf); a power law below 1/2 matches the closed form.
  flat = noise_stats.design_table(
      6.84, grid, (2.0, 2.0, 2.0, 2.0),
      design.PowerLawFit(alpha=0.0, tau=math.nan, r2=1.0, num_points=3))
  assert flat[0]["measured_max"]["x_star"] == "inf" and flat[0]["power_law"]["x_star"] is None
  alpha = 0.2
  fit = design.PowerLawFit(alpha=alpha, tau=1.0, r2=1.0, num_points=3)
  big = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
  rows = noise_stats.design_table(6.84, (0,) + big, [1.0] + [x ** (2 * alpha) for x in big], fit)
  for row in rows:
    x_c, y_c = design.power_law_design(6.84, row["rho"], alpha)
    assert row["power_law"]["x_star"] == pytest.approx(x_c)
    if x_c >= 1.0:  # rho = 0.1: x* = 4.8, where the measured curve is the power law itself
      assert row["measured_max"]["x_star"] == pytest.approx(x_c, rel=1e-5)
      assert row["measured_max"]["y_star"] == pytest.approx(y_c, rel=1e-5)
    else:  # rho = 1: x* = 0.97 < s_1, where the curve is flat at sigma^2(0): the kink at s_1 wins
      assert row["measured_max"]["x_star"] == pytest.approx(1.0, rel=1e-5)
