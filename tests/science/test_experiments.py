"""The experiment command: sweep plans, hand-computed statistics, resumability, a --quick sweep."""
import fcntl
import json
import math
import os

import numpy as np
import pytest

from jaxreplay.config import validation
from jaxreplay.science import stats as st
from jaxreplay.science import runner
from jaxreplay.science import sweeps

# ---- statistics -------------------------------------------------------------------------------


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


def _curve(xs, ys):
  return [{"compute_seconds": x, "step": i, "eval/pass@1": y, "eval/pass@1_t1": y / 2,
           "eval/pass@2": y, "eval/entropy": 1.0 - y} for i, (x, y) in enumerate(zip(xs, ys))]


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


# ---- sweeps -----------------------------------------------------------------------------------


def test_compute_grid_and_values():
  assert sweeps.compute_grid(640.0, 4) == (0.0, 10.0, 40.0, 160.0, 640.0)
  assert sweeps.compute_grid(100.0, 1) == (0.0, 100.0)
  assert sweeps.passk_grid((0.0, 10.0, 40.0, 160.0, 640.0)) == (0.0, 640.0)
  assert sweeps.format_value((1, 2)) == "(1,2)"
  assert sweeps.format_value((0.5,)) == "(0.5,)"
  assert sweeps.format_value(True) == "True" and sweeps.format_value(1e-4) == "0.0001"


def test_every_sweep_resolves_on_the_default_config(monkeypatch):
  monkeypatch.setattr(sweeps, "_task_holds", lambda task_json, n: True)  # no task built here
  plans = {s.name: runner.plan_sweep(s, s.min_seeds) for s in sweeps.SWEEPS.values()}
  assert len(plans["fig1"]["specs"]) == 8
  for plan in plans.values():
    assert len({s.rel_dir for s in plan["specs"]}) == len(plan["specs"])
    budgets = {dict(s.overrides)["compute_budget"] for s in plan["specs"]}
    assert budgets == {plan["budget"]}  # one budget for every arm of a sweep
    assert plan["grid"][0] == 0.0 and plan["grid"][-1] == plan["budget"]
  ident = {(s.sweep, s.arm, s.seed): s.identity for p in plans.values() for s in p["specs"]}
  # The default replay arm is one run wherever it appears.
  assert (ident[("fig1", "replay", 0)] == ident[("asymre", "grpo", 0)]
          == ident[("positive_bias", "replay", 0)] == ident[("lr_sweep", "replay_lr1x", 0)])
  assert ident[("fig1", "replay", 0)] != ident[("fig1", "replay", 1)]
  for s in plans["sync_grid"]["specs"]:
    o = dict(s.overrides)
    assert o["buffer.batch_size"] <= o["buffer.size"]
    assert o["scheduler.rollouts_per_step"] % 8 == 0
    # A rollout costs the same to train on in every arm: train seconds / B is constant.
    base = runner.load_config(sweeps.DEFAULT_CONFIG)
    assert o["scheduler.train_seconds_per_step"] / o["buffer.batch_size"] == pytest.approx(
        base.scheduler.train_seconds_per_step / base.buffer.batch_size)
  # Every run's config passes the launcher's validation (no run would fail at start-up).
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top  (jax)
  for plan in plans.values():
    for s in plan["specs"]:
      c = runner.load_config(s.config)
      sweeps.apply(c, s.overrides)
      validation.validate_config(c)
  w = {s.arm: dict(s.overrides) for s in plans["wt_sweep"]["specs"]}
  ratios = [6.84 * o["trainer.num_devices"] / o["rollout.num_workers"] for o in w.values()]
  assert min(ratios) < 1.1 and max(ratios) > 6.5
  assert all(dict(s.overrides)["eval.num_problems"] == 1024 for s in plans["fig1"]["specs"])
  # A task too small for 1024 held-out problems keeps the base config's own number.
  monkeypatch.setattr(sweeps, "_task_holds", lambda task_json, n: False)
  assert dict(runner.plan_sweep(sweeps.SWEEPS["fig1"], 1)["specs"][0].overrides)[
      "eval.num_problems"] == runner.load_config(sweeps.DEFAULT_CONFIG).eval.num_problems


# ---- resumability, with a fake launcher ---------------------------------------------------------


