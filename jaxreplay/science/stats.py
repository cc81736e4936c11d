"""Statistics of a sweep: medians and IQR over seeds on a compute grid, compute to reach a target
accuracy, per-seed paired differences with t intervals. Pure functions over plain data.

A run's curve is the list of its metrics rows at evaluation points (`eval_rows`), each with
`compute_seconds` [device-seconds] and `eval/*` values. Values are read off a curve only between
real evaluation points (linear interpolation), never beyond the first or last one. Missing values
are None; quantiles treat "not reached" as +inf and JSON writes non-finite numbers as null.

Methods (issue 37: fit for 4-8 seeds):
  paired differences   per seed, arm minus its baseline arm at the same seed; "ci95" is the
                       two-sided 95% Student t interval of their mean, mean +- t_{0.975, n-1} *
                       s / sqrt(n) (s: the sample standard deviation, ddof 1; none for n < 2;
                       `t_interval`, t quantiles from the regularized incomplete beta function,
                       `t_quantile`); "ci95_bootstrap" keeps the percentile bootstrap of the mean
                       (10,000 resamples, seed 0) as a secondary number: with 4 seeds it is too
                       narrow (it can only resample the 4 values it has).
  paired ratios        an arm's compute to a target over its baseline's, per seed: the geometric
                       mean, with the t interval of the mean log ratio mapped through exp
                       (`paired_ratio`; a t interval of the raw ratios can go below 0).
  compute to target    per seed, the compute at which the run's pass@1 curve (evaluations on the
                       sweep's dense grid) first reaches the target, linearly interpolated between
                       the two evaluations that bracket it (`compute_to_target`). How much the
                       interpolation could matter is kept beside each ratio: "interp_range", the
                       geometric mean the ratio would have if every crossing lay at the far ends
                       of its two bracketing evaluations (`interp_range`).
  families             each family's best rate, the accuracy targets, compute ratios to the
                       baseline family and frontiers: `jaxreplay.science.families`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

X = "compute_seconds"
PRIMARY = "eval/pass@1"
BOOTSTRAP_RESAMPLES = 10000
BOOTSTRAP_SEED = 0
TARGET_FRACTIONS = (0.5, 0.75, 0.9)
CI_LEVEL = 0.95
MIN_SEEDS = 2        # a rate counts for a family's best and its bracket with this many seeds
FAMILY_TARGETS = 4   # compute-to-target points of the family summaries
TARGET_RULE = ("4 targets equally spaced from the median start pass@1 of every finished run to the "
               "baseline family's median final pass@1 at its best rate: start + i/4 * (final - "
               "start), i = 1..4")

Row = Mapping[str, Any]


def _num(v: Any) -> Optional[float]:
  """A finite float, or None."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  return float(v) if math.isfinite(v) else None


def json_number(v: Optional[float]) -> Optional[float]:
  """None for None, inf and nan (strict JSON); the float otherwise."""
  return None if v is None or not math.isfinite(v) else float(v)


def eval_rows(rows: Sequence[Row], key: str = PRIMARY) -> list[dict]:
  """The rows holding `key` and `compute_seconds`, sorted by compute (a repeated compute keeps the
  last row, as a resumed run rewrites it)."""
  by_x: dict[float, dict] = {}
  for r in rows:
    x, y = _num(r.get(X)), _num(r.get(key))
    if x is not None and y is not None:
      by_x[x] = dict(r)
  return [by_x[x] for x in sorted(by_x)]


def series(curve: Sequence[Row], key: str) -> tuple[np.ndarray, np.ndarray]:
  """float64 ([M], [M]): (compute_seconds, key) over the curve's rows holding both."""
  pts = [(_num(r.get(X)), _num(r.get(key))) for r in curve]
  pts = [(x, y) for x, y in pts if x is not None and y is not None]
  return np.array([p[0] for p in pts], np.float64), np.array([p[1] for p in pts], np.float64)


def interp(xs: np.ndarray, ys: np.ndarray, x: float) -> Optional[float]:
  """y at `x` by linear interpolation between the points (xs ascending); None outside
  [xs[0], xs[-1]] (no extrapolation)."""
  if not len(xs) or x < xs[0] or x > xs[-1]:
    return None
  return float(np.interp(x, xs, ys))


def _crossing(ys: np.ndarray, target: float) -> Optional[int]:
  """The first i with ys[i-1] < target <= ys[i]; None when no pair of points brackets it."""
  for i in range(1, len(ys)):
    if ys[i - 1] < target <= ys[i]:
      return i
  return None


