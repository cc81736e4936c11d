"""Statistics of a sweep (`science.stats`) against hand computations: interpolation, compute to
target, quantiles, t and bootstrap intervals, paired ratios, the sweep summary."""

import numpy as np
import pytest

from jaxreplay.science import stats as st


def _curve(xs, ys):
  return [{"compute_seconds": x, "step": i, "eval/pass@1": y, "eval/pass@1_t1": y / 2,
           "eval/pass@2": y, "eval/entropy": 1.0 - y} for i, (x, y) in enumerate(zip(xs, ys))]


def test_interp_never_extrapolates():
  xs, ys = np.array([0.0, 10.0, 30.0]), np.array([0.2, 0.4, 0.8])
  assert st.interp(xs, ys, 5.0) == pytest.approx(0.3)
  assert st.interp(xs, ys, 20.0) == pytest.approx(0.6)
  assert st.interp(xs, ys, 30.0) == pytest.approx(0.8)
  assert st.interp(xs, ys, 30.5) is None
  assert st.interp(xs, ys, -1.0) is None
  assert st.interp(np.zeros(0), np.zeros(0), 0.0) is None


def test_compute_to_target_only_between_bracketing_points():
  xs, ys = np.array([0.0, 10.0, 30.0, 50.0]), np.array([0.2, 0.4, 0.8, 0.7])
  # 0.5 lies between (10, 0.4) and (30, 0.8): 10 + 0.1 / 0.4 * 20 = 15.
  assert st.compute_to_target(xs, ys, 0.5) == pytest.approx(15.0)
  assert st.compute_to_target(xs, ys, 0.8) == pytest.approx(30.0)   # reached exactly
  assert st.compute_to_target(xs, ys, 0.3) == pytest.approx(5.0)    # between step 0 and 10
  assert st.compute_to_target(xs, ys, 0.9) is None                  # never reached
  assert st.compute_to_target(xs, ys, 0.1) is None                  # already there at the start
  # The first crossing counts, even after a dip.
  xs2, ys2 = np.array([0.0, 1.0, 2.0, 3.0]), np.array([0.0, 1.0, 0.0, 1.0])
  assert st.compute_to_target(xs2, ys2, 0.5) == pytest.approx(0.5)


def test_quantiles_median_and_iqr():
  q = st.quantiles([4.0, 1.0, 3.0, 2.0])
  assert (q["median"], q["q25"], q["q75"], q["n"]) == (2.5, 1.75, 3.25, 4)
  assert st.quantiles([1.0, None, 3.0])["median"] == 2.0      # None dropped
  assert st.quantiles([])["median"] is None
  # Not reached counts as +inf: median of (1, 2, inf) = 2, q75 = inf -> None.
  q = st.quantiles([1.0, None, 2.0], none_is_inf=True)
  assert (q["median"], q["q25"], q["q75"], q["n"]) == (2.0, 1.5, None, 2)
  assert st.quantiles([None, None, 1.0], none_is_inf=True)["median"] is None


def test_bootstrap_interval_on_known_cases():
  assert st.bootstrap_ci([0.3, 0.3, 0.3]) == (pytest.approx(0.3), pytest.approx(0.3))
  assert st.bootstrap_ci([0.7]) == (pytest.approx(0.7), pytest.approx(0.7))
  # Two values: the resampled mean is 0, 0.5 or 1 with probability 1/4, 1/2, 1/4, so the 2.5% and
  # 97.5% percentiles are 0 and 1.
  assert st.bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
  assert st.bootstrap_ci([]) == (None, None)
  lo, hi = st.bootstrap_ci(list(np.linspace(0, 1, 50)))
  assert lo < 0.5 < hi and hi - lo < 0.3
  assert st.bootstrap_ci([0.1, 0.5, 0.2]) == st.bootstrap_ci([0.1, 0.5, 0.2])  # fixed seed
  p = st.paired([0.1, None, 0.3])
  assert p["n"] == 2 and p["mean"] == pytest.approx(0.2) and p["values"] == [0.1, None, 0.3]
  assert p["ci95_bootstrap"] == list(st.bootstrap_ci([0.1, 0.3]))


