"""The sweep figures (`science.plots`) from a results.json-shaped dict: the compute-to-target figure
of issue 37 (one line per family with its interval band, the 1.0 and 0.6 lines) is written, with
its title and axes in words; sweeps without families get none."""
import os

import numpy as np

from jaxreplay.science import plots
from jaxreplay.science import families as fm
from jaxreplay.science import stats as st


def _sweep():
  """Two families x two rates x 3 seeds of straight-line curves (replay 1.6x faster)."""
  xs = np.linspace(0.0, 100.0, 11)
  curves, plan = {}, {}
  for fam, speed in (("onpolicy", 1.0), ("replay", 1.6)):
    for lr, scale in ((1e-5, 0.8), (3e-5, 1.0)):
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
