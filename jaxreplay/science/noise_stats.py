"""Statistics of the gradient-noise probe (`jaxreplay.science.noise_probe`): pure numpy, no JAX.

Every estimate comes from Gram matrices of flattened minibatch gradients (float64):
  var_B      = 1/(n-1) sum_b ||g_b - g_bar||^2   unbiased variance of a B-rollout minibatch
               gradient (`variance_from_gram`); sigma^2 = B * var_B per rollout;
  bias^2     = ||d_bar||^2 - var(d_b) / n          unbiased squared distance of two expected
               gradients from n paired differences d_b (`bias_sq_from_gram`);
  intervals  percentile bootstrap over minibatches (`estimate_layout`, `percentile_interval`);
  fits       sigma(s) = (s/tau)^alpha by `design.fit_power_law_noise` on s >= 1
             (`fit_power_law_s_ge_1`, overflow-safe through `fit_power_law`);
  design     Theorem 4.5's (x*, y*) = (N/R, B/R) on the fit and on the measured curve
             (`measured_sigma2`, `design_table`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxreplay.science import design

RHOS = (0.1, 1.0)
GRAM_CHUNK = 1 << 16                # parameter columns per float64 block of a Gram matrix


# ---- estimators (numpy, exact from Gram matrices) ------------------------------------------------

def gram(a: np.ndarray, b: Optional[np.ndarray] = None, chunk: int = GRAM_CHUNK) -> np.ndarray:
  """Inner products <a_i, b_j> in float64, accumulated over blocks of columns.

  Args:
    a: [n, P] vectors (e.g. flattened minibatch gradients, float32).
    b: [m, P] vectors, or None for b = a.
    chunk: columns per float64 block (bounds the float64 copy at n * chunk values).
  Returns:
    float64 [n, m].
  """
  b = a if b is None else b
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f"need [n, P] and [m, P] arrays, got {a.shape} and {b.shape}")
  out = np.zeros((a.shape[0], b.shape[0]), np.float64)
  for j in range(0, a.shape[1], chunk):
    x = a[:, j:j + chunk].astype(np.float64)
    y = x if b is a else b[:, j:j + chunk].astype(np.float64)
    out += x @ y.T
  return out


def _take(g: np.ndarray, idx: Optional[np.ndarray]) -> np.ndarray:
  return g if idx is None else g[np.ix_(idx, idx)]


def variance_from_gram(g: np.ndarray, idx: Optional[np.ndarray] = None) -> float:
  """Unbiased total variance 1/(n-1) sum_i ||v_i - v_bar||^2 of n vectors from their Gram matrix.

  sum_i ||v_i - v_bar||^2 = tr(K) - sum(K) / n, with K = [<v_i, v_j>].

  Args:
    g: float [n, n] Gram matrix of the vectors v_1..v_n.
    idx: optional [k] indices (with repeats: a bootstrap resample) of the vectors to use.
  Returns:
    The variance, in the squared units of the vectors (a float; 0 if fewer than 2 vectors).
  """
  k = _take(np.asarray(g, np.float64), idx)
  n = k.shape[0]
  if n < 2:
    return 0.0
  return float((np.trace(k) - k.sum() / n) / (n - 1))


def mean_sq_norm_from_gram(g: np.ndarray, idx: Optional[np.ndarray] = None) -> float:
  """||v_bar||^2 = sum(K) / n^2 for the Gram matrix K of n vectors (optionally resampled by idx)."""
  k = _take(np.asarray(g, np.float64), idx)
  return float(k.sum() / k.shape[0] ** 2)


def paired_difference_gram(g_ss: np.ndarray, g_s0: np.ndarray, g_00: np.ndarray) -> np.ndarray:
  """Gram matrix of d_i = u_i - v_i from those of u (g_ss), v (g_00) and <u_i, v_j> (g_s0)."""
  return g_ss - g_s0 - g_s0.T + g_00


def bias_sq_from_gram(d_gram: np.ndarray, idx: Optional[np.ndarray] = None) -> tuple[float, float]:
  """Squared distance of two expected gradients from n paired differences d_i (their Gram matrix).

  Returns:
    (raw, debiased): raw = ||d_bar||^2; debiased = ||d_bar||^2 - var(d) / n, unbiased for
    ||E d||^2 when the pairs are i.i.d. (it can be negative when the true distance is small).
  """
  k = _take(np.asarray(d_gram, np.float64), idx)
  n = k.shape[0]
  raw = float(k.sum() / n ** 2)
  return raw, raw - variance_from_gram(k) / n


def minibatch_gradient_noise(grads: np.ndarray, batch_size: int) -> dict[str, float]:
  """Gradient-noise estimates from n independent minibatch gradients of B rollouts each.

  Args:
    grads: [n, P] flattened minibatch gradients (n >= 2).
    batch_size: B, rollouts per minibatch.
  Returns:
    {"var_minibatch": 1/(n-1) sum ||g_b - g_bar||^2 (squared gradient norm at batch size B),
     "sigma2": B * var_minibatch (per rollout), "mean_sq_norm": ||g_bar||^2}.
  """
  k = gram(np.asarray(grads))
  v = variance_from_gram(k)
  return {"var_minibatch": v, "sigma2": batch_size * v, "mean_sq_norm": mean_sq_norm_from_gram(k)}


def percentile_interval(samples: Sequence[float], level: float = 0.95) -> tuple[float, float]:
  """(low, high) percentile interval of bootstrap replicates (NaNs dropped; NaN if none)."""
  s = np.asarray(samples, np.float64)
  s = s[np.isfinite(s)]
  if s.size == 0:
    return math.nan, math.nan
  q = (1.0 - level) / 2.0
  return float(np.quantile(s, q)), float(np.quantile(s, 1.0 - q))


# ---- measured sigma_bar^2(x) for optimal_design ---------------------------------------------------

def _power_segment_integral(a: float, va: float, k: float, x: float) -> float:
  """Integral over [a, x] of va (t / a)^k dt (a > 0)."""
  if abs(k + 1.0) < 1e-12:
    return va * a * math.log(x / a)
  return va * a / (k + 1.0) * ((x / a) ** (k + 1.0) - 1.0)


def measured_sigma2(staleness: Sequence[float], sigma2: Sequence[float], tail_alpha: float,
                    kind: str = "max") -> Callable[[float], float]:
  """x -> sigma_bar^2(x) from measurements at staleness s_0 = 0 < s_1 < ... < s_max.

  The curve: linear between s_0 = 0 and s_1; between positive grid points a power law through the
  two neighbours (linear in log-log, so a measured power law is reproduced exactly); beyond s_max
  sigma^2(s_max) (x / s_max)^(2 max(tail_alpha, 0)), the tail of the fitted exponent.
    kind="max":  the knots are first replaced by their running maximum, so the curve is
                 non-decreasing (the bound of the theory's assumption E||eps||^2 <= sigma^2(x)
                 with sigma non-decreasing);
    kind="mean": the mean of the (raw) curve over staleness in [0, x] (a sample drawn from a
                 FIFO holding x steps of generation has uniform staleness in [0, x]).

  Args:
    staleness: [k] grid, increasing, starting at 0 (steps). sigma2: [k] measured sigma^2 >= 0
      (values at s >= s_1 are floored at 1e-300 for the log-log pieces).
    tail_alpha: exponent of sigma (not sigma^2) beyond the grid.
    kind: "max" or "mean".
  Returns:
    A function of one float x >= 0 (steps) returning a float (sigma2's units).
  """
  s = np.asarray(staleness, np.float64)
  v = np.asarray(sigma2, np.float64)
  if s.ndim != 1 or s.shape != v.shape or s.size < 2 or s[0] != 0 or np.any(np.diff(s) <= 0):
    raise ValueError(f"need an increasing staleness grid from 0 with >= 2 points, got {s}")
  if kind not in ("max", "mean"):
    raise ValueError(f"kind={kind!r}: expected 'max' or 'mean'")
  v = np.maximum(v, 0.0)
  v[1:] = np.maximum(v[1:], 1e-300)
  if kind == "max":
    v = np.maximum.accumulate(v)
  tail_k = 2.0 * max(float(tail_alpha), 0.0)
  # Exponent of each piece [s_i, s_{i+1}] for i >= 1, then the tail's.
  ks = [math.log(v[i + 1] / v[i]) / math.log(s[i + 1] / s[i]) for i in range(1, s.size - 1)]
  ks.append(tail_k)
  cum = [0.0, (v[0] + v[1]) / 2.0 * s[1]]   # integral from 0 to each knot
  for i in range(1, s.size - 1):
    cum.append(cum[-1] + _power_segment_integral(s[i], v[i], ks[i - 1], s[i + 1]))

  def piece(x: float) -> int:
    """i with s_i <= x < s_{i+1} (the last knot for x >= s_max)."""
    return min(int(np.searchsorted(s, x, side="right")) - 1, s.size - 1)

  def curve(x: float) -> float:
    if x <= s[1]:
      return float(v[0] + (v[1] - v[0]) * x / s[1])
    i = piece(x)
    return float(v[i] * (x / s[i]) ** ks[i - 1])

  def integral(x: float) -> float:
    if x <= s[1]:
      return float(x * (v[0] + curve(x)) / 2.0)
    i = piece(x)
    return float(cum[i] + _power_segment_integral(s[i], v[i], ks[i - 1], x))

  if kind == "max":
    return lambda x: curve(float(x))
  return lambda x: (integral(float(x)) / float(x)) if x > 0 else float(v[0])


def finite_or_str(x: Optional[float]) -> Any:
  """JSON-safe numbers: inf / nan as strings."""
  if x is None:
    return None
  x = float(x)
  return x if math.isfinite(x) else str(x)


def design_table(mu: float, staleness: Sequence[float], sigma2: Sequence[float],
                 fit: Optional[design.PowerLawFit], rhos: Sequence[float] = RHOS) -> list[dict]:
  """Theorem 4.5's (x*, y*) = (N/R, B/R) per rho: closed form on the fit, numeric on the curve."""
  alpha = fit.alpha if fit is not None else 0.0
  rows = []
  for rho in rhos:
    row: dict[str, Any] = {"rho": rho, "mu": mu}
    if fit is not None and 0 < fit.alpha < 0.5:
      x, y = design.power_law_design(mu, rho, fit.alpha)
      row["power_law"] = {"x_star": x, "y_star": y}
    else:
      why = "no fit" if fit is None else (
          f"alpha={fit.alpha:.4g} <= 0: constant or decreasing noise, x* -> inf" if fit.alpha <= 0
          else f"alpha={fit.alpha:.4g} >= 1/2: x* -> 0")
      row["power_law"] = {"x_star": None, "y_star": None, "why": why}
    for kind in ("max", "mean"):
      x, y = design.optimal_design(mu, rho, measured_sigma2(staleness, sigma2, alpha, kind))
      inside = 0 < x <= float(staleness[-1])
      row[f"measured_{kind}"] = {"x_star": finite_or_str(x), "y_star": finite_or_str(y),
                                 "within_measured_range": bool(inside)}
    rows.append(row)
  return rows


# ---- fits and bootstrap intervals ---------------------------------------------------------------

def fit_power_law_s_ge_1(grid: Sequence[int],
                         sigma2: np.ndarray) -> Optional[design.PowerLawFit]:
  """fit_power_law_noise on the points with staleness >= 1 (None without 2 positive points)."""
  pts = [(s, v) for s, v in zip(grid, sigma2) if s >= 1]
  if len(pts) < 2 or not all(v > 0 for _, v in pts):
    return None
  xs, ys = zip(*pts)
  return fit_power_law(xs, ys)


def fit_power_law(xs: Sequence[float], sigma2: Sequence[float]) -> design.PowerLawFit:
  """`design.fit_power_law_noise(xs, sigma2, variance=True)`; when alpha is so close to 0 that
  its tau = exp(-intercept / alpha) overflows (the library raises OverflowError), the same
  least-squares alpha and R^2 with tau = inf (or 0 when the exponent is very negative)."""
  try:
    return design.fit_power_law_noise(xs, sigma2, variance=True)
  except OverflowError:
    lx, ls = np.log(np.asarray(xs, np.float64)), np.log(np.asarray(sigma2, np.float64)) / 2.0
    alpha, b = np.polyfit(lx, ls, 1)
    resid = ls - (alpha * lx + b)
    ss_tot = float(np.sum((ls - ls.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return design.PowerLawFit(alpha=float(alpha), tau=math.inf if -b / alpha > 0 else 0.0,
                                  r2=r2, num_points=len(lx))


def estimate_layout(grams: dict, cross: dict, grid: Sequence[int], batch_size: int,
                    num_bootstrap: int, rng: np.random.Generator) -> dict:
  """Point estimates and percentile-bootstrap intervals for one minibatch layout.

  Args:
    grams: s -> float64 [n, n] Gram matrix of the n minibatch gradients at staleness s.
    cross: s -> float64 [n, n], <g_b(s), g_b'(0)> (minibatch b at s pairs with b at 0).
    grid: staleness values (steps), starting at 0.
    batch_size: B rollouts per minibatch.
    num_bootstrap: replicates; each resamples minibatch indices once for every s.
  Returns:
    {"var", "sigma2", "ratio", "bias_raw_sq", "bias_sq"}: float arrays [len(grid)];
    {"sigma2_ci", "ratio_ci", "bias_ci"}: lists of [low, high]; "fit" (s >= 1) and "alpha_ci".
    Intervals are percentile intervals of replicates centred on the estimates (see the code: the
    variance replicates are rescaled by n / (n - 1), the debiased bias^2 replicates shifted by
    their mean's offset), and "bias" / "bias_ci" are square roots of bias^2 clipped at 0.
  """
  n = grams[grid[0]].shape[0]
  d_grams = {s: paired_difference_gram(grams[s], cross[s], grams[grid[0]]) for s in grid}

  def point(idx):
    var = np.array([variance_from_gram(grams[s], idx) for s in grid])
    raw, deb = zip(*[bias_sq_from_gram(d_grams[s], idx) for s in grid])
    return var, np.array(raw), np.array(deb)

  var, raw, deb = point(None)
  boot = {"sigma2": [], "ratio": [], "bias_sq": [], "alpha": []}
  for _ in range(num_bootstrap):
    v, _, d = point(rng.integers(0, n, n))
    # A resample's unbiased variance is centred on the plug-in (n-1)/n S^2 of the sample, not on S^2:
    # rescale so that the replicates centre on the estimate (ratios and alpha do not change).
    v = v * n / (n - 1)
    boot["sigma2"].append(batch_size * v)
    boot["ratio"].append(v / v[0] if v[0] > 0 else np.full_like(v, np.nan))
    boot["bias_sq"].append(d)
    f = fit_power_law_s_ge_1(grid, batch_size * v)
    boot["alpha"].append(f.alpha if f is not None else math.nan)
  ci = {k: np.array(v).reshape(num_bootstrap, -1) for k, v in boot.items() if k != "alpha"}
  if num_bootstrap:
    # The debiased bias^2 of a resample is centred on the sample's raw ||d_bar||^2 (the resample's
    # own noise adds what its correction removes): shift the replicates onto the estimate, then
    # take the square root.
    b2 = ci.pop("bias_sq")
    ci["bias"] = np.sqrt(np.maximum(b2 - (b2.mean(axis=0) - deb), 0.0))

  def intervals(key):
    if num_bootstrap == 0:
      return [[math.nan, math.nan] for _ in grid]
    return [list(percentile_interval(ci[key][:, i])) for i in range(len(grid))]

  return {"var": var, "sigma2": batch_size * var,
          "ratio": var / var[0] if var[0] > 0 else np.full_like(var, np.nan),
          "bias_raw_sq": raw, "bias_sq": deb,
          "sigma2_ci": intervals("sigma2"), "ratio_ci": intervals("ratio"),
          "bias_ci": intervals("bias"), "fit": fit_power_law_s_ge_1(grid, batch_size * var),
          "alpha_ci": list(percentile_interval(boot["alpha"]))}