def compute_to_target(xs: np.ndarray, ys: np.ndarray, target: float) -> Optional[float]:
  """The compute at which the curve first reaches `target`: for the first i with
  ys[i-1] < target <= ys[i], the linear interpolation between points i-1 and i. None when no pair
  of real points brackets the target (never reached, or already reached at the first point)."""
  i = _crossing(ys, target)
  if i is None:
    return None
  return float(xs[i - 1] + (target - ys[i - 1]) / (ys[i] - ys[i - 1]) * (xs[i] - xs[i - 1]))


def target_bracket(xs: np.ndarray, ys: np.ndarray, target: float
                   ) -> Optional[tuple[float, float]]:
  """(xs[i-1], xs[i]): the two evaluation points between which `compute_to_target` interpolates,
  the range the crossing could lie in whatever the curve does between them; None when no pair of
  points brackets the target."""
  i = _crossing(ys, target)
  return None if i is None else (float(xs[i - 1]), float(xs[i]))


def interp_range(pairs: Sequence[Optional[tuple[Optional[tuple[float, float]],
                                                Optional[tuple[float, float]]]]]
                 ) -> list[Optional[float]]:
  """The range a geometric mean of per-seed ratios a / b could take if each crossing lay anywhere
  between its bracketing evaluation points: [geomean of a_lo / b_hi, geomean of a_hi / b_lo] over
  the seeds where both brackets exist (`pairs`: per seed (a's bracket, b's bracket) or None)."""
  lo, hi = [], []
  for p in pairs:
    if p is None or p[0] is None or p[1] is None or p[1][0] <= 0:
      continue
    (a_lo, a_hi), (b_lo, b_hi) = p
    lo.append(math.log(a_lo / b_hi) if a_lo > 0 else -math.inf)
    hi.append(math.log(a_hi / b_lo))
  if not lo:
    return [None, None]
  return [json_number(math.exp(float(np.mean(lo)))), json_number(math.exp(float(np.mean(hi))))]


def quantile(values: Sequence[float], q: float) -> float:
  """The q-quantile (numpy's "linear" method) of finite or +inf values; an interpolation that puts
  weight on +inf is +inf (so "not reached" counts as larger than every reached value)."""
  v = sorted(values)
  pos = q * (len(v) - 1)
  lo, hi = int(math.floor(pos)), int(math.ceil(pos))
  frac = pos - lo
  if frac == 0.0:
    return float(v[lo])
  if math.isinf(v[hi]):
    return math.inf
  return float(v[lo] + (v[hi] - v[lo]) * frac)


def quantiles(values: Sequence[Optional[float]], none_is_inf: bool = False) -> dict[str, Any]:
  """{"median", "q25", "q75", "n"} of `values`; None entries are dropped (or, with none_is_inf,
  counted as +inf); "n" counts the finite ones; non-finite results are None."""
  vals = [math.inf if v is None else v for v in values] if none_is_inf else [
      v for v in values if v is not None]
  n = sum(1 for v in vals if math.isfinite(v))
  if not vals:
    return {"median": None, "q25": None, "q75": None, "n": 0}
  return {"median": json_number(quantile(vals, 0.5)), "q25": json_number(quantile(vals, 0.25)),
          "q75": json_number(quantile(vals, 0.75)), "n": n}


def bootstrap_ci(values: Sequence[float], level: float = 0.95,
                 n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
                 ) -> tuple[Optional[float], Optional[float]]:
  """Percentile bootstrap interval of the mean of `values` (resampled with replacement, a fixed
  seed: the same values give the same interval). (None, None) for no values."""
  v = np.asarray(values, np.float64)
  if not v.size:
    return None, None
  rng = np.random.default_rng(seed)
  means = v[rng.integers(0, v.size, size=(n_resamples, v.size))].mean(axis=1)
  lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
  return float(lo), float(hi)