class FakeLauncher:
  """Writes a deterministic metrics.jsonl like a run's; `fail` names run dirs whose first launch
  dies after writing a few rows (as a killed run would)."""

  def __init__(self, fail=()):
    self.calls, self.fail = [], set(fail)

  def __call__(self, spec, workdir, log_path):
    o = dict(spec.overrides)
    self.calls.append(spec.rel_dir)
    budget, grid = o["compute_budget"], o["eval.compute_grid"]
    speed = 1.5 if o.get("buffer.on_policy") else 1.0
    rows, step, x = [], 0, 0.0
    while True:
      row = {"step": step, "compute_seconds": x, "reward_mean": 0.1 * step,
             "buffer/replay_ratio": 1.0 if speed > 1 else 2.0, "buffer/staleness_mean": 1.0}
      if step == 0 or any(x >= g > x - 7.0 for g in grid) or x >= budget:
        acc = 0.2 + 0.5 * (1 - math.exp(-x / (40.0 * speed))) + 0.01 * spec.seed
        row.update({"eval/pass@1": acc, "eval/pass@1_t1": acc / 2, "eval/pass@2": acc,
                    "eval/pass@4": min(1.0, acc * 1.2), "eval/entropy": 1.0 - acc})
      rows.append(row)
      if x >= budget:
        break
      step, x = step + 1, x + 7.0
    killed = spec.rel_dir in self.fail
    self.fail.discard(spec.rel_dir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
      for r in rows[:3] if killed else rows:
        f.write(json.dumps(r) + "\n")
    with open(os.path.join(workdir, "run_config.json"), "w") as f:
      json.dump({"seed": spec.seed, "eval": {"top_p": 0.95, "temperature_pass1": 0.1,
                                             "temperature_passk": 1.0, "num_problems": 32}}, f)
    return 9 if killed else 0


def _read_figures(out):
  d = os.path.join(out, "figures")
  return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def test_finished_runs_are_skipped_and_results_unchanged(tmp_path, capsys):
  out = str(tmp_path / "exp")
  fake = FakeLauncher(fail={"runs/fig1/replay/seed1"})
  argv = ["--sweep=fig1,asymre", "--seeds=2", f"--out={out}", "--quick"]
  assert runner.main(argv, runner=fake) == 1   # one run was killed
  # asymre/grpo is the same run as fig1/replay: launched once.
  assert sorted(fake.calls) == ["runs/asymre/asymre/seed0", "runs/asymre/asymre/seed1",
                                "runs/fig1/onpolicy/seed0", "runs/fig1/onpolicy/seed1",
                                "runs/fig1/replay/seed0", "runs/fig1/replay/seed1"]
  assert not os.path.exists(os.path.join(out, "runs/fig1/replay/seed1/done.json"))
  fake.calls.clear()
  assert runner.main(argv, runner=fake) == 0   # resumes only the killed run
  assert fake.calls == ["runs/fig1/replay/seed1"]
  done = json.load(open(os.path.join(out, "runs/fig1/replay/seed1/done.json")))
  assert done["attempts"] == 2 and "jaxreplay.launch" in done["command"]
  alias = json.load(open(os.path.join(out, "runs/asymre/grpo/seed1/done.json")))
  assert alias["alias_of"] == "runs/fig1/replay/seed1"
  first = open(os.path.join(out, "results.json"), "rb").read()
  figures = _read_figures(out)
  fake.calls.clear()
  assert runner.main(argv, runner=fake) == 0
  assert fake.calls == []
  assert open(os.path.join(out, "results.json"), "rb").read() == first
  assert _read_figures(out) == figures
  # What git keeps of a sweep (experiments/.gitignore drops metrics.jsonl) rebuilds the same results.
  for root, _, files in os.walk(os.path.join(out, "runs")):
    if "done.json" in files and "alias_of" not in json.load(open(os.path.join(root, "done.json"))):
      assert "record.json" in files
    if "metrics.jsonl" in files:
      os.remove(os.path.join(root, "metrics.jsonl"))
  assert runner.main(argv + ["--report_only"], runner=fake) == 0
  assert fake.calls == []
  assert open(os.path.join(out, "results.json"), "rb").read() == first
  res = json.loads(first)
  assert set(res["sweeps"]) == {"fig1", "asymre"}
  assert res["runs"]["runs/asymre/grpo/seed0"]["source"] == "runs/fig1/replay/seed0"
  s = res["sweeps"]["fig1"]["summary"]
  assert s["arms"]["replay"]["vs_baseline"]["baseline"] == "onpolicy"
  assert res["sweeps"]["fig1"]["finished_runs"] == 4
  figs = sorted(os.listdir(os.path.join(out, "figures")))
  assert "fig1_accuracy.png" in figs and "asymre_passk.png" in figs
  report = open(os.path.join(out, "report.md")).read()
  assert "## fig1" in report and "| replay | 2 |" in report and "## asymre" in report
  # A run directory from other settings is an error, not a silent mix, and changes nothing.
  plans = open(os.path.join(out, "plans", "fig1.json"), "rb").read()
  with pytest.raises(RuntimeError, match="other settings"):
    runner.main(argv + ["--budget=50"], runner=fake)
  assert open(os.path.join(out, "plans", "fig1.json"), "rb").read() == plans
  # One command at a time per output directory.
  with open(os.path.join(out, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    assert runner.main(argv, runner=fake) == 2


def test_runs_start_seed_major(tmp_path):
  fake = FakeLauncher()
  argv = ["--sweep=positive_bias", "--seeds=2", f"--out={tmp_path}", "--quick", "--parallel=1"]
  assert runner.main(argv, runner=fake) == 0
  assert [c.rsplit("/", 1)[1] for c in fake.calls] == ["seed0"] * 3 + ["seed1"] * 3
  assert fake.calls[:3] == ["runs/positive_bias/replay/seed0", "runs/positive_bias/delta0.2/seed0",
                            "runs/positive_bias/delta0.5/seed0"]


def test_sweep_figures_from_fake_runs(tmp_path):
  out = str(tmp_path / "exp")
  assert runner.main(["--sweep=lr_sweep,n_sweep", "--seeds=1", f"--out={out}", "--quick"],
                     runner=FakeLauncher()) == 0
  figs = set(os.listdir(os.path.join(out, "figures")))
  assert {"lr_sweep_pareto.png", "n_sweep_final_peak.png", "n_sweep_entropy.png"} <= figs


# ---- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_quick_sweep_end_to_end(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device, as a user's run
  # The tiny task holds ~900 held-out problems: the full protocol keeps its own 512; the
  # scratchpad task (the sweeps' base) holds the protocol's 1024.
  assert sweeps.eval_problems(runner.load_config("configs/tiny.py")) == 512
  assert sweeps.eval_problems(runner.load_config(sweeps.DEFAULT_CONFIG)) == 1024
  out = str(tmp_path / "exp")
  argv = ["--sweep=fig1", "--seeds=1", f"--out={out}", "--quick", "--parallel=2"]
  assert runner.main(argv) == 0
  res = json.load(open(os.path.join(out, "results.json")))
  plan = res["sweeps"]["fig1"]
  assert plan["finished_runs"] == 2
  for arm in ("onpolicy", "replay"):
    run = res["runs"][f"runs/fig1/{arm}/seed0"]
    xs = [r["compute_seconds"] for r in run["curve"]]
    assert xs[0] == 0.0 and xs[-1] >= plan["budget"]   # ran to the compute budget
    assert run["run_config"]["compute_budget"] == plan["budget"]
    assert run["curve"][-1]["eval/pass@4"] >= run["curve"][-1]["eval/pass@1_t1"]
  assert os.path.isfile(os.path.join(out, "figures", "fig1_accuracy.png"))
  first = open(os.path.join(out, "results.json"), "rb").read()
  assert runner.main(argv) == 0   # every run finished: nothing relaunched
  assert open(os.path.join(out, "results.json"), "rb").read() == first


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


def test_theorem45_vs_sweep_on_fake_sync_grid(tmp_path):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "theorem45_vs_sweep", os.path.join(runner.REPO, "bench", "theorem45_vs_sweep.py"))
  t45 = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(t45)
  out = str(tmp_path / "exp")
  assert runner.main(["--sweep=sync_grid", "--seeds=1", f"--out={out}", "--quick"],
                     runner=FakeLauncher()) == 0
  results = json.load(open(os.path.join(out, "results.json")))
  cells = t45.grid_cells(results)
  assert sorted((c["N/R"], c["B/R"]) for c in cells) == [
      (1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
  assert all(c["final"] is not None and c["mean_over_grid"] is not None for c in cells)
  b = t45.best(cells, "final")
  assert b["final"] == max(c["final"] for c in cells)
  probe = {"fit": {"alpha": 0.2}, "design": [
      {"rho": 1.0, "mu": 6.84, "power_law": {"x_star": 3.0, "y_star": 2.0},
       "measured_max": {"x_star": 4.0, "y_star": 2.1}, "measured_mean": "n/a"}]}
  preds = t45.predictions(probe)
  assert [(p["method"], p["x_star"]) for p in preds] == [("power_law", 3.0), ("measured_max", 4.0)]
  path = str(tmp_path / "t45.png")
  t45.plot(cells, preds, b, t45.best(cells, "mean_over_grid"), 0.2, path)
  assert os.path.getsize(path) > 10000


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


def test_record_keeps_thinned_rows_and_every_diagnostics_row():
  rows = [{"step": 0, "eval/pass@1": 0.1}]
  rows += [{"step": s, "loss": 0.1 * s, "reward_mean": 0.5, "time/step_s": 0.01,
            **({"diag/noise_scale": 50.0 + s} if s % 10 == 1 else {})} for s in range(1, 601)]
  kept = runner._thinned_rows(rows)  # pylint: disable=protected-access
  diag = [r for r in kept if "diag/noise_scale" in r]
  assert len(diag) == 60 and all(r["diag/noise_scale"] == 50.0 + r["step"] for r in diag)
  assert len(kept) <= 60 + runner.MAX_ROWS + 1 and kept[-1]["step"] == 600
  assert all("time/step_s" not in r and "loss" in r for r in kept)  # trimmed to ROW_KEYS + diag/*
