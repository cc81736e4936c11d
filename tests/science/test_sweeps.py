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


def test_the_newest_families_are_added_arms_and_the_old_ones_unchanged():
  """Issue 37 item 3: `pareto` gains adaptive, adaptive_nobias, gradient_gate, fresh and
  ppo_epochs over the same rates; the arms of the families it had keep their names and
  arguments (runs in progress match their spec); every new arm passes validation."""
  plan = runner.plan_sweep(sweeps.SWEEPS["pareto"], 1)
  old = sweeps.Sweep("old", "", tuple(sweeps._lr_arm(n, f, o)  # pylint: disable=protected-access
                                      for n, o in sweeps.DECISIVE_FAMILIES
                                      for f in sweeps.PARETO_LR_FACTORS), baseline="onpolicy_lr1x",
                     config=sweeps.LARGE_BATCH_CONFIG, budget=plan["budget"],
                     grid_points=sweeps.DECISIVE_GRID_POINTS, grid_first=sweeps.DECISIVE_GRID_FIRST,
                     protocol=sweeps.DECISIVE_PROTOCOL)
  old_specs = {s.arm: s.args() for s in runner.plan_sweep(old, 1)["specs"]}
  specs = {s.arm: s for s in plan["specs"]}
  assert len(old_specs) == 12 and all(specs[a].args() == args for a, args in old_specs.items())
  assert "--config.total_steps=1569" in old_specs["onpolicy_lr1x"]  # 25088 / 16 + 1
  families = {plan["arms"][a]["family"] for a in specs}
  assert families == {"onpolicy", "replay", "posbias", "maxuses2", "adaptive", "adaptive_nobias",
                      "gradient_gate", "fresh", "ppo_epochs"}
  assert len(specs) == 9 * 3
  o = {a: dict(s.overrides) for a, s in specs.items()}
  assert o["adaptive_lr3x"]["buffer.positive_fraction"] == 0.5
  assert "buffer.positive_fraction" not in o["adaptive_nobias_lr3x"]
  assert o["adaptive_nobias_lr3x"]["buffer.reuse_control"] == "adaptive"
  assert o["gradient_gate_lr1x"]["buffer.reuse_control"] == "gradient_gate"
  assert o["gradient_gate_lr1x"]["buffer.on_policy"] is True
  assert (o["fresh_lr10x"]["buffer.fresh_tau"], o["fresh_lr10x"]["buffer.fresh_base"],
          o["fresh_lr10x"]["buffer.fresh_alpha"]) == (500.0, "reward", 0.6)
  assert (o["ppo_epochs_lr1x"]["trainer.ppo_epochs"], o["ppo_epochs_lr1x"]["trainer.ppo_minibatches"]
          ) == (2, 2)
  assert o["ppo_epochs_lr1x"]["total_steps"] == 2 * 1568 + 1  # half-step updates fit the budget
  assert plan["arms"]["fresh_lr3x"]["baseline"] == "onpolicy_lr3x"
  for a in ("adaptive_lr1x", "adaptive_nobias_lr1x", "gradient_gate_lr1x", "fresh_lr1x",
            "ppo_epochs_lr1x"):
    c = runner.load_config(specs[a].config)
    sweeps.apply(c, specs[a].overrides)
    validation.validate_config(c)


