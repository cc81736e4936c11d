"""Learning-rate families (`science.families`): best rate and bracket on >= 2 seeds per rate, the
accuracy targets, compute ratios to on-policy (best rates and frontiers) against hand-computed
values on straight-line curves."""
import numpy as np
import pytest

from jaxreplay.science import families as fm
from jaxreplay.science import stats as st


def test_frontier_ratios_take_each_seeds_best_arm_per_family():
  def arm(*values):
    return {"compute_to_target": {"0.300": {"values": list(values)}}}
  arms = {"on_a": arm(100.0, 300.0, None), "on_b": arm(200.0, 150.0, 400.0),
          "re_a": arm(150.0, None, None), "re_b": arm(None, 300.0, None)}
  families = {"on_a": "onpolicy", "on_b": "onpolicy", "re_a": "replay", "re_b": "replay"}
  fr = fm.frontier_ratios(arms, families, [0.3], "replay", "onpolicy")["0.300"]
  assert fr["onpolicy"] == [100.0, 150.0, 400.0]
  assert fr["replay"] == [150.0, 300.0, None]  # seed 2: no replay arm reaches it
  assert fr["arms"] == {"onpolicy": ["on_a", "on_b", "on_b"], "replay": ["re_a", "re_b", None]}
  assert fr["ratio"]["n"] == 2
  np.testing.assert_allclose(fr["ratio"]["geomean"], np.sqrt(1.5 * 2.0))
  lo, hi = fr["ratio"]["ci95"]
  logs = np.log([1.5, 2.0])  # the t interval of the mean log ratio, through exp
  half = 12.706204736 * logs.std(ddof=1) / np.sqrt(2)
  np.testing.assert_allclose([lo, hi], np.exp([logs.mean() - half, logs.mean() + half]), rtol=1e-8)


def test_family_summary_reads_each_familys_bracket():
  def arm(median, vs=None, n=4):
    q = {"median": median, "q25": median - 0.01, "q75": median + 0.01, "n": n}
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
  fam = fm.family_summary(arms, plan)
  assert set(fam) == {"onpolicy", "replay"}
  on, re = fam["onpolicy"], fam["replay"]
  assert on["lrs"] == [1e-5, 3e-5, 1e-4] and on["best_arm"] == "on_lr2" and on["best_lr"] == 3e-5
  assert on["bracketed"] and on["final_pass1"]["median"] == 0.45 and on["vs_baseline"] is None
  assert re["lrs"] == [1e-5, 3e-5] and re["best_arm"] == "re_lr2"
  assert not re["bracketed"]  # the best is the highest finished rate: no worse rate above it
  assert re["vs_baseline"] == {"baseline": "on_lr2", "mean": 0.02, "ci95": [0.01, 0.03], "n": 4}
  assert on["seeds_by_lr"] == [4, 4, 4]
  # Judged on >= 2 seeds per rate: a one-seed rate can neither be the best nor close a bracket.
  arms.update(on_lr3=arm(0.50, n=1))  # a single lucky seed at the highest rate
  on = fm.family_summary(arms, plan)["onpolicy"]
  assert on["best_arm"] == "on_lr2" and not on["bracketed"] and on["seeds_by_lr"] == [4, 4, 1]
  arms.update(on_lr3=arm(0.30, n=1))  # lower, but one seed: not evidence of a bracket
  assert not fm.family_summary(arms, plan)["onpolicy"]["bracketed"]
  arms.update(on_lr3=arm(0.30, n=2))
  assert fm.family_summary(arms, plan)["onpolicy"]["bracketed"]
  arms.update(on_lr1=arm(0.46, n=1))  # the neighbour below ends higher on one seed: not counted
  on = fm.family_summary(arms, plan)["onpolicy"]
  assert on["best_arm"] == "on_lr2" and not on["bracketed"]


