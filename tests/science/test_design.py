"""Theorem 4.5's optimal design (`science.design`): the closed form against numeric and brute-force
optima, its limits and monotonicity, bad inputs, and the power-law noise fit."""
import math

import numpy as np
import pytest

from jaxreplay.science import design

FIG6 = [(mu, rho, alpha) for mu in (1.0, 2.5, 5.28, 6.84, 10.0) for rho in (0.1, 1.0)
        for alpha in (0.1, 0.2)]


def _power_sigma2(alpha, tau=1.0):
  return lambda x: (x / tau) ** (2 * alpha)


@pytest.mark.parametrize("mu,rho,alpha", FIG6 + [(0.5, 0.5, 0.3), (20.0, 0.02, 0.05),
                                                 (3.0, 0.0, 0.25), (6.84, 0.3, 0.45)])
def test_numeric_optimum_matches_power_law_closed_form(mu, rho, alpha):
  x_c, y_c = design.power_law_design(mu, rho, alpha)
  for tau in (1.0, 37.0):  # tau scales the objective only: it cancels from the argmin
    x_n, y_n = design.optimal_design(mu, rho, _power_sigma2(alpha, tau))
    assert x_n == pytest.approx(x_c, rel=1e-4)
    assert y_n == pytest.approx(y_c, rel=1e-4)
  # App. 9.3.2 as printed in the paper (the code uses a rationalised, rho = 0-safe form).
  if rho > 0:
    y_paper = (-alpha + math.sqrt(alpha ** 2 + mu * rho * (1 - 2 * alpha))) / rho
    assert y_c == pytest.approx(y_paper, rel=1e-12)
  assert x_c == pytest.approx(y_c ** 2 / (2 * alpha * (mu + y_c)), rel=1e-12)
  # Consistency with Theorem 4.5's y* = sqrt(mu / (rho + 1/x*)).
  assert y_c == pytest.approx(math.sqrt(mu / (rho + 1 / x_c)), rel=1e-12)
  assert design.optimal_y(x_c, mu, rho) == pytest.approx(y_c, rel=1e-12)


def test_power_law_rho_to_zero_limit():
  for mu, alpha in [(1.0, 0.1), (6.84, 0.2), (10.0, 0.3)]:
    x0, y0 = design.power_law_design(mu, 0.0, alpha)
    assert y0 == pytest.approx(mu * (1 - 2 * alpha) / (2 * alpha), rel=1e-12)
    assert x0 == pytest.approx(mu * (1 - 2 * alpha) ** 2 / (4 * alpha ** 2), rel=1e-12)
    x, y = design.power_law_design(mu, 1e-9, alpha)
    assert (x, y) == pytest.approx((x0, y0), rel=1e-6)


def test_y_star_is_brute_force_argmin_of_cost_times_variance():
  # Independent of the theorem's algebra: c = B + mu*R, V = sigma_bar^2(N/R) (1/B + 1/N + rho/R).
  R = 1000.0
  B = np.linspace(1.0, 100_000.0, 2_000_000)
  for mu, rho, x in [(6.84, 0.1, 4.0), (1.0, 1.0, 0.7), (10.0, 0.0, 25.0), (5.28, 0.5, 15.0)]:
    N = x * R
    sigma2 = _power_sigma2(0.2, 3.0)
    cv = (B + mu * R) * sigma2(N / R) * (1 / B + 1 / N + rho / R)
    y_brute = B[np.argmin(cv)] / R
    assert design.optimal_y(x, mu, rho) == pytest.approx(y_brute, rel=1e-3)
    # ... and the minimum over B is mu times Theorem 4.5's objective.
    assert cv.min() == pytest.approx(mu * design.bound_ratio_objective(x, mu, rho, sigma2),
                                     rel=1e-6)


def test_design_is_brute_force_argmin_over_x_and_y():
  # A 2-D grid over (x, y) of cost x variance per R (R cancels) recovers the closed form.
  mu, rho, alpha = 6.84, 0.1, 0.2
  x = np.exp(np.linspace(np.log(0.1), np.log(1000.0), 1501))[:, None]
  y = np.exp(np.linspace(np.log(0.1), np.log(1000.0), 1501))[None, :]
  cv = (y + mu) * x ** (2 * alpha) * (1 / y + 1 / x + rho)
  i, j = np.unravel_index(np.argmin(cv), cv.shape)
  x_c, y_c = design.power_law_design(mu, rho, alpha)
  assert x[i, 0] == pytest.approx(x_c, rel=0.01)
  assert y[0, j] == pytest.approx(y_c, rel=0.01)


def test_optimum_moves_to_more_replay_as_mu_grows():
  mus = np.linspace(1.0, 10.0, 10)
  def bump(x):  # non-decreasing, not a power law: the numeric path only
    return 1.0 + (x / 10.0) ** 2
  for rho in (0.1, 1.0):
    for sigma2 in [_power_sigma2(0.1), _power_sigma2(0.2), bump]:
      designs = np.array([design.optimal_design(float(mu), rho, sigma2) for mu in mus])
      assert np.all(np.diff(designs[:, 0]) > 0), designs  # x* = N/R grows
      assert np.all(np.diff(designs[:, 1]) > 0), designs  # y* = B/R (the replay ratio) grows
    closed = np.array([design.power_law_design(float(mu), rho, 0.2) for mu in mus])
    assert np.all(np.diff(closed, axis=0) > 0)