def test_the_running_sweeps_pareto_runs_keep_their_args():
  """The pareto runs launched from 1af36df (4 families x 3 rates x seeds 0-1; their args as its
  plan recorded them, `fixtures/pareto_1af36df_args.json`) are planned with exactly those args
  by today's code: `runner._check_spec` accepts their directories and `execute` skips the finished
  ones, so they stay valid beside the newest families."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  with open(os.path.join(os.path.dirname(__file__), "fixtures", "pareto_1af36df_args.json")) as f:
    pinned = json.load(f)["runs"]
  assert len(pinned) == 24
  planned = {s.rel_dir: s.args() for s in runner.plan_sweep(sweeps.SWEEPS["pareto"], 2)["specs"]}
  assert {rel: planned.get(rel) for rel in pinned} == pinned


def test_the_multiplication_sweep():
  """`--sweep=pareto_multiplication` (issue 37 item 3): on-policy, posbias, adaptive,
  adaptive_nobias, gradient_gate and fresh at 1x / 3x / 10x the second task's rate, 200 on-policy
  updates of its large-batch config, its own buckets (not the scratchpad's)."""
  sw = sweeps.SWEEPS["pareto_multiplication"]
  assert sw.config == "configs/multiplication_large_batch.py" and sw.min_seeds == 4
  plan = runner.plan_sweep(sw, 1)
  base = runner.load_config(sw.config)
  assert plan["budget"] == pytest.approx(base.compute_budget)  # 200 updates of 125.4 s
  assert {a["family"] for a in plan["arms"].values()} == set(sweeps.MULTIPLICATION_FAMILIES)
  lr = base.trainer.learning_rate
  for spec in plan["specs"]:
    o = dict(spec.overrides)
    assert "trainer.buckets" not in o and o["eval.pass1_problems"] == 0
    factor = plan["arms"][spec.arm]["tags"]["lr_factor"]
    assert o["trainer.learning_rate"] == pytest.approx(factor * lr, rel=1e-3)
    c = runner.load_config(spec.config)
    sweeps.apply(c, spec.overrides)
    validation.validate_config(c)


@pytest.mark.parametrize("name", ["pareto", "pareto_multiplication"])
def test_the_dense_sweeps_are_the_decisive_sweeps_runs_with_a_refined_grid(name):
  """`--sweep=<name>_dense` (issue 37 item 4): each of its runs has exactly the args of the same
  arm and seed of the decisive sweep plus the three eval.refine_* keys (refinement changes no
  update: tests/integration), its arms are the on-policy and FreshPER ones, its targets the
  decisive sweep's, fixed."""
  dense = runner.plan_sweep(sweeps.SWEEPS[f"{name}_dense"], 2)
  decisive = runner.plan_sweep(sweeps.SWEEPS[name], 2)
  assert dense["targets"] == list(sweeps.DENSE_TARGETS[name]) and "targets" not in decisive
  assert {a["family"] for a in dense["arms"].values()} == {"onpolicy", "fresh"}
  assert len(dense["arms"]) == 6 and dense["baseline"] == decisive["baseline"]
  same = {(s.arm, s.seed): dict(s.overrides) for s in decisive["specs"]}
  for spec in dense["specs"]:
    o = dict(spec.overrides)
    assert o.pop("eval.refine_levels") == sweeps.DENSE_TARGETS[name]
    assert o.pop("eval.refine_band") == sweeps.DENSE_BANDS[name]
    assert o.pop("eval.refine_splits") == 4
    assert o == same[(spec.arm, spec.seed)]
    assert spec.rel_dir.startswith(f"runs/{name}_dense/")
    c = runner.load_config(spec.config)
    sweeps.apply(c, spec.overrides)
    validation.validate_config(c)


def test_a_tasks_decisive_sweep_from_a_config_and_families():
  """`pareto_task` (the second task's sweep, registered in one line once its config exists),
  built here on the scratchpad's large-batch config."""
  sw = sweeps.pareto_task("scratch", sweeps.LARGE_BATCH_CONFIG,
                          ("onpolicy", "posbias", "adaptive", "adaptive_nobias", "gradient_gate"))
  assert sw.name == "pareto_scratch" and sw.baseline == "onpolicy_lr1x" and sw.figure == "pareto"
  assert [a.name for a in sw.arms][:4] == ["onpolicy_lr1x", "onpolicy_lr3x", "onpolicy_lr10x",
                                           "posbias_lr1x"]
  assert len(sw.arms) == 15 and sw.budget == 200 * (1 + 6.84) * 16
  assert ("trainer.buckets", (48, 56, 64)) not in sw.protocol  # the scratchpad's own bucket
  plan = runner.plan_sweep(sw, 2)
  assert len(plan["specs"]) == 30 and plan["grid"][-1] == sw.budget
  assert {plan["arms"][a]["family"] for a in plan["arms"]} == {
      "onpolicy", "posbias", "adaptive", "adaptive_nobias", "gradient_gate"}
  with pytest.raises(ValueError, match="need 'onpolicy'"):
    sweeps.pareto_task("x", sweeps.LARGE_BATCH_CONFIG, ("posbias",))
  with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
    sweeps.pareto_task("x", sweeps.LARGE_BATCH_CONFIG, ("onpolicy", "nope"))
  with pytest.raises(FileNotFoundError, match="not found"):
    sweeps.pareto_task("x", "configs/no_such_config.py", ("onpolicy",))
def test_the_multiturn_sweep():
  """Issue 38: on-policy vs replay on configs/multiturn.py, 3 seeds, one budget of 80 on-policy
  updates of that config; the sweep's evaluation protocol on every run, which keeps the
  multi-turn task (one sampler call per prompt request, its environment)."""
  sweep = sweeps.SWEEPS["multiturn"]
  assert sweeps.get("multiturn") == [sweep]
  assert sweep.config == "configs/multiturn.py" and sweep.min_seeds == 3
  assert [(a.name, a.family) for a in sweep.arms] == [("onpolicy", "onpolicy"),
                                                      ("replay", "replay")]
  plan = runner.plan_sweep(sweep, sweep.min_seeds)
  base = runner.load_config("configs/multiturn.py")
  assert plan["budget"] == 80 * sweeps.update_seconds(base)
  assert len(plan["grid"]) == 8 + 1 and plan["grid"][1] == pytest.approx(plan["budget"] / 32)
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