def test_t_quantiles_and_intervals_match_scipy():
  """The t interval (mean +- t_{0.975, n-1} s / sqrt(n)) against scipy.stats.t, and its quantiles
  over the degrees of freedom a sweep has (1-30) and beyond."""
  from tests.helpers.deps import require  # pylint: disable=g-import-not-at-top
  stats = require("scipy.stats")
  for df in (1, 2, 3, 4, 5, 7, 11, 30, 120):
    for p in (0.6, 0.9, 0.975, 0.995, 0.025):
      assert st.t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)
    assert st.t_cdf(1.7, df) == pytest.approx(stats.t.cdf(1.7, df), rel=1e-12)
  for values in ([0.02, 0.025, 0.019, 0.024], [0.1, -0.05, 0.02, 0.0, 0.07, 0.03], [1.0, 3.0]):
    v = np.asarray(values)
    want = stats.t.interval(0.95, v.size - 1, loc=v.mean(), scale=stats.sem(v))
    np.testing.assert_allclose(st.t_interval(values), want, rtol=1e-9)
    assert st.paired(values)["ci95"] == pytest.approx(list(want), rel=1e-9)
  # by hand: [1, 3]: mean 2, s = sqrt(2), t_{0.975,1} = 12.7062 -> 2 +- 12.7062 (the two values
  # alone say little); 4 seeds at +0.022 with s 0.0029: +- 3.1824 * 0.0029 / 2
  lo, hi = st.t_interval([1.0, 3.0])
  assert lo == pytest.approx(2 - 12.706204736, rel=1e-8) and hi == pytest.approx(2 + 12.706204736)
  assert st.t_interval([0.5]) == (None, None) and st.paired([0.5])["ci95"] == [None, None]
  with pytest.raises(ValueError):
    st.t_quantile(1.0, 3)


def test_paired_ratio_is_a_geometric_mean_with_a_log_space_t_interval():
  """Ratios of compute: the geometric mean and exp of scipy's t interval of the log ratios, so the
  interval stays positive where a t interval of the raw ratios (1.51 [-1.26, 4.28] for these three
  on 3 seeds) would not."""
  from tests.helpers.deps import require  # pylint: disable=g-import-not-at-top
  stats = require("scipy.stats")
  ratios = [0.53, 2.72, 1.29]
  logs = np.log(ratios)
  p = st.paired_ratio([ratios[0], None, ratios[1], ratios[2]])
  assert p["n"] == 3 and p["values"] == [0.53, None, 2.72, 1.29]
  assert p["mean"] == pytest.approx(np.exp(logs.mean()), rel=1e-12)
  assert p["median"] == pytest.approx(1.29)
  want = np.exp(stats.t.interval(0.95, 2, loc=logs.mean(), scale=stats.sem(logs)))
  np.testing.assert_allclose(p["ci95"], want, rtol=1e-9)
  assert 0 < p["ci95"][0] < p["mean"] < p["ci95"][1]
  assert st.paired(ratios)["ci95"][0] < 0  # what the raw-ratio interval would have said
  np.testing.assert_allclose(p["ci95_bootstrap"], np.exp(st.bootstrap_ci(list(logs))), rtol=1e-12)
  one = st.paired_ratio([1.5])
  assert one["mean"] == pytest.approx(1.5) and one["ci95"] == [None, None]
  assert st.paired_ratio([None])["mean"] is None