def test_optimal_design_global_minimum_and_boundaries():
  # sigma2 with two steps: the objective has two interior local minima (just before each step);
  # the grid scan must find the global one, as a dense brute force does.
  def steps(x):
    return (1.0 + 0.3 / (1.0 + math.exp(-8.0 * (math.log(x) - math.log(0.5))))
            + 50.0 / (1.0 + math.exp(-8.0 * (math.log(x) - math.log(40.0)))))
  mu, rho = 6.84, 0.1
  xs = np.exp(np.linspace(np.log(1e-3), np.log(1e4), 400_001))
  f = design.bound_ratio_objective(xs, mu, rho, steps)
  x_n, y_n = design.optimal_design(mu, rho, steps)
  assert x_n == pytest.approx(xs[np.argmin(f)], rel=1e-3)
  assert x_n > 5.0  # the global minimum is before the big step, not before the small one
  assert y_n == pytest.approx(math.sqrt(mu / (rho + 1 / x_n)))
  # Constant sigma: the objective decreases in x, so x* -> inf and y* -> sqrt(mu / rho).
  assert design.optimal_design(mu, rho, lambda x: 2.0) == (math.inf, math.sqrt(mu / rho))
  assert design.optimal_design(mu, 0.0, lambda x: 2.0) == (math.inf, math.inf)
  # sigma growing at least as fast as sqrt(x) (alpha >= 1/2): x* -> 0, y* -> 0.
  assert design.optimal_design(mu, rho, _power_sigma2(0.6)) == (0.0, 0.0)
  # The objective accepts arrays and returns their shape.
  assert design.bound_ratio_objective(np.ones((2, 3)), mu, rho, steps).shape == (2, 3)


def test_theorem45_bad_inputs_raise():
  s2 = _power_sigma2(0.2)
  for fn in (lambda mu: design.optimal_design(mu, 0.1, s2),
             lambda mu: design.power_law_design(mu, 0.1, 0.2),
             lambda mu: design.bound_ratio_objective(1.0, mu, 0.1, s2)):
    for mu in (0.0, -1.0, float("nan"), float("inf")):
      with pytest.raises(ValueError, match="mu=.*must be a finite number > 0"):
        fn(mu)
  for rho in (-0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"rho=.*in \[0, 1\]"):
      design.power_law_design(6.84, rho, 0.2)
  for alpha in (0.0, -0.1, 0.5, 0.7):
    with pytest.raises(ValueError, match=r"alpha=.*\(0, 1/2\).*optimal_design"):
      design.power_law_design(6.84, 0.1, alpha)
  with pytest.raises(ValueError, match="x = N/R must be > 0"):
    design.bound_ratio_objective(np.array([1.0, 0.0]), 6.84, 0.1, s2)
  with pytest.raises(ValueError, match="x = N/R must be > 0"):
    design.optimal_y(-1.0, 6.84, 0.1)
  with pytest.raises(ValueError, match="sigma2"):
    design.optimal_design(6.84, 0.1, lambda x: -1.0)
  with pytest.raises(ValueError, match="x_min < x_max"):
    design.optimal_design(6.84, 0.1, s2, x_min=10.0, x_max=1.0)


def test_fit_power_law_noise_recovers_alpha_tau():
  x = np.arange(1, 65, dtype=np.float64)
  alpha, tau = 0.15, 3.0
  sigma = (x / tau) ** alpha
  exact = design.fit_power_law_noise(x, sigma)
  assert (exact.alpha, exact.tau) == pytest.approx((alpha, tau), rel=1e-9)
  assert exact.r2 == pytest.approx(1.0) and exact.num_points == 64
  assert exact.sigma(6.0) == pytest.approx((6.0 / tau) ** alpha)
  assert exact.sigma2(6.0) == pytest.approx((6.0 / tau) ** (2 * alpha))
  var = design.fit_power_law_noise(x, sigma ** 2, variance=True)
  assert (var.alpha, var.tau) == pytest.approx((alpha, tau), rel=1e-9)
  # Noisy measurements (5% multiplicative noise, 20 repeats per staleness).
  rng = np.random.default_rng(0)
  xs = np.repeat(x, 20)
  noisy = (xs / tau) ** alpha * np.exp(0.05 * rng.standard_normal(xs.size))
  fit = design.fit_power_law_noise(xs, noisy)
  assert fit.alpha == pytest.approx(alpha, abs=0.01)
  assert fit.tau == pytest.approx(tau, rel=0.15)
  assert 0.8 < fit.r2 < 1.0
  # Weights act as repeat counts.
  w = rng.integers(1, 5, x.size)
  weighted = design.fit_power_law_noise(x, noisy[::20], weights=w)
  repeated = design.fit_power_law_noise(np.repeat(x, w), np.repeat(noisy[::20], w))
  assert (weighted.alpha, weighted.tau, weighted.r2) == pytest.approx(
      (repeated.alpha, repeated.tau, repeated.r2), rel=1e-9)
  # The fit feeds the design: the same x* as the closed form at the fitted alpha.
  assert design.optimal_design(6.84, 0.1, fit.sigma2)[0] == pytest.approx(
      design.power_law_design(6.84, 0.1, fit.alpha)[0], rel=1e-4)


def test_fit_power_law_noise_bad_inputs():
  with pytest.raises(ValueError, match="staleness-0"):
    design.fit_power_law_noise([0, 1, 2], [1.0, 1.1, 1.2])
  with pytest.raises(ValueError, match="noise must be finite and > 0"):
    design.fit_power_law_noise([1, 2], [1.0, 0.0])
  with pytest.raises(ValueError, match="same length"):
    design.fit_power_law_noise([1, 2, 3], [1.0, 1.1])
  with pytest.raises(ValueError, match="2 distinct staleness"):
    design.fit_power_law_noise([2, 2, 2], [1.0, 1.1, 1.2])
  with pytest.raises(ValueError, match="at least 2"):
    design.fit_power_law_noise([2], [1.0])
  with pytest.raises(ValueError, match="weights"):
    design.fit_power_law_noise([1, 2], [1.0, 1.1], weights=[-1, 1])
