"""Statistics of a sweep (`science.stats`) against hand computations: interpolation, compute to
target, quantiles, bootstrap intervals, the sweep summary, frontier ratios, family summaries."""

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
  assert ratio["mean"] == pytest.approx((a[0] / 12.75 + a[1] / 19.5) / 2)
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


def test_frontier_ratios_take_each_seeds_best_arm_per_family():
  def arm(*values):
    return {"compute_to_target": {"0.300": {"values": list(values)}}}
  arms = {"on_a": arm(100.0, 300.0, None), "on_b": arm(200.0, 150.0, 400.0),
          "re_a": arm(150.0, None, None), "re_b": arm(None, 300.0, None)}
  families = {"on_a": "onpolicy", "on_b": "onpolicy", "re_a": "replay", "re_b": "replay"}
  fr = st.frontier_ratios(arms, families, [0.3], "replay", "onpolicy")["0.300"]
  assert fr["onpolicy"] == [100.0, 150.0, 400.0]
  assert fr["replay"] == [150.0, 300.0, None]  # seed 2: no replay arm reaches it
  assert fr["arms"] == {"onpolicy": ["on_a", "on_b", "on_b"], "replay": ["re_a", "re_b", None]}
  assert fr["ratio"]["n"] == 2
  np.testing.assert_allclose(fr["ratio"]["geomean"], np.sqrt(1.5 * 2.0))
  lo, hi = fr["ratio"]["ci95"]
  assert 1.5 - 1e-9 <= lo <= fr["ratio"]["geomean"] <= hi <= 2.0 + 1e-9


def test_family_summary_reads_each_familys_bracket():
  def arm(median, vs=None):
    q = {"median": median, "q25": median - 0.01, "q75": median + 0.01, "n": 4}
    out = {"final": {st.PRIMARY: q}}
    if vs is not None:
      out["vs_baseline"] = {"baseline": "on_lr2", "final": {st.PRIMARY: vs}}
    return out
  lr = lambda v: [["trainer.learning_rate", v]]
  plan = {"on_lr1": {"family": "onpolicy", "overrides": lr(1e-5)},
          "on_lr2": {"family": "onpolicy", "overrides": lr(3e-5)},
          "on_lr3": {"family": "onpolicy", "overrides": lr(1e-4)},
          "re_lr1": {"family": "replay", "overrides": lr(1e-5)},
          "re_lr2": {"family": "replay", "overrides": lr(3e-5)},
          "re_lr3": {"family": "replay", "overrides": lr(1e-4)},   # not finished
          "nolr": {"family": "replay", "overrides": []},
          "plain": {"family": "", "overrides": lr(1e-5)}}
  arms = {"on_lr1": arm(0.40), "on_lr2": arm(0.45), "on_lr3": arm(0.30), "re_lr1": arm(0.41),
          "re_lr2": arm(0.47, vs={"mean": 0.02, "ci95": [0.01, 0.03], "n": 4}),
          "nolr": arm(0.5), "plain": arm(0.5)}
  fam = st.family_summary(arms, plan)
  assert set(fam) == {"onpolicy", "replay"}
  on, re = fam["onpolicy"], fam["replay"]
  assert on["lrs"] == [1e-5, 3e-5, 1e-4] and on["best_arm"] == "on_lr2" and on["best_lr"] == 3e-5
  assert on["bracketed"] and on["final_pass1"]["median"] == 0.45 and on["vs_baseline"] is None
  assert re["lrs"] == [1e-5, 3e-5] and re["best_arm"] == "re_lr2"
  assert not re["bracketed"]  # the best is the highest finished rate: no worse rate above it
  assert re["vs_baseline"] == {"baseline": "on_lr2", "mean": 0.02, "ci95": [0.01, 0.03], "n": 4}