def test_sweep_summary_by_hand():
  grid = [0.0, 10.0, 20.0]
  curves = {
      "base": {0: _curve([0, 10, 21], [0.2, 0.4, 0.6]), 1: _curve([0, 12, 22], [0.2, 0.3, 0.5])},
      "arm": {0: _curve([0, 11, 20], [0.2, 0.6, 0.7]), 1: _curve([0, 10, 20], [0.2, 0.5, 0.6])},
  }
  s = st.sweep_summary(curves, {}, grid, {"base": None, "arm": "base"}, "base", targets=[0.45])
  assert s["metrics"] == ["eval/pass@1", "eval/pass@1_t1", "eval/pass@2", "eval/entropy"]
  # base at x=10: seed 0 0.4, seed 1 0.2 + 0.1 * 10 / 12.
  b10 = [0.4, 0.2 + 0.1 * 10 / 12]
  assert s["arms"]["base"]["grid"]["eval/pass@1"]["median"][1] == pytest.approx(np.mean(b10))
  # base seed 0 at x=20: between (10, 0.4) and (21, 0.6).
  assert s["arms"]["base"]["grid"]["eval/pass@1"]["q75"][2] == pytest.approx(
      np.percentile([0.4 + 0.2 * 10 / 11, 0.3 + 0.2 * 8 / 10], 75))
  # compute to 0.45: base seed 0 10 + 0.05/0.2*11 = 12.75, seed 1 12 + 0.15/0.2*10 = 19.5.
  ctt = s["arms"]["base"]["compute_to_target"]["0.450"]
  assert ctt["values"] == [pytest.approx(12.75), pytest.approx(19.5)]
  # arm seed 0: 0.45 in (0, 0.2)-(11, 0.6): 0.25/0.4*11; seed 1: 0.25/0.3*10.
  a = [0.25 / 0.4 * 11, 0.25 / 0.3 * 10]
  vs = s["arms"]["arm"]["vs_baseline"]
  assert vs["baseline"] == "base" and vs["seeds"] == [0, 1]
  ratio = vs["compute_to_target"]["0.450"]["ratio"]
  assert ratio["values"] == [pytest.approx(a[0] / 12.75), pytest.approx(a[1] / 19.5)]
  logs = np.log([a[0] / 12.75, a[1] / 19.5])
  assert ratio["mean"] == pytest.approx(np.exp(logs.mean()))  # geometric mean
  # Log-space t interval, t_{0.975, 1} = 12.706: exp(mean +- t * s / sqrt(2)).
  half = 12.7062047 * logs.std(ddof=1) / np.sqrt(2)
  assert ratio["ci95"] == [pytest.approx(np.exp(logs.mean() - half), rel=1e-6),
                           pytest.approx(np.exp(logs.mean() + half), rel=1e-6)]
  # Final values: the last real evaluation point of each seed; peaks.
  assert vs["final"]["eval/pass@1"]["values"] == [pytest.approx(0.1), pytest.approx(0.1)]
  assert s["arms"]["arm"]["peak"]["eval/pass@1"]["median"] == pytest.approx(0.65)
  assert s["arms"]["arm"]["passk_final"]["k"] == [1, 2]
  assert "vs_baseline" not in s["arms"]["base"]
  # Automatic targets: between the median start (0.2) and the baseline's median peak (0.55).
  assert st.auto_targets([0.2] * 4, [0.6, 0.5]) == [0.375, 0.463, 0.515]
  assert st.auto_targets([0.5], [0.505]) == []


def test_sparse_metric_is_not_interpolated_across_skipped_evaluations():
  # pass@2 drawn only at the evaluations of grid points 0 and 20 (eval.passk_grid).
  curve = [{"compute_seconds": 0.0, "eval/pass@1": 0.2, "eval/pass@2": 0.3},
           {"compute_seconds": 11.0, "eval/pass@1": 0.4},
           {"compute_seconds": 21.0, "eval/pass@1": 0.6, "eval/pass@2": 0.7}]
  p = st.run_points(curve, [0.0, 10.0, 20.0], ["eval/pass@1", "eval/pass@2"], targets=[])
  assert p["grid"]["eval/pass@1"] == pytest.approx([0.2, 0.2 + 0.2 * 10 / 11, 0.4 + 0.2 * 9 / 10])
  assert p["grid"]["eval/pass@2"][0] == pytest.approx(0.3)
  assert p["grid"]["eval/pass@2"][1] is None                       # not drawn at that point
  assert p["grid"]["eval/pass@2"][2] == pytest.approx(0.3 + 0.4 * 20 / 21)
  assert p["final"]["eval/pass@2"] == 0.7
  # Last quarter: from 0.75 * 21 = 15.75, between (11, 0.4) and (21, 0.6): 0.495, to 0.6.
  assert p["last_quarter_gain"] == pytest.approx(0.6 - (0.4 + 0.2 * 4.75 / 10))
  flat = st.arm_summary({0: p, 1: {**p, "last_quarter_gain": -0.005}}, {}, ["eval/pass@1"], 3)
  assert flat["last_quarter_gain"]["values"] == [pytest.approx(0.105), -0.005]
  assert flat["last_quarter_gain"]["mean"] == pytest.approx(0.05)
