"""The experiment command (`science.runner`, `python -m jaxreplay.experiments`): resumability with a
fake launcher, figures, the record of a run, a --quick sweep end to end."""
import fcntl
import json
import math
import os

import pytest

from jaxreplay.science import runner
from jaxreplay.science import sweeps


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


def test_extend_resumes_finished_runs_to_a_longer_budget(tmp_path):
  """--extend=F: a run finished to the sweep's budget is launched again with F x the budget (the
  launcher resumes it from its last checkpoint), its grid continued, pass@k also at the new end;
  its first done.json / record.json kept as *.base.json. Runs not yet run start extended; a
  rerun launches nothing; the plan records what it extends."""
  out = str(tmp_path / "exp")
  fake = FakeLauncher()
  argv = ["--sweep=fig1", "--seeds=2", f"--out={out}", "--quick", "--arms=onpolicy"]
  assert runner.main(argv, runner=fake) == 0
  base_plan = json.load(open(os.path.join(out, "plans", "fig1.json")))
  budget = base_plan["budget"]
  base_done = json.load(open(os.path.join(out, "runs/fig1/onpolicy/seed0/done.json")))
  fake.calls.clear()
  extended = ["--sweep=fig1", "--seeds=2", f"--out={out}", "--quick", "--extend=1.5"]
  assert runner.main(extended, runner=fake) == 0
  assert sorted(fake.calls) == ["runs/fig1/onpolicy/seed0", "runs/fig1/onpolicy/seed1",
                                "runs/fig1/replay/seed0", "runs/fig1/replay/seed1"]
  run = os.path.join(out, "runs/fig1/onpolicy/seed0")
  assert json.load(open(os.path.join(run, "done.base.json"))) == base_done
  assert os.path.isfile(os.path.join(run, "record.base.json"))
  done = json.load(open(os.path.join(run, "done.json")))
  args = dict(a.split("=", 1) for a in done["args"] if a.startswith("--config."))
  assert float(args["--config.compute_budget"]) == pytest.approx(1.5 * budget)
  grid = [float(x) for x in args["--config.eval.compute_grid"].strip("()").split(",")]
  assert grid[:len(base_plan["grid"])] == base_plan["grid"] and grid[-1] == 1.5 * budget
  passk = [float(x) for x in args["--config.eval.passk_grid"].strip("()").split(",")]
  assert passk == [0.0, budget, 1.5 * budget]
  plan = json.load(open(os.path.join(out, "plans", "fig1.json")))
  assert plan["budget"] == 1.5 * budget and plan["extends"] == {"budget": budget,
                                                                "grid": base_plan["grid"]}
  res = json.load(open(os.path.join(out, "results.json")))
  assert res["runs"]["runs/fig1/onpolicy/seed0"]["curve"][-1]["compute_seconds"] >= 1.5 * budget
  fake.calls.clear()
  assert runner.main(extended, runner=fake) == 0 and fake.calls == []
  # The unextended command now finds runs of other settings: an error, not a silent mix.
  with pytest.raises(RuntimeError, match="other settings"):
    runner.main(argv, runner=fake)
  with pytest.raises(ValueError, match="factor >= 1"):
    runner.plan_sweep(sweeps.get("fig1")[0], 1, quick=True, extend=0.5)


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
  assert {"lr_sweep_pareto.png", "n_sweep_final_peak.png", "n_sweep_entropy.png",
          "lr_sweep_compute_to_target.png"} <= figs
  assert "n_sweep_compute_to_target.png" not in figs  # no learning-rate families
  res = json.load(open(os.path.join(out, "results.json")))
  fams = res["sweeps"]["lr_sweep"]["summary"]["families"]
  for fam in ("onpolicy", "replay"):
    assert {"lrs", "final_by_lr", "best_lr", "best_arm", "bracketed", "final_pass1",
            "vs_baseline"} <= set(fams[fam])  # the keys from before issue 37, kept
    ctt = fams[fam]["compute_to_target"]
    assert len(ctt) == 4 and set(ctt[0]) >= {"target", "ratio", "ci95", "reached_seeds"}
  assert res["sweeps"]["lr_sweep"]["summary"]["family_targets"]["baseline_family"] == "onpolicy"


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
  # --extend: each finished run resumed from its last checkpoint to 1.5 x the budget; what it
  # had is unchanged (its curve is a prefix of the longer one) and no point is evaluated twice.
  assert runner.main(argv + ["--arms=onpolicy", "--extend=1.5"]) == 0
  d = os.path.join(out, "runs/fig1/onpolicy/seed0")
  assert "resumed at step" in open(os.path.join(d, "launch.log")).read()
  base = json.load(open(os.path.join(d, "record.base.json")))["curve"]
  longer = json.load(open(os.path.join(d, "record.json")))["curve"]
  assert longer[:len(base)] == base and len(longer) > len(base)
  assert longer[-1]["compute_seconds"] >= 1.5 * plan["budget"]
  xs = [r["compute_seconds"] for r in longer]
  assert len(set(xs)) == len(xs) and xs == sorted(xs)
  assert [r["step"] for r in longer if "eval/pass@4" in r] == [
      base[0]["step"], base[-1]["step"], longer[-1]["step"]]  # pass@k: start, old end, new end


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


def test_record_keeps_thinned_rows_and_every_diagnostics_row():
  rows = [{"step": 0, "eval/pass@1": 0.1}]
  rows += [{"step": s, "loss": 0.1 * s, "reward_mean": 0.5, "time/step_s": 0.01,
            **({"diag/noise_scale": 50.0 + s} if s % 10 == 1 else {})} for s in range(1, 601)]
  kept = runner._thinned_rows(rows)  # pylint: disable=protected-access
  diag = [r for r in kept if "diag/noise_scale" in r]
  assert len(diag) == 60 and all(r["diag/noise_scale"] == 50.0 + r["step"] for r in diag)
  assert len(kept) <= 60 + runner.MAX_ROWS + 1 and kept[-1]["step"] == 600
  assert all("time/step_s" not in r and "loss" in r for r in kept)  # trimmed to ROW_KEYS + diag/*