def test_compute_to_target_ratios_on_synthetic_curves():
  """Straight-line curves with known crossings: on-policy rises 0.2 -> 0.6 over 100 device-seconds
  (seed s: slope 0.004 * (1 + 0.1 s)), the replay arm twice as fast on seeds 0 and 1 and 4x on
  seed 2; the targets split [0.2, median final] in four; the ratio at each target is the
  geometric mean of 1/2, 1/2, 1/4 where reached, with the t interval of the log ratios."""
  xs = np.linspace(0.0, 100.0, 21)

  def line(slope, seed):
    return [{"compute_seconds": float(x), "eval/pass@1": float(min(0.2 + slope * x, 0.9))}
            for x in xs]
  on = {s: line(0.004 * (1 + 0.1 * s), s) for s in range(3)}
  fast = {0: 2.0, 1: 2.0, 2: 4.0}
  re = {s: line(0.004 * (1 + 0.1 * s) * fast[s], s) for s in range(3)}
  finals = sorted(float(c[-1]["eval/pass@1"]) for c in on.values())  # 0.6, 0.64, 0.68
  fam = {"onpolicy": {"best_arm": "on", "final_pass1": {"median": finals[1]}},
         "replay": {"best_arm": "re", "final_pass1": {"median": 0.9}}}
  targets = fm.add_compute_to_target(fam, {"on": on, "re": re}, "onpolicy")
  assert targets == pytest.approx([0.31, 0.42, 0.53, 0.64])
  logs = np.log([0.5, 0.5, 0.25])
  half = st.t_quantile(0.975, 2) * logs.std(ddof=1) / np.sqrt(3)
  for i, entry in enumerate(fam["replay"]["compute_to_target"]):
    assert entry["target"] == pytest.approx(targets[i]) and entry["seeds"] == 3
    if i < 3:  # every seed of both reaches it
      assert entry["reached_seeds"] == 3
      assert entry["values"] == pytest.approx([0.5, 0.5, 0.25], rel=1e-9)
      assert entry["ratio"] == pytest.approx(np.exp(logs.mean()))
      assert entry["ci95"] == pytest.approx(list(np.exp([logs.mean() - half, logs.mean() + half])))
  # 0.64 is on-policy seed 1's final (its last point: reached exactly) and above seed 0's 0.6
  last = fam["replay"]["compute_to_target"][3]
  assert last["values"][0] is None and last["reached_seeds"] == 2
  assert last["values"][1:] == pytest.approx([0.5, 0.25])
  assert [e["ratio"] for e in fam["onpolicy"]["compute_to_target"]] == pytest.approx([1.0] * 4)
  assert fm.family_targets({"on": on}, {"final_pass1": {"median": 0.1}}) == []  # no gain
  # A sweep with fixed targets (sweeps.DENSE_TARGETS) reads those, not its own runs' rule.
  fixed = fm.add_compute_to_target(fam, {"on": on, "re": re}, "onpolicy", fixed=(0.42, 0.53))
  assert fixed == [0.42, 0.53]
  assert [e["target"] for e in fam["replay"]["compute_to_target"]] == [0.42, 0.53]
  assert fam["replay"]["compute_to_target"][0]["values"] == pytest.approx([0.5, 0.5, 0.25])


