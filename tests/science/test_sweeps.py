"""The named sweeps (`science.sweeps`): compute grids, and every sweep resolving on the default
config into runs whose configs pass the launcher's validation."""
import pytest

from jaxreplay.config import validation
from jaxreplay.science import runner
from jaxreplay.science import sweeps


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


def test_the_decisive_sweep_protocol_and_the_issue_26_sweep_kept_as_it_ran():
  """`pareto` (issue 37): 200 on-policy updates of the large-batch config, a grid 2^(1/3) apart
  from 1/128 of the budget, the protocol's keys on every arm before the arm's own; `pareto_i26`
  plans exactly the args its committed runs were launched with."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  plan = runner.plan_sweep(sweeps.SWEEPS["pareto"], 1)
  assert plan["budget"] == 200 * (1 + 6.84) * 16
  grid = plan["grid"]
  assert grid[0] == 0 and grid[1] == 196.0 and grid[-1] == plan["budget"] and len(grid) == 23
  ratios = [b / a for a, b in zip(grid[1:], grid[2:])]
  assert all(abs(r - 2 ** (1 / 3)) < 2e-3 for r in ratios), ratios
  for spec in plan["specs"]:
    args = spec.args()
    for key, value in sweeps.DECISIVE_PROTOCOL:
      assert f"--config.{key}={sweeps.format_value(value)}" in args
    assert args.index("--config.eval.pass1_problems=0") < args.index(
        next(a for a in args if a.startswith("--config.trainer.learning_rate=")))
  i26 = runner.plan_sweep(sweeps.SWEEPS["pareto_i26"], 4)
  assert i26["budget"] == 12544.0
  repo = os.path.join(os.path.dirname(__file__), "..", "..")
  with open(os.path.join(repo, "experiments", "runs", "pareto_i26", "onpolicy_lr3x", "seed1",
                         "spec.json")) as f:
    committed = json.load(f)["args"]
  assert next(s.args() for s in i26["specs"]
              if (s.arm, s.seed) == ("onpolicy_lr3x", 1)) == committed


def test_the_multiturn_sweep():
  """Issue 38: on-policy vs replay on configs/multiturn.py, 3 seeds, one budget of 200 on-policy
  updates of that config; the sweep's evaluation protocol on every run, which keeps the
  multi-turn task (one sampler call per prompt request, its environment)."""
  sweep = sweeps.SWEEPS["multiturn"]
  assert sweeps.get("multiturn") == [sweep]
  assert sweep.config == "configs/multiturn.py" and sweep.min_seeds == 3
  assert [(a.name, a.family) for a in sweep.arms] == [("onpolicy", "onpolicy"),
                                                      ("replay", "replay")]
  plan = runner.plan_sweep(sweep, sweep.min_seeds)
  base = runner.load_config("configs/multiturn.py")
  assert plan["budget"] == 200 * sweeps.update_seconds(base)
  assert sorted((s.arm, s.seed) for s in plan["specs"]) == [
      (arm, seed) for arm in ("onpolicy", "replay") for seed in range(3)]
  for s in plan["specs"]:
    o = dict(s.overrides)
    assert o["eval.n_samples"] == 8 and o["eval.ks"] == (1, 2, 4, 8)
    assert o["compute_budget"] == plan["budget"] and s.config == "configs/multiturn.py"
    assert o.get("buffer.on_policy", False) == (s.arm == "onpolicy")
    c = runner.load_config(s.config)
    sweeps.apply(c, s.overrides)
    assert c.task.name == "calculator" and validation.multiturn(c)