def _betacf(a: float, b: float, x: float) -> float:
  """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
  tiny, eps = 1e-300, 1e-16
  qab, qap, qam = a + b, a + 1.0, a - 1.0
  c, d = 1.0, 1.0 - qab * x / qap
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 1000):
    m2 = 2 * m
    for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
               -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
      d = 1.0 + aa * d
      d = 1.0 / (d if abs(d) > tiny else tiny)
      c = 1.0 + aa / c
      c = c if abs(c) > tiny else tiny
      h *= d * c
    if abs(d * c - 1.0) < eps:
      break
  return h


def incomplete_beta(a: float, b: float, x: float) -> float:
  """The regularized incomplete beta function I_x(a, b), a, b > 0, x in [0, 1]."""
  if x <= 0.0:
    return 0.0
  if x >= 1.0:
    return 1.0
  log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
               + b * math.log1p(-x))
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _betacf(a, b, x) / a
  return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) of Student's t with `df` degrees of freedom."""
  tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
  """The p-quantile of Student's t with `df` > 0 degrees of freedom (bisection on `t_cdf` to
  1e-12 relative)."""
  if not 0.0 < p < 1.0 or not df > 0:
    raise ValueError(f"t_quantile(p={p}, df={df}): need 0 < p < 1 and df > 0")
  if p < 0.5:
    return -t_quantile(1.0 - p, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < p:
    lo, hi = hi, 2.0 * hi
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < p:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-12 * max(1.0, hi):
      break
  return 0.5 * (lo + hi)


def t_interval(values: Sequence[float], level: float = CI_LEVEL
               ) -> tuple[Optional[float], Optional[float]]:
  """The two-sided Student t interval of the mean of `values`: mean +- t_{(1+level)/2, n-1} * s /
  sqrt(n), s with ddof 1; (None, None) for fewer than 2 values."""
  v = np.asarray(values, np.float64)
  if v.size < 2:
    return None, None
  half = t_quantile(0.5 * (1.0 + level), v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
  mean = float(v.mean())
  return mean - half, mean + half


def paired(values: Sequence[Optional[float]]) -> dict[str, Any]:
  """Summary of per-seed paired differences (None entries dropped): n, mean, median, ci95 (the t
  interval of the mean, `t_interval`), ci95_bootstrap (percentile bootstrap of the mean, a
  secondary number), and the values themselves (in seed order, None kept)."""
  v = [x for x in values if x is not None]
  lo, hi = t_interval(v)
  return {"n": len(v), "mean": float(np.mean(v)) if v else None,
          "median": float(np.median(v)) if v else None, "ci95": [lo, hi],
          "ci95_bootstrap": list(bootstrap_ci(v)),
          "values": [json_number(x) if x is not None else None for x in values]}


def paired_ratio(values: Sequence[Optional[float]]) -> dict[str, Any]:
  """Summary of per-seed ratios (positive; None entries dropped), in log space: "mean" is the
  geometric mean exp(mean log r), "median" the median ratio, "ci95" the t interval of the mean log
  ratio mapped through exp (always positive, unlike a t interval of the ratios themselves),
  "ci95_bootstrap" the percentile bootstrap of the mean log ratio mapped the same way; "n" and the
  ratios themselves ("values", in seed order, None kept) as in `paired`."""
  v = [x for x in values if x is not None and x > 0]
  logs = [math.log(x) for x in v]
  lo, hi = t_interval(logs)
  blo, bhi = bootstrap_ci(logs)
  ex = lambda x: None if x is None else math.exp(x)
  return {"n": len(v), "mean": math.exp(float(np.mean(logs))) if v else None,
          "median": float(np.median(v)) if v else None, "ci95": [ex(lo), ex(hi)],
          "ci95_bootstrap": [ex(blo), ex(bhi)],
          "values": [json_number(x) if x is not None else None for x in values]}


def grid_metrics(curves: Sequence[Sequence[Row]]) -> list[str]:
  """The eval metrics summarised on the grid: pass@1 (T=0.1), pass@1 at T=1, every pass@k (k
  ascending) and entropy, those present in any of the curves."""
  keys = {k for c in curves for r in c for k in r}
  ks = sorted((int(k.split("@")[1]), k) for k in keys
              if k.startswith("eval/pass@") and k.split("@")[1].isdigit() and k != PRIMARY)
  fixed = [PRIMARY] + sorted(k for k in keys if k.startswith("eval/pass@1_t"))
  return [k for k in fixed if k in keys] + [k for _, k in ks] + (
      ["eval/entropy"] if "eval/entropy" in keys else [])


def passk_keys(metrics: Sequence[str]) -> list[tuple[int, str]]:
  """[(k, key)] for pass@k at the sampling temperature: k = 1 is pass@1_t*, then pass@k, k > 1."""
  out = [(1, k) for k in metrics if k.startswith("eval/pass@1_t")][:1]
  return out + [(int(k.split("@")[1]), k) for k in metrics
                if k.startswith("eval/pass@") and k.split("@")[1].isdigit() and k != PRIMARY]


def auto_targets(first: Sequence[float], baseline_peaks: Sequence[float],
                 fractions: Sequence[float] = TARGET_FRACTIONS) -> list[float]:
  """Targets between the median start accuracy and the baseline arm's median peak, at `fractions`
  of the way (rounded to 3 decimals); none when the baseline does not improve by 0.01."""
  if not first or not baseline_peaks:
    return []
  start, top = float(np.median(first)), float(np.median(baseline_peaks))
  if top < start + 0.01:
    return []
  return sorted({round(start + f * (top - start), 3) for f in fractions})


def run_points(curve: Sequence[Row], grid: Sequence[float], metrics: Sequence[str],
               targets: Sequence[float]) -> dict[str, Any]:
  """One run's numbers: each metric on the grid, final (last eval point) and peak values, the
  compute of the peak, the primary metric's gain over the last quarter of the run's compute (final
  minus its value at 3/4 of the final compute, interpolated; issue 37's test that a budget is long
  enough: on-policy's is < 0.01), and compute to each target of the primary metric."""
  out: dict[str, Any] = {"grid": {}, "final": {}, "peak": {}}
  xs_primary = series(curve, PRIMARY)[0]
  # The evaluation a grid point triggered: the first one at or past it.
  at_grid = [xs_primary[np.searchsorted(xs_primary, g)] if g <= xs_primary[-1] else None
             for g in grid] if len(xs_primary) else [None] * len(grid)
  for m in metrics:
    xs, ys = series(curve, m)
    measured = set(xs.tolist())
    # A metric drawn at only some evaluations (eval.passk_grid) is read off the grid only where
    # the evaluation of that grid point drew it, never interpolated across skipped points.
    out["grid"][m] = [interp(xs, ys, g) if x is not None and x in measured else None
                      for g, x in zip(grid, at_grid)]
    out["final"][m] = float(ys[-1]) if len(ys) else None
    out["peak"][m] = float(ys.max()) if len(ys) else None
  xs, ys = series(curve, PRIMARY)
  out["peak_compute"] = float(xs[int(np.argmax(ys))]) if len(ys) else None
  out["final_compute"] = float(xs[-1]) if len(xs) else None
  # Has the run flattened? The primary metric's gain over the last quarter of its compute.
  three_quarters = interp(xs, ys, 0.75 * float(xs[-1])) if len(xs) else None
  out["last_quarter_gain"] = (float(ys[-1]) - three_quarters
                              if three_quarters is not None else None)
  out["to_target"] = {f"{t:.3f}": compute_to_target(xs, ys, t) for t in targets}
  return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
  return a / b if a is not None and b is not None and b > 0 else None


def _diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
  return a - b if a is not None and b is not None else None


def arm_summary(points: Mapping[int, Mapping[str, Any]], run_stats: Mapping[int, Mapping[str, Any]],
                metrics: Sequence[str], grid_len: int) -> dict[str, Any]:
  """Median and IQR over seeds of an arm's `run_points` (by seed) and of its per-run statistics."""
  seeds = sorted(points)
  s: dict[str, Any] = {"seeds": seeds, "grid": {}, "final": {}, "peak": {}}
  for m in metrics:
    cols = [quantiles([points[k]["grid"][m][i] for k in seeds]) for i in range(grid_len)]
    s["grid"][m] = {q: [c[q] for c in cols] for q in ("median", "q25", "q75", "n")}
    s["final"][m] = quantiles([points[k]["final"][m] for k in seeds])
    s["peak"][m] = quantiles([points[k]["peak"][m] for k in seeds])
  s["peak_compute"] = quantiles([points[k]["peak_compute"] for k in seeds])
  s["final_compute"] = quantiles([points[k]["final_compute"] for k in seeds])
  gains = [points[k].get("last_quarter_gain") for k in seeds]
  known = [g for g in gains if g is not None]
  s["last_quarter_gain"] = {**quantiles(gains), "values": gains,
                            "mean": float(np.mean(known)) if known else None}
  pk = passk_keys(metrics)
  cols = [s["final"][key] for _, key in pk]
  s["passk_final"] = {"k": [k for k, _ in pk], **{q: [c[q] for c in cols]
                                                 for q in ("median", "q25", "q75")}}
  targets = sorted({t for k in seeds for t in points[k]["to_target"]})
  s["compute_to_target"] = {}
  for t in targets:
    vals = [points[k]["to_target"].get(t) for k in seeds]
    s["compute_to_target"][t] = {**quantiles(vals, none_is_inf=True), "values": vals}
  keys = sorted({k for st in run_stats.values() for k in st})
  s["run_stats"] = {k: quantiles([_num(run_stats[sd].get(k)) for sd in seeds]) for k in keys}
  return s


def paired_summary(arm: Mapping[int, Mapping[str, Any]], base: Mapping[int, Mapping[str, Any]],
                   metrics: Sequence[str], grid_len: int) -> dict[str, Any]:
  """Per-seed differences arm - baseline (seeds both have) on the grid, of final and peak values
  and of compute to target (difference and ratio arm / baseline): differences with the t interval
  of their mean (`paired`), ratios as a geometric mean with a log-space t interval
  (`paired_ratio`)."""
  seeds = sorted(set(arm) & set(base))
  out: dict[str, Any] = {"seeds": seeds, "grid": {}, "final": {}, "peak": {},
                         "compute_to_target": {}}
  for m in metrics:
    cols = [paired([_diff(arm[k]["grid"][m][i], base[k]["grid"][m][i]) for k in seeds])
            for i in range(grid_len)]
    out["grid"][m] = {"mean": [c["mean"] for c in cols], "ci95_lo": [c["ci95"][0] for c in cols],
                      "ci95_hi": [c["ci95"][1] for c in cols], "n": [c["n"] for c in cols]}
    out["final"][m] = paired([_diff(arm[k]["final"][m], base[k]["final"][m]) for k in seeds])
    out["peak"][m] = paired([_diff(arm[k]["peak"][m], base[k]["peak"][m]) for k in seeds])
  targets = sorted({t for k in seeds for t in arm[k]["to_target"]})
  for t in targets:
    a = [arm[k]["to_target"].get(t) for k in seeds]
    b = [base[k]["to_target"].get(t) for k in seeds]
    out["compute_to_target"][t] = {
        "difference": paired([_diff(x, y) for x, y in zip(a, b)]),
        "ratio": paired_ratio([_ratio(x, y) for x, y in zip(a, b)])}
  return out


def sweep_summary(curves: Mapping[str, Mapping[int, Sequence[Row]]],
                  run_stats: Mapping[str, Mapping[int, Mapping[str, Any]]],
                  grid: Sequence[float], baseline_of: Mapping[str, Optional[str]],
                  baseline: str, targets: Optional[Sequence[float]] = None) -> dict[str, Any]:
  """Everything results.json says about one sweep.

  Args:
    curves: {arm: {seed: eval rows}} of the finished runs.
    run_stats: {arm: {seed: {name: number}}}: per-run statistics (replay ratio, gamma, ...).
    grid: the compute grid [device-seconds].
    baseline_of: {arm: the arm it is paired with, or None}.
    baseline: the sweep's baseline arm (its peak sets the automatic targets).
    targets: accuracy targets of the primary metric; None: `auto_targets`.
  Returns {"grid", "metrics", "targets", "arms": {arm: arm_summary + "vs_baseline"}}.
  """
  metrics = grid_metrics([c for by_seed in curves.values() for c in by_seed.values()])
  if targets is None:
    firsts = [float(series(c, PRIMARY)[1][0]) for by_seed in curves.values()
              for c in by_seed.values() if len(series(c, PRIMARY)[1])]
    peaks = [float(series(c, PRIMARY)[1].max()) for c in curves.get(baseline, {}).values()
             if len(series(c, PRIMARY)[1])]
    targets = auto_targets(firsts, peaks)
  points = {a: {sd: run_points(c, grid, metrics, targets) for sd, c in by_seed.items()}
            for a, by_seed in curves.items()}
  arms = {}
  for a in curves:
    arms[a] = arm_summary(points[a], run_stats.get(a, {}), metrics, len(grid))
    b = baseline_of.get(a)
    if b is not None and b in points:
      arms[a]["vs_baseline"] = {"baseline": b,
                                **paired_summary(points[a], points[b], metrics, len(grid))}
  return {"grid": [float(g) for g in grid], "metrics": metrics,
          "targets": [float(t) for t in targets], "arms": arms}
