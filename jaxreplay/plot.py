"""Plots metrics of one or several runs against compute (or steps): the paper's Figure 1 shape.

  python -m jaxreplay.plot --runs runs/replay_s0,runs/onpolicy_s0 --x compute_seconds \
      --y eval/pass@1,reward_mean --out fig.png
  python -m jaxreplay.plot --runs 'runs/*' --group '(.*)_s\\d+' --out fig.png   # median + IQR

One panel per y metric, one line per run (label = the run directory's name, with as many parent
directories as tell the runs apart: `pareto/replay_lr1x/seed0`) or, with `--group`, one
line per group of runs whose names give the same regex match (its first group when it has one):
the median over the group's runs with the inter-quartile band, on a common x grid (the overlap of
the runs' x ranges) by linear interpolation.

Axes are labelled in words with their units (`axis_label`: "compute (device-seconds)", "held-out
pass@1 (T=0.1)", the temperature read from the runs' run_config.json); each panel has a title. A
noisy per-step metric (`reward_mean` and the other training-batch means, `SMOOTHED`) is drawn as
faint raw points under an exponential moving average (`ema`, its span stated in the legend).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Optional, Sequence

import numpy as np

from jaxreplay.infra.metric_writers import read_metrics


# metric -> (words, unit or None); "{t1}" / "{tk}" are the evaluation temperatures of the runs.
_LABELS = {
    "compute_seconds": ("compute", "device-seconds"),
    "sim/compute_seconds": ("simulated compute", "device-seconds"),
    "compute/flops": ("compute", "FLOPs"),
    "compute/generation_seconds": ("generation compute", "device-seconds"),
    "compute/training_seconds": ("training compute", "device-seconds"),
    "step": ("training step", None),
    "time/wall_s": ("wall-clock time", "s"),
    "tokens": ("training tokens", "tokens"),
    "eval/pass@1": ("held-out pass@1", "T={t1}"),
    "eval/pass@1_t1": ("held-out pass@1", "T={tk}"),
    "eval/reward_mean": ("held-out reward", "mean over samples, T={t1}"),
    "reward_mean": ("reward", "mean over the batch"),
    "batch/reward_mean": ("reward of the trained batch", "mean over the batch"),
    "loss": ("training loss", "per token"),
    "entropy": ("entropy", "nats per token"),
    "grad_norm": ("gradient norm", "global L2"),
    "learning_rate": ("learning rate", None),
}
# Per-step training metrics noisy enough to be drawn as faint points under a smoothed line.
SMOOTHED = ("reward_mean", "batch/reward_mean", "loss", "pg_loss", "entropy", "grad_norm",
            "advantage_mean")
EMA_SPAN = 20  # rows; the EMA's alpha = 2 / (span + 1)


def eval_temperatures(run_dirs: Sequence[str]) -> dict[str, str]:
  """{"t1", "tk"}: eval.temperature_pass1 / temperature_passk of the runs' run_config.json ("?"
  when absent; "mixed" when the runs disagree)."""
  found: dict[str, set] = {"t1": set(), "tk": set()}
  for d in run_dirs:
    try:
      with open(os.path.join(d, "run_config.json")) as f:
        ev = json.load(f).get("eval", {})
    except (OSError, ValueError, AttributeError):
      continue
    for key, name in (("t1", "temperature_pass1"), ("tk", "temperature_passk")):
      if isinstance(ev.get(name), (int, float)):
        found[key].add(float(ev[name]))
  return {k: (f"{next(iter(v)):g}" if len(v) == 1 else "mixed" if v else "?")
          for k, v in found.items()}


def axis_label(metric: str, temperatures: Optional[dict] = None) -> str:
  """`metric` in words with its unit: "compute (device-seconds)", "held-out pass@1 (T=0.1)", ...;
  an unknown metric is named as is (its "/" shown as ": ")."""
  words, unit = _LABELS.get(metric, (metric.replace("/", ": "), None))
  if unit is not None:
    unit = unit.format(**{"t1": "?", "tk": "?", **(temperatures or {})})
  return f"{words} ({unit})" if unit else words


def ema(y: np.ndarray, span: int = EMA_SPAN) -> np.ndarray:
  """Bias-corrected exponential moving average of `y` (alpha = 2 / (span + 1)): the first value is
  y[0], not pulled towards 0."""
  y = np.asarray(y, np.float64)
  alpha = 2.0 / (span + 1.0)
  out = np.empty_like(y)
  num = den = 0.0
  for i, v in enumerate(y):
    num = (1 - alpha) * num + alpha * v
    den = (1 - alpha) * den + alpha
    out[i] = num / den
  return out


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
  if pattern is None:  # each run alone, named by the fewest trailing path parts that tell it apart
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
      labels = ["/".join(p[-depth:]) for p in parts]
      if len(set(labels)) == len(labels):
        break
    return {label: [d] for label, d in zip(labels, run_dirs)}
  for d in run_dirs:
    name = os.path.basename(os.path.normpath(d))
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

  Returns what was drawn: {y: {label: {"x", "median", "q25", "q75"}}} (float64 arrays), plus
  "smoothed" (the EMA drawn over the faint raw points) for the metrics in `SMOOTHED`.
  """
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)

  if not run_dirs:
    raise ValueError("plot_runs: no run directories")
  groups = group_runs(run_dirs, group)
  drawn: dict[str, dict[str, dict[str, np.ndarray]]] = {}
  fig = Figure(figsize=(5.5 * len(ys), 4.0), layout="constrained")
  axes = fig.subplots(1, len(ys), squeeze=False)[0]
  temps = eval_temperatures(run_dirs)
  for ax, y in zip(axes, ys):
    drawn[y] = {}
    smooth = y in SMOOTHED
    for label, dirs in groups.items():
      agg = aggregate([load_series(d, x, y) for d in dirs])
      if not len(agg["x"]):
        continue
      drawn[y][label] = agg
      suffix = f" (n={len(dirs)})" if len(dirs) > 1 else ""
      if smooth:
        raw, = ax.plot(agg["x"], agg["median"], linestyle="none", marker=".", markersize=3,
                       alpha=0.25)
        agg["smoothed"] = ema(agg["median"])
        ax.plot(agg["x"], agg["smoothed"], color=raw.get_color(),
                label=f"{label}{suffix}: EMA over {EMA_SPAN} points (raw faint)")
        color = raw.get_color()
      else:
        line, = ax.plot(agg["x"], agg["median"], label=label + suffix,
                        marker="o" if len(agg["x"]) <= 30 else None, markersize=3)
        color = line.get_color()
      if len(dirs) > 1:
        ax.fill_between(agg["x"], agg["q25"], agg["q75"], color=color, alpha=0.1 if smooth else 0.2)
    ax.set_xlabel(axis_label(x, temps))
    ax.set_ylabel(axis_label(y, temps))
    ax.set_title(f"{axis_label(y, temps).split(' (')[0]} vs {axis_label(x, temps).split(' (')[0]}"
                 + (" (median and IQR over seeds)" if any(len(d) > 1 for d in groups.values())
                    else ""), fontsize="medium")
    ax.grid(alpha=0.3)
    if drawn[y]:
      ax.legend(fontsize="small")
  if not any(drawn.values()):
    raise ValueError(f"no run has rows with both {x!r} and any of {list(ys)}")
  if not title:
    names = list(groups)
    title = "runs: " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                               else "")
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
