"""Theorem 4.5 of arXiv 2604.08706: the optimal synchronous design (PAPER.md, "Theory (Section 4,
Appendix 9)").

Synchronous setting: each step generates R rollouts with the current policy into a FIFO buffer of
N rollouts, then samples a minibatch of B of them. Ratios only: x = N/R (buffer length in steps of
generation, i.e. the largest staleness in the FIFO) and y = B/R. Host-side numpy, not JAX.

  optimal_design(mu, rho, sigma2)   numeric argmin of the bound over x, then y* (any sigma(x))
  power_law_design(mu, rho, alpha)  the closed form of App. 9.3.2 for sigma(x) = (x/tau)^alpha
  fit_power_law_noise(...)          sigma(x) fitted to measured gradient noise (the noise probe)
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

# The numeric search of `optimal_design` scans log x over [X_SEARCH_MIN, X_SEARCH_MAX].
X_SEARCH_MIN, X_SEARCH_MAX = 1e-8, 1e12


def _check_mu_rho(mu: float, rho: float) -> None:
  if not (isinstance(mu, numbers.Real) and math.isfinite(mu) and mu > 0):
    raise ValueError(f"mu={mu!r} must be a finite number > 0: the generation / training cost ratio "
                     "of one update (e.g. the paper's 6.84 for Qwen3-0.6B)")
  if not (isinstance(rho, numbers.Real) and math.isfinite(rho) and 0 <= rho <= 1):
    raise ValueError(f"rho={rho!r} must be in [0, 1] (the paper's correlation constant); use "
                     "rho=0 for uncorrelated replayed samples")


def _call_sigma2(sigma2: Callable[[float], float], x: float) -> float:
  try:
    return float(sigma2(x))
  except OverflowError:  # e.g. exp(x) at the top of the search range: treat as +inf
    return math.inf


def bound_ratio_objective(x, mu: float, rho: float, sigma2: Callable[[float], float]):
  """Theorem 4.5's objective in x = N/R: sigma_bar^2(x) * (sqrt(1/mu) + sqrt(rho + 1/x))^2.

  Source: arXiv 2604.08706, Theorem 4.5 (PAPER.md, "Theory"). It is min over y = B/R of the cost
  per update times Theorem 4.4's variance term, divided by mu R (see `optimal_design`):
    min_y (B + mu R) * V / (mu R) = sigma_bar^2(x) * (sqrt(1/mu) + sqrt(rho + 1/x))^2.

  Args:
    x: N/R > 0, a float or an array of any shape (dimensionless; steps of generation in the buffer).
    mu: generation cost of one rollout / training cost of one rollout, > 0 (dimensionless).
    rho: correlation constant of replayed samples, in [0, 1].
    sigma2: x -> sigma_bar^2(x), the gradient-noise variance bound at staleness up to x; called on
      one float at a time; must be non-decreasing and return values >= 0.

  Returns:
    The objective, a float (x scalar) or an array of x's shape, in sigma2's units (squared
    gradient norm) per (training cost of one rollout).
  """
  _check_mu_rho(mu, rho)
  xs = np.asarray(x, dtype=np.float64)
  if not np.all(xs > 0):
    raise ValueError(f"x = N/R must be > 0, got min {xs.min()!r}")
  s2 = np.array([_call_sigma2(sigma2, float(v)) for v in xs.ravel()]).reshape(xs.shape)
  if np.any(np.isnan(s2)) or np.any(s2 < 0):
    raise ValueError("sigma2(x) must return values >= 0 (a variance), got NaN or negative values "
                     f"at x = {xs[np.isnan(s2) | (s2 < 0)].ravel()[:3]}")
  with np.errstate(over="ignore"):
    out = s2 * (math.sqrt(1.0 / mu) + np.sqrt(rho + 1.0 / xs)) ** 2
  return float(out) if out.ndim == 0 else out


def optimal_y(x: float, mu: float, rho: float) -> float:
  """y = B/R minimising cost x variance at fixed x = N/R: sqrt(mu / (rho + 1/x)) (Theorem 4.5).

  Derivation (large budget, ratios only). The cost of one update is c = B + mu R (training on B
  rollouts + generating R, in units of training one rollout). Theorem 4.4 bounds the average
  squared gradient norm by 12 F0/(eta T) + 8 eta (4 N^2 kappa^2 eta / R^2 + L) V with
  V = sigma_bar^2(N/R) (1/B + 1/N + rho/R). With a budget C, T = C / c steps; as C -> inf the optimal
  eta -> 0, the eta^2 term vanishes, and the bound -> 2 sqrt(96 F0 L V c / C): minimise c V.
  With B = yR, N = xR and a = rho + 1/x,
    c V = sigma_bar^2(x) (y + mu)(1/y + a) = sigma_bar^2(x) (1 + a mu + a y + mu/y),
  whose derivative in y, a - mu/y^2, vanishes at y = sqrt(mu/a) (the square root of the paper),
  where c V = sigma_bar^2(x) (1 + sqrt(a mu))^2 = mu * sigma_bar^2(x) (sqrt(1/mu) + sqrt(a))^2,
  i.e. mu times `bound_ratio_objective`; minimising it over x gives x*.

  Args:
    x: N/R, > 0, or math.inf (then a = rho).
    mu: > 0. rho: in [0, 1].

  Returns:
    y = B/R (dimensionless); math.inf when x = inf and rho = 0.
  """
  _check_mu_rho(mu, rho)
  if not x > 0:
    raise ValueError(f"x = N/R must be > 0, got {x!r}")
  a = rho + 1.0 / x
  return math.inf if a == 0 else math.sqrt(mu / a)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-12) -> float:
  """Argmin of a unimodal f on [lo, hi] by golden-section search (to |hi - lo| <= tol)."""
  g = (math.sqrt(5.0) - 1.0) / 2.0
  c, d = hi - g * (hi - lo), lo + g * (hi - lo)
  fc, fd = f(c), f(d)
  while hi - lo > tol:
    if fc <= fd:
      hi, d, fd = d, c, fc
      c = hi - g * (hi - lo)
      fc = f(c)
    else:
      lo, c, fc = c, d, fd
      d = lo + g * (hi - lo)
      fd = f(d)
  return (lo + hi) / 2.0


def optimal_design(mu: float, rho: float, sigma2: Callable[[float], float], *,
                   x_min: float = X_SEARCH_MIN, x_max: float = X_SEARCH_MAX,
                   points_per_decade: int = 40) -> tuple[float, float]:
  """Theorem 4.5's optimal synchronous design, numerically: (x*, y*) = (N/R, B/R).

    x* = argmin_{x > 0} sigma_bar^2(x) (sqrt(1/mu) + sqrt(rho + 1/x))^2,
    y* = sqrt(mu / (rho + 1/x*))                (derivation: `optimal_y`).
  Source: arXiv 2604.08706, Theorem 4.5 and App. 9 (PAPER.md, "Theory").

  Method: the objective is evaluated on a grid of `points_per_decade` points per decade of
  log x over [x_min, x_max] (so a non-convex sigma2 with several local minima is handled), then
  refined by golden-section search on log x between the grid neighbours of the best grid point
  (relative precision on x* ~1e-8, limited by the flatness of the objective at its minimum).

  Boundaries. When the objective is still decreasing at x_max (to 1e-12 relative), e.g. sigma
  constant: the objective sigma^2 (sqrt(1/mu) + sqrt(rho + 1/x))^2 decreases to its infimum as
  x -> inf, the buffer should be as long as possible and x* = math.inf is returned with
  y* = sqrt(mu / rho) (math.inf when rho = 0). When the minimum is at x_min (sigma2 growing faster
  than x near 0, e.g. a power law with alpha >= 1/2), x* = 0.0 and y* = 0.0 are returned. A caller
  should treat both as "no interior optimum": the design is then set by other constraints.

  Args:
    mu: generation / training cost of one rollout, > 0 (dimensionless).
    rho: correlation constant of replayed samples, in [0, 1].
    sigma2: x -> sigma_bar^2(x) >= 0, non-decreasing (called on one float at a time).
    x_min, x_max: the search range of x = N/R, 0 < x_min < x_max.
    points_per_decade: grid density of the global scan.

  Returns:
    (x_star, y_star): N/R and B/R, floats (dimensionless); see Boundaries for 0 and inf.
  """
  _check_mu_rho(mu, rho)
  if not 0 < x_min < x_max < math.inf:
    raise ValueError(f"need 0 < x_min < x_max < inf, got x_min={x_min}, x_max={x_max}")
  if points_per_decade < 2:
    raise ValueError(f"points_per_decade={points_per_decade} must be >= 2")
  lo, hi = math.log(x_min), math.log(x_max)
  n = max(3, math.ceil(points_per_decade * math.log10(x_max / x_min)) + 1)
  u = np.linspace(lo, hi, n)
  f = np.asarray(bound_ratio_objective(np.exp(u), mu, rho, sigma2))
  if not np.any(np.isfinite(f)):
    raise ValueError("the objective is not finite anywhere on the search range; check sigma2")
  f = np.where(np.isfinite(f), f, np.inf)
  f_min = float(f.min())
  near = np.flatnonzero(f <= f_min * (1.0 + 1e-12))
  if near[-1] == n - 1:  # still decreasing (or flat) at x_max: the optimum is x -> inf.
    return math.inf, optimal_y(math.inf, mu, rho)
  i = int(near[0])
  if i == 0:  # smallest at x_min: the optimum is x -> 0 (and then y* = sqrt(mu x) -> 0).
    return 0.0, 0.0

  def log_objective(v: float) -> float:
    val = bound_ratio_objective(math.exp(v), mu, rho, sigma2)
    return math.log(val) if val > 0 else -math.inf

  u_star = _golden_min(log_objective, float(u[i - 1]), float(u[i + 1]))
  x_star = math.exp(u_star)
  return x_star, optimal_y(x_star, mu, rho)


def power_law_design(mu: float, rho: float, alpha: float) -> tuple[float, float]:
  """Closed-form Theorem 4.5 design for sigma(x) = (x/tau)^alpha, 0 < alpha < 1/2 (App. 9.3.2).

    y* = (-alpha + sqrt(alpha^2 + mu rho (1 - 2 alpha))) / rho,
    x* = y*^2 / (2 alpha (mu + y*)).
  Source: arXiv 2604.08706, App. 9.3.2 (PAPER.md, "Theory"). Here sigma_bar^2(x) = sigma^2(x) =
  (x/tau)^(2 alpha); tau only scales the objective, so it cancels from the argmin (and a constant
  factor, e.g. sigma_bar^2 as the mean of sigma^2 over staleness 0..x, changes nothing either).
  Derivation: setting d/dx log of x^(2 alpha) (mu^-1/2 + s)^2, s = sqrt(rho + 1/x), to zero gives
  2 alpha x s (mu^-1/2 + s) = 1; with s = sqrt(mu)/y this is x = y^2 / (2 alpha (mu + y)), and
  substituting 1/x = mu/y^2 - rho gives rho y^2 + 2 alpha y - mu (1 - 2 alpha) = 0.
  y* is computed in the equivalent rationalised form mu (1 - 2 alpha) / (alpha + sqrt(alpha^2 +
  mu rho (1 - 2 alpha))), which is exact at rho = 0, the limit rho -> 0:
  y* = mu (1 - 2 alpha) / (2 alpha), x* = y*^2 / mu = mu (1 - 2 alpha)^2 / (4 alpha^2).

  Args:
    mu: generation / training cost of one rollout, > 0.
    rho: correlation constant, in [0, 1].
    alpha: growth exponent of the gradient-noise std with staleness, in (0, 1/2).

  Returns:
    (x_star, y_star) = (N/R, B/R), dimensionless floats.
  """
  _check_mu_rho(mu, rho)
  if not (isinstance(alpha, numbers.Real) and 0 < alpha < 0.5):
    raise ValueError(
        f"alpha={alpha!r} must be in (0, 1/2): at alpha <= 0 (constant noise) the optimum is "
        "x* -> inf and at alpha >= 1/2 it is x* -> 0; use optimal_design(mu, rho, sigma2) for those")
  y = mu * (1.0 - 2.0 * alpha) / (alpha + math.sqrt(alpha ** 2 + mu * rho * (1.0 - 2.0 * alpha)))
  x = y ** 2 / (2.0 * alpha * (mu + y))
  return x, y


@dataclasses.dataclass(frozen=True)
class PowerLawFit:
  """sigma(x) = (x/tau)^alpha fitted to (staleness, gradient-noise std) pairs.

  Attributes:
    alpha: exponent (dimensionless).
    tau: staleness (in steps) at which sigma = 1 in the measurement's units; nan when alpha = 0.
    r2: coefficient of determination of the fit in log space (log sigma against log staleness).
    num_points: number of pairs used.
  """
  alpha: float
  tau: float
  r2: float
  num_points: int

  def sigma(self, x):
    """sigma(x) = (x/tau)^alpha, x in steps (float or array)."""
    return (np.asarray(x, dtype=np.float64) / self.tau) ** self.alpha

  def sigma2(self, x):
    """sigma_bar^2(x) = (x/tau)^(2 alpha): pass to `optimal_design`."""
    return self.sigma(x) ** 2


def fit_power_law_noise(staleness: Sequence[float], noise: Sequence[float], *,
                        variance: bool = False,
                        weights: Sequence[float] | None = None) -> PowerLawFit:
  """Least-squares fit of sigma(x) = (x/tau)^alpha in log space, for Theorem 4.5's App. 9.3.2.

  log sigma = alpha log x - alpha log tau is a line in log x: ordinary (or weighted) least squares
  gives slope alpha and intercept b, then tau = exp(-b / alpha); R^2 = 1 - SS_res / SS_tot in log
  space. Source of the model: arXiv 2604.08706, App. 9.3.2 (PAPER.md, "Theory").

  Args:
    staleness: [n] staleness x > 0 of each measurement, in steps (drop staleness-0 points, or
      measure at x + 1 consistently, since log 0 is undefined).
    noise: [n] measured gradient-noise std sigma > 0 (e.g. ||g_stale - g_fresh|| or the std of
      per-batch gradients, in gradient-norm units), or its variance when `variance` is True.
    variance: noise holds sigma^2 (then log sigma = log(noise) / 2).
    weights: optional [n] non-negative weights of the least squares (e.g. counts per bin).

  Returns:
    A `PowerLawFit`. alpha is not restricted here: check 0 < alpha < 1/2 before `power_law_design`.
  """
  x = np.asarray(staleness, dtype=np.float64).ravel()
  s = np.asarray(noise, dtype=np.float64).ravel()
  if x.shape != s.shape:
    raise ValueError(f"staleness and noise need the same length, got {x.size} and {s.size}")
  if x.size < 2:
    raise ValueError(f"need at least 2 (staleness, noise) pairs, got {x.size}")
  if not (np.all(np.isfinite(x)) and np.all(x > 0)):
    raise ValueError("staleness must be finite and > 0: drop staleness-0 points or use staleness + 1")
  if not (np.all(np.isfinite(s)) and np.all(s > 0)):
    raise ValueError("noise must be finite and > 0 (a std, or a variance with variance=True)")
  w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
  if w.shape != x.shape or not np.all(w >= 0) or not w.sum() > 0:
    raise ValueError("weights must be [n] non-negative numbers with a positive sum")
  lx, ls = np.log(x), np.log(s) / (2.0 if variance else 1.0)
  mx, ms = np.average(lx, weights=w), np.average(ls, weights=w)
  sxx = float(np.sum(w * (lx - mx) ** 2))
  if sxx <= 0:
    raise ValueError("all staleness values are equal: measure at least 2 distinct staleness values")
  alpha = float(np.sum(w * (lx - mx) * (ls - ms)) / sxx)
  b = ms - alpha * mx
  ss_res = float(np.sum(w * (ls - (alpha * lx + b)) ** 2))
  ss_tot = float(np.sum(w * (ls - ms) ** 2))
  r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
  tau = math.exp(-b / alpha) if alpha != 0 else math.nan
  return PowerLawFit(alpha=alpha, tau=tau, r2=r2, num_points=int(x.size))
