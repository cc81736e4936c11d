"""The sweep figures (`science.plots`) from a results.json-shaped dict: the compute-to-target figure
of issue 37 (one line per family with its interval band, the 1.0 and 0.6 lines) is written, with
its title and axes in words; sweeps without families get none."""
import os
import warnings

import numpy as np

from jaxreplay.science import plots
from jaxreplay.science import families as fm
from jaxreplay.science import stats as st


def _sweep(families=(("onpolicy", 1.0), ("replay", 1.6)), rates=((1e-5, 0.8), (3e-5, 1.0))):
  """Families x rates x 3 seeds of straight-line curves (by default two of each, replay 1.6x
  faster)."""
  xs = np.linspace(0.0, 100.0, 11)
  curves, plan = {}, {}
  for fam, speed in families:
    for lr, scale in rates:
      arm = f"{fam}_{lr:g}"
      curves[arm] = {s: [{"compute_seconds": float(x),
                          "eval/pass@1": float(0.2 + 0.003 * speed * scale * (1 + 0.05 * s) * x)}
                         for x in xs] for s in range(3)}
      plan[arm] = {"family": fam, "overrides": [["trainer.learning_rate", lr]],
                   "baseline": "onpolicy_3e-05", "tags": {}}
  summ = st.sweep_summary(curves, {}, list(xs), {a: v["baseline"] for a, v in plan.items()},
                          "onpolicy_3e-05")
  fams = fm.family_summary(summ["arms"], plan)
  targets = fm.add_compute_to_target(fams, curves, "onpolicy")
  fm.add_frontier_to_target(fams, curves, plan, "onpolicy", targets)
  summ["families"] = fams
  summ["family_targets"] = {"baseline_family": "onpolicy", "targets": targets,
                            "rule": st.TARGET_RULE}
  return {"budget": 100.0, "arms": plan, "summary": summ, "figure": "pareto", "_runs": []}


def test_compute_to_target_figure_is_written(tmp_path):
  sweep = _sweep()
  fams = sweep["summary"]["families"]
  assert fams["replay"]["best_arm"] == "replay_3e-05" and fams["replay"]["bracketed"] is False
  ratios = [e["ratio"] for e in fams["replay"]["compute_to_target"]]
  assert len(ratios) == 4 and all(abs(r - 1 / 1.6) < 1e-9 for r in ratios)
  words = {"pass1": "pass@1 (T=0.1, top-p 0.95)", "passk": "T=1, top-p 0.95",
           "problems": "1024 held-out problems", "pass1_problems": "1024 held-out problems"}
  path = plots.plot_compute_to_target("pareto", sweep, str(tmp_path / "c.png"), words)
  assert path and os.path.getsize(path) > 10_000
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  written = plots.plot_sweep("pareto", sweep, str(tmp_path / "figs"))
  assert str(tmp_path / "figs" / "pareto_compute_to_target.png") in written
  assert str(tmp_path / "figs" / "pareto_frontier_to_target.png") in written
  sweep["summary"]["families"] = {}
  assert plots.plot_compute_to_target("pareto", sweep, str(tmp_path / "d.png"), words) is None


def test_the_compute_to_target_axis_names_the_problems_pass1_was_measured_on():
  # issue 26's pareto: pass@1 on the first 256 of 1024 problems between the full evaluations
  assert plots._pass1_problems({"num_problems": 1024, "pass1_problems": 256}) == (
      "256 held-out problems (1024 at the start and end)")
  assert plots._pass1_problems({"num_problems": 1024, "pass1_problems": 0}) == (
      "1024 held-out problems")
  assert plots._pass1_problems({"num_problems": 64, "pass1_problems": 64}) == "64 held-out problems"


def test_a_sweep_of_27_arms_gets_one_legend_below_and_no_layout_warning(tmp_path):
  # the issue-37 pareto sweep: 9 families x 3 rates; its legend inside a panel collapsed the axes
  # ("constrained_layout not applied") and covered the curves, and tab10 reused colors across arms
  names = ["onpolicy", "replay", "posbias", "maxuses2", "adaptive", "adaptive_nobias",
           "gradient_gate", "fresh", "ppo_epochs"]
  sweep = _sweep(tuple((n, 1.0 + 0.1 * i) for i, n in enumerate(names)),
                 ((1e-5, 0.8), (3e-5, 1.0), (1e-4, 1.1)))
  styles = plots._arm_styles(sweep)
  assert len(styles) == 27
  for n in names:
    members = [styles[f"{n}_{lr:g}"] for lr in (1e-5, 3e-5, 1e-4)]
    assert len({m["color"] for m in members}) == 1  # one color per family
    assert len({str(m["linestyle"]) for m in members}) == 3  # one line style per rate
  assert len({styles[f"{n}_1e-05"]["color"] for n in names}) == 9
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    written = plots.plot_sweep("pareto", sweep, str(tmp_path))
  assert {os.path.basename(p) for p in written} >= {
      "pareto_accuracy.png", "pareto_pareto.png"}
  fig, axes = plots._new_figure(2)
  for ax in axes:
    for i in range(27):
      ax.plot([0, 1], [i, i], label=f"arm {i}")
  plots._legend(fig, axes)
  assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
  assert len(fig.legends[0].get_texts()) == 27 and fig.get_figheight() > 4.0
  fig, axes = plots._new_figure(1)
  axes[0].plot([0, 1], [0, 1], label="one arm")
  plots._legend(fig, axes)
  assert not fig.legends and axes[0].get_legend() is not None
