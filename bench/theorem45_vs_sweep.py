"""Theorem 4.5's predicted design beside the synchronous sweep's empirical optimum (like Fig. 6).

  python bench/theorem45_vs_sweep.py --results experiments/results.json \
      --probe bench/results/scratchpad/probe_sigma.json --out bench/results

The prediction: N/R = x*, B/R = y* of Theorem 4.5 at the runs' mu, for rho in {0.1, 1}, from the
gradient-noise probe's sigma(x) (`bench/probe_sigma.py`: the power-law fit of App. 9.3.2 and the
measured curve). The empirical side: `sync_grid` of `python -m jaxreplay.experiments` (the
synchronous schedule at N/R in {1, 2, 4, 8} x B/R in {1, 2, 4}, every arm to the same compute
budget), scored by the median over seeds of (a) held-out pass@1 at the budget and (b) the mean pass@1
over the compute grid (the area under the accuracy-compute curve divided by the budget, which
rewards getting there early). Writes DIR/theorem45_vs_sweep.json and .png; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

import numpy as np

PRIMARY = "eval/pass@1"


def grid_cells(results: dict[str, Any], sweep: str = "sync_grid") -> list[dict[str, Any]]:
  """[{"arm", "N/R", "B/R", "seeds", "final": median, "final_q25", "final_q75", "mean_over_grid"}]
  of the sweep's finished arms."""
  sw = results["sweeps"].get(sweep)
  if sw is None:
    raise ValueError(f"{sweep} is not in the results (run python -m jaxreplay.experiments "
                     f"--sweep={sweep} first)")
  cells = []
  for arm, s in sw["summary"]["arms"].items():
    tags = sw["arms"][arm]["tags"]
    final = s["final"][PRIMARY]
    med = [v for v in s["grid"][PRIMARY]["median"]]
    means = None
    if all(v is not None for v in med):
      grid = np.asarray(sw["summary"]["grid"], np.float64)
      means = float(np.trapezoid(np.asarray(med), grid) / grid[-1])
    cells.append({"arm": arm, "N/R": tags["N/R"], "B/R": tags["B/R"], "seeds": len(s["seeds"]),
                  "final": final["median"], "final_q25": final["q25"], "final_q75": final["q75"],
                  "mean_over_grid": means})
  return cells


def best(cells: list[dict[str, Any]], key: str) -> Optional[dict[str, Any]]:
  ok = [c for c in cells if c[key] is not None]
  return max(ok, key=lambda c: c[key]) if ok else None


def predictions(probe: dict[str, Any]) -> list[dict[str, Any]]:
  """[{"rho", "mu", "method", "x_star", "y_star"}] from the probe's design table."""
  out = []
  for row in probe.get("design", []):
    for method in ("power_law", "measured_max", "measured_mean"):
      d = row.get(method)
      if isinstance(d, dict) and isinstance(d.get("x_star"), (int, float)):
        out.append({"rho": row["rho"], "mu": row["mu"], "method": method,
                    "x_star": float(d["x_star"]), "y_star": float(d["y_star"])})
  return out


def plot(cells, preds, best_final, best_mean, alpha, path: str) -> None:
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7.5, 5.0), layout="constrained")
  ax = fig.subplots()
  xs = np.array([c["N/R"] for c in cells])
  ys = np.array([c["B/R"] for c in cells])
  zs = np.array([np.nan if c["final"] is None else c["final"] for c in cells])
  sc = ax.scatter(xs, ys, c=zs, s=500, cmap="viridis", marker="s")
  for c in cells:
    if c["final"] is not None:
      ax.annotate(f"{c['final']:.3f}", (c["N/R"], c["B/R"]), ha="center", va="center",
                  fontsize="x-small", color="w")
  fig.colorbar(sc, ax=ax, label="held-out pass@1 (T=0.1) at the budget, median over seeds")
  markers = {"power_law": "o", "measured_max": "^", "measured_mean": "v"}
  colors = {0.1: "tab:red", 1.0: "tab:orange"}
  for p in preds:
    ax.scatter([p["x_star"]], [p["y_star"]], marker=markers[p["method"]], s=70, facecolors="none",
               edgecolors=colors.get(p["rho"], "k"), linewidths=1.8,
               label=f"predicted, rho={p['rho']:g}, {p['method'].replace('_', ' ')}")
  for b, name, m in ((best_final, "best at the budget", "*"),
                     (best_mean, "best mean over the grid", "P")):
    if b is not None:
      ax.scatter([b["N/R"]], [b["B/R"]], marker=m, s=160, color="k", label=f"empirical: {name}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("N/R (buffer size / rollouts generated per step)")
  ax.set_ylabel("B/R (batch size / rollouts generated per step)")
  ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.25, 1.0))
  fig.suptitle(f"Theorem 4.5's optimal design (probe alpha = {alpha:.3f}) vs the synchronous "
               "sweep", fontsize="medium")
  fig.savefig(path, format="png", dpi=110, metadata={"Software": None})


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--results", default="experiments/results.json")
  ap.add_argument("--probe", default="bench/results/scratchpad/probe_sigma.json")
  ap.add_argument("--out", default="bench/results")
  a = ap.parse_args()
  with open(a.results, encoding="utf-8") as f:
    results = json.load(f)
  with open(a.probe, encoding="utf-8") as f:
    probe = json.load(f)
  cells = grid_cells(results)
  preds = predictions(probe)
  b_final, b_mean = best(cells, "final"), best(cells, "mean_over_grid")
  print(f"{'arm':10s} {'N/R':>5s} {'B/R':>5s} {'seeds':>5s} {'final':>7s} {'mean':>7s}")
  for c in sorted(cells, key=lambda c: (c["N/R"], c["B/R"])):
    fmt = lambda v: "      -" if v is None else f"{v:7.3f}"
    print(f"{c['arm']:10s} {c['N/R']:5g} {c['B/R']:5g} {c['seeds']:5d} {fmt(c['final'])} "
          f"{fmt(c['mean_over_grid'])}")
  for p in preds:
    print(f"predicted rho={p['rho']:g} {p['method']:13s}: x* = N/R = {p['x_star']:.2f}, "
          f"y* = B/R = {p['y_star']:.2f}")
  for name, b in (("at the budget", b_final), ("mean over the grid", b_mean)):
    if b is not None:
      print(f"empirical best {name}: N/R = {b['N/R']:g}, B/R = {b['B/R']:g} ({b['arm']})")
  os.makedirs(a.out, exist_ok=True)
  alpha = float(probe.get("fit", {}).get("alpha", float("nan")))
  record = {"results": a.results, "probe": a.probe, "alpha": alpha, "cells": cells,
            "predictions": preds, "best_final": b_final, "best_mean_over_grid": b_mean,
            "command": "python bench/theorem45_vs_sweep.py --results {} --probe {} --out {}".format(
                a.results, a.probe, a.out)}
  with open(os.path.join(a.out, "theorem45_vs_sweep.json"), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1)
  plot(cells, preds, b_final, b_mean, alpha, os.path.join(a.out, "theorem45_vs_sweep.png"))
  print(f"wrote {os.path.join(a.out, 'theorem45_vs_sweep.json')} and .png")


if __name__ == "__main__":
  main()