def test_frontier_to_target_takes_each_seeds_fastest_rate_of_each_family():
  """Straight lines from pass@1 0.2 (x in device-seconds): on-policy at two rates, replay at two
  (one finished on seeds 0-1, one on seed 0 only, so it is left out). Hand-computed crossings of
  the target 0.4: compute = 0.2 / slope."""
  xs = np.linspace(0.0, 200.0, 41)

  def line(slope):
    return [{"compute_seconds": float(x), "eval/pass@1": float(min(0.2 + slope * x, 0.9))}
            for x in xs]
  curves = {"on_1x": {0: line(0.002), 1: line(0.004), 2: line(0.001)},   # 100, 50, 200 to 0.4
            "on_3x": {0: line(0.004), 1: line(0.002), 2: line(0.008)},   # 50, 100, 25
            "re_1x": {0: line(0.01), 1: line(0.002)},                    # 20, 100
            "re_3x": {0: line(0.005), 1: line(0.005)},                   # 40, 40
            "re_10x": {0: line(0.1)}}                                    # one seed: not counted
  plan = {a: {"family": "onpolicy" if a.startswith("on") else "replay"} for a in curves}
  fam = {"onpolicy": {}, "replay": {}}
  fm.add_frontier_to_target(fam, curves, plan, "onpolicy", [0.4, 0.95])
  re = fam["replay"]
  assert re["frontier_arms"] == ["re_1x", "re_3x"]
  assert fam["onpolicy"]["frontier_arms"] == ["on_1x", "on_3x"]
  e = re["frontier_to_target"][0]
  assert e["seeds"] == 2  # seed 2: no replay arm has it
  # seed 0: replay min(20, 40) = 20 (re_1x) vs on-policy min(100, 50) = 50 (on_3x): 0.4;
  # seed 1: min(100, 40) = 40 (re_3x) vs min(50, 100) = 50 (on_1x): 0.8.
  assert e["values"] == [pytest.approx(0.4), pytest.approx(0.8)]
  assert e["arms"] == [["re_1x", "on_3x"], ["re_3x", "on_1x"]]
  assert e["ratio"] == pytest.approx(np.sqrt(0.4 * 0.8))
  assert e["interp_range"][0] <= e["ratio"] <= e["interp_range"][1]
  logs = np.log([0.4, 0.8])
  half = st.t_quantile(0.975, 1) * logs.std(ddof=1) / np.sqrt(2)
  assert e["ci95"] == [pytest.approx(np.exp(logs.mean() - half)),
                       pytest.approx(np.exp(logs.mean() + half))]
  assert fam["onpolicy"]["frontier_to_target"][0]["values"] == [1.0, 1.0, 1.0]
  never = re["frontier_to_target"][1]  # 0.95 is above every curve's cap
  assert never["ratio"] is None and never["reached_seeds"] == 0 and never["values"] == [None, None]
  fam = {"replay": {}}
  fm.add_frontier_to_target(fam, curves, plan, "onpolicy", [0.4])  # no baseline family summary
  assert fam["replay"]["frontier_to_target"] == []


def test_family_targets_never_round_above_the_final_accuracy():
  """The last target is the baseline's final accuracy rounded down to 4 decimals, so the run that
  defines it reaches it (0.98486 would round up to 0.9849)."""
  curve = [{"compute_seconds": 0.0, "eval/pass@1": 0.224}, {"compute_seconds": 10.0,
                                                            "eval/pass@1": 0.98486}]
  targets = fm.family_targets({"on": {0: curve}}, {"final_pass1": {"median": 0.98486}})
  assert targets == [0.4142, 0.6044, 0.7946, 0.9848]  # 0.224 + i * 0.190215, rounded down
  assert st.compute_to_target(*st.series(curve, st.PRIMARY), targets[-1]) is not None


def test_interp_range_bounds_a_ratio_by_its_bracketing_evaluations():
  """A crossing interpolated between evaluations at 10 and 20 device-seconds could lie anywhere
  in [10, 20]; the ratio a / b of two such crossings anywhere in [a_lo / b_hi, a_hi / b_lo]."""
  xs, ys = np.array([0.0, 10.0, 20.0, 40.0]), np.array([0.1, 0.3, 0.5, 0.6])
  assert st.target_bracket(xs, ys, 0.4) == (10.0, 20.0)
  assert st.target_bracket(xs, ys, 0.05) is None and st.target_bracket(xs, ys, 0.7) is None
  assert st.compute_to_target(xs, ys, 0.4) == pytest.approx(15.0)
  # seed 0: a in [10, 20], b in [20, 40]; seed 1: a in [5, 10], b in [10, 20]; seed 2: no pair.
  r = st.interp_range([((10.0, 20.0), (20.0, 40.0)), ((5.0, 10.0), (10.0, 20.0)), None])
  assert r == [pytest.approx(np.sqrt(10 / 40 * 5 / 20)), pytest.approx(np.sqrt(20 / 20 * 10 / 10))]
  assert st.interp_range([None, ((1.0, 2.0), None)]) == [None, None]
  on = {0: [{"compute_seconds": float(x), "eval/pass@1": float(y)} for x, y in zip(xs, ys)]}
  fast = {0: [{"compute_seconds": float(x) / 2, "eval/pass@1": float(y)} for x, y in zip(xs, ys)]}
  (e,) = fm.compute_ratios(fast, on, [0.4])
  assert e["ratio"] == pytest.approx(0.5)
  assert e["interp_range"] == [pytest.approx(5 / 20), pytest.approx(10 / 10)]
  assert e["interp_range"][0] <= e["ratio"] <= e["interp_range"][1]
