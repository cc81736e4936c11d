"""Plots metrics of one or several runs against compute (or steps): the paper's Figure 1 shape.

  python -m jaxreplay.plot --runs runs/replay_s0,runs/onpolicy_s0 --x compute_seconds \
      --y eval/pass@1,reward_mean --out fig.png
  python -m jaxreplay.plot --runs 'runs/*' --group '(.*)_s\\d+' --out fig.png   # median + IQR

One panel per y metric, one line per run (label = the run directory's name) or, with `--group`, one
line per group of runs whose names give the same regex match (its first group when it has one):
the median over the group's runs with the inter-quartile band, on a common x grid (the overlap of
the runs' x ranges) by linear interpolation.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Optional, Sequence

import numpy as np

from jaxreplay.infra.metric_writers import read_metrics


def load_series(run_dir: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
  """float64 ([M], [M]): (x, y) of the rows of run_dir/metrics.jsonl holding both, sorted by x
  (duplicate x keep the last row)."""
  xs, ys = [], []
  for row in read_metrics(run_dir):
    xv, yv = row.get(x), row.get(y)
    if isinstance(xv, (int, float)) and isinstance(yv, (int, float)):
      xs.append(float(xv))
      ys.append(float(yv))
  xs_a, ys_a = np.asarray(xs), np.asarray(ys)
  order = np.argsort(xs_a, kind="stable")
  xs_a, ys_a = xs_a[order], ys_a[order]
  if len(xs_a):
    last = np.r_[xs_a[1:] != xs_a[:-1], True]
    xs_a, ys_a = xs_a[last], ys_a[last]
  return xs_a, ys_a


def group_runs(run_dirs: Sequence[str], pattern: Optional[str]) -> dict[str, list[str]]:
  """{label: run dirs}; each run alone when `pattern` is None."""
  groups: dict[str, list[str]] = {}
  for d in run_dirs:
    name = os.path.basename(os.path.normpath(d))
    if pattern is None:
      label = name
    else:
      m = re.search(pattern, name)
      if m is None:
        raise ValueError(f"--group {pattern!r} does not match run {name!r}")
      label = m.group(1) if m.groups() else m.group(0)
    groups.setdefault(label, []).append(d)
  return groups


def aggregate(series: Sequence[tuple[np.ndarray, np.ndarray]],
              num_points: int = 200) -> dict[str, np.ndarray]:
  """Median and quartiles over runs on a common grid: {"x", "median", "q25", "q75"}, each [K].
  A single run is returned as is (q25 = q75 = median)."""
  series = [(x, y) for x, y in series if len(x)]
  if not series:
    return {k: np.zeros(0) for k in ("x", "median", "q25", "q75")}
  if len(series) == 1:
    x, y = series[0]
    return {"x": x, "median": y, "q25": y, "q75": y}
  lo, hi = max(x[0] for x, _ in series), min(x[-1] for x, _ in series)
  if lo > hi:
    raise ValueError("the runs of a group have disjoint x ranges: nothing to aggregate")
  grid = np.linspace(lo, hi, num_points) if hi > lo else np.array([lo])
  ys = np.stack([np.interp(grid, x, y) for x, y in series])
  q25, med, q75 = np.percentile(ys, [25, 50, 75], axis=0)
  return {"x": grid, "median": med, "q25": q25, "q75": q75}


def plot_runs(run_dirs: Sequence[str], out: str, x: str = "compute_seconds",
              ys: Sequence[str] = ("eval/pass@1",), group: Optional[str] = None,
              title: Optional[str] = None) -> dict[str, dict[str, dict[str, np.ndarray]]]:
  """Draws each metric in `ys` against `x` for the runs in `run_dirs` into the PNG `out`.

  Returns what was drawn: {y: {label: {"x", "median", "q25", "q75"}}} (float64 arrays).
  """
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)

  if not run_dirs:
    raise ValueError("plot_runs: no run directories")
  groups = group_runs(run_dirs, group)
  drawn: dict[str, dict[str, dict[str, np.ndarray]]] = {}
  fig = Figure(figsize=(5.5 * len(ys), 4.0), layout="constrained")
  axes = fig.subplots(1, len(ys), squeeze=False)[0]
  for ax, y in zip(axes, ys):
    drawn[y] = {}
    for label, dirs in groups.items():
      agg = aggregate([load_series(d, x, y) for d in dirs])
      if not len(agg["x"]):
        continue
      drawn[y][label] = agg
      suffix = f" (n={len(dirs)})" if len(dirs) > 1 else ""
      line, = ax.plot(agg["x"], agg["median"], label=label + suffix)
      if len(dirs) > 1:
        ax.fill_between(agg["x"], agg["q25"], agg["q75"], color=line.get_color(), alpha=0.25)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    if drawn[y]:
      ax.legend(fontsize="small")
  if not any(drawn.values()):
    raise ValueError(f"no run has rows with both {x!r} and any of {list(ys)}")
  if title:
    fig.suptitle(title)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, format="png", dpi=120)
  return drawn


def _expand(runs: str) -> list[str]:
  dirs: list[str] = []
  for item in (r.strip() for r in runs.split(",")):
    if not item:
      continue
    matches = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
    dirs.extend(m for m in matches if os.path.isdir(m))
    if not matches or (len(matches) == 1 and not os.path.isdir(matches[0])):
      raise FileNotFoundError(f"run directory {item!r} not found")
  return dirs


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxreplay.plot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", required=True, help="comma-separated run dirs (globs allowed)")
  parser.add_argument("--x", default="compute_seconds", help="x metric (compute_seconds, step, "
                      "compute/flops, ...)")
  parser.add_argument("--y", default="eval/pass@1", help="comma-separated y metrics")
  parser.add_argument("--group", default=None, help="regex on run names: median + IQR per group")
  parser.add_argument("--title", default=None)
  parser.add_argument("--out", required=True, help="output PNG path")
  args = parser.parse_args(argv)
  ys = [y.strip() for y in args.y.split(",") if y.strip()]
  drawn = plot_runs(_expand(args.runs), args.out, x=args.x, ys=ys, group=args.group,
                    title=args.title)
  for y, lines in drawn.items():
    for label, agg in lines.items():
      print(f"{y} | {label}: {len(agg['x'])} points, last {args.x}={agg['x'][-1]:.4g} "
            f"median={agg['median'][-1]:.4g}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
