"""The eval grid's refinement rule replayed on finished runs: how often it refines, and which target
crossings it would leave between two unrefined grid points.

  python bench/refine_replay.py --sweeps pareto_multiplication pareto --out bench/results

For each run of a decisive (coarse-grid) sweep under experiments/runs/<sweep>/, its own evaluations
(compute [device-s], pass@1) at the configured grid points are fed to `EvalGrid.observe` with the
sweep's dense targets and band (`science.sweeps.DENSE_TARGETS` / `DENSE_BANDS`), once per
`eval.refine_lookahead` value. The points a refinement adds are dropped again (the coarse run did not
evaluate them), so each evaluation reads "would the interval ahead have been split". A crossing is
a target between two consecutive evaluations; the first crossing of each target in a run is the one
compute to target reads. Prints a table and writes DIR/refine_replay.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_io import write_json  # noqa: E402
from jaxreplay.run.eval_grid import EvalGrid  # noqa: E402
from jaxreplay.science import sweeps  # noqa: E402


def replay_run(record: dict[str, Any], levels: Sequence[float], band: float,
               lookahead: float) -> dict[str, int]:
  """{"intervals", "refined", "first_crossings", "first_missed"} of one run's record.json."""
  points = record["run_config"]["eval"]["compute_grid"]
  evals = [(c["compute_seconds"], c["eval/pass@1"]) for c in record["curve"] if "eval/pass@1" in c]
  grid = EvalGrid(points, refine_levels=levels, refine_band=band, refine_lookahead=lookahead)
  grid.start()
  refined = [bool(grid.observe(evals[0][1], evals[0][0]))]
  for step, (compute, pass1) in enumerate(evals[1:], 1):
    grid.due(step, False, lambda compute=compute: compute)
    refined.append(bool(grid.observe(pass1, compute)))
    grid.points = [x for x in grid.points if x in grid.base_points]  # not evaluated in this run
    grid.next = sum(1 for x in grid.points if x <= compute)
  out = dict(intervals=len(evals) - 1, refined=sum(refined[:-1]), first_crossings=0,
             first_missed=0)
  for level in levels:
    for i in range(len(evals) - 1):
      if evals[i][1] < level <= evals[i + 1][1]:
        out["first_crossings"] += 1
        out["first_missed"] += not refined[i]
        break
  return out


def replay_sweep(runs_dir: str, sweep: str, lookaheads: Sequence[float]) -> list[dict[str, Any]]:
  """One row per lookahead: the counts summed over the sweep's finished runs."""
  files = sorted(glob.glob(os.path.join(runs_dir, sweep, "*", "seed*", "record.json")))
  if not files:
    raise SystemExit(f"no finished runs under {os.path.join(runs_dir, sweep)}: run python -m "
                     f"jaxreplay.experiments --sweep={sweep} first, or pass --runs")
  records = [json.load(open(f)) for f in files]
  rows = []
  for lookahead in lookaheads:
    total = dict(intervals=0, refined=0, first_crossings=0, first_missed=0)
    for r in records:
      for k, v in replay_run(r, sweeps.DENSE_TARGETS[sweep], sweeps.DENSE_BANDS[sweep],
                             lookahead).items():
        total[k] += v
    rows.append(dict(sweep=sweep, lookahead=lookahead, runs=len(records), **total))
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sweeps", nargs="+", default=["pareto_multiplication", "pareto"],
                 choices=sorted(sweeps.DENSE_TARGETS))
  p.add_argument("--lookaheads", nargs="+", type=float, default=[0.0, 2.0, 3.0, 4.0])
  p.add_argument("--runs", default=os.path.join("experiments", "runs"))
  p.add_argument("--out", default=os.path.join("bench", "results"))
  a = p.parse_args(argv)
  rows = [row for s in a.sweeps for row in replay_sweep(a.runs, s, a.lookaheads)]
  print(f"{'sweep':<24}{'lookahead':>10}{'runs':>6}{'intervals':>10}{'refined':>9}"
        f"{'1st crossings':>15}{'in unrefined':>14}")
  for r in rows:
    print(f"{r['sweep']:<24}{r['lookahead']:>10.1f}{r['runs']:>6}{r['intervals']:>10}"
          f"{r['refined']:>9}{r['first_crossings']:>15}{r['first_missed']:>14}")
  command = " ".join(["python bench/refine_replay.py", *(sys.argv[1:] if argv is None else argv)])
  write_json(a.out, "refine_replay.json", {"command": command, "rows": rows})


if __name__ == "__main__":
  main()
