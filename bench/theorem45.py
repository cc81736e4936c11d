"""Theorem 4.5's optimal synchronous design against mu, like the paper's Fig. 6.

Synchronous setting (PAPER.md, "Theory (Section 4, Appendix 9)"): each step generates R rollouts into
a FIFO buffer of N and trains on a minibatch of B; one update costs B + mu*R (units: training on one
rollout). For sigma(x) = (x/tau)^alpha the theorem's optimum is
  x* = N/R = argmin_x x^(2 alpha) (sqrt(1/mu) + sqrt(rho + 1/x))^2,   y* = B/R = sqrt(mu / (rho + 1/x*)),
computed twice: numerically (`design.optimal_design`) and by App. 9.3.2's closed form
(`design.power_law_design`), for mu in [1, 10], rho in {0.1, 1}, alpha in {0.1, 0.2}.
y* is also the replay ratio (a rollout stays x* steps and is drawn with probability y*/x* per step).

Prints a table at a few mu (the paper's measured 5.28 and 6.84 included) and writes
DIR/theorem45.json (every curve, the table, the largest numeric/closed-form gap) and
DIR/theorem45.png (x*, y* and B/N = y*/x* against mu; lines: closed form, markers: numeric).

  python bench/theorem45.py [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxreplay.science import design  # pylint: disable=g-import-not-at-top

RHOS = (0.1, 1.0)
ALPHAS = (0.1, 0.2)
TABLE_MUS = (1.0, 2.0, 5.28, 6.84, 10.0)


def curves(mus: np.ndarray) -> list[dict]:
  """x*, y* against mu for each (rho, alpha): numeric and closed form, lists of floats [len(mus)]."""
  out = []
  for rho in RHOS:
    for alpha in ALPHAS:
      sigma2 = lambda x, a=alpha: x ** (2 * a)  # tau = 1: tau cancels from the argmin
      num = np.array([design.optimal_design(float(mu), rho, sigma2) for mu in mus])
      closed = np.array([design.power_law_design(float(mu), rho, alpha) for mu in mus])
      out.append({
          "rho": rho, "alpha": alpha, "mu": mus.tolist(),
          "x_star_numeric": num[:, 0].tolist(), "y_star_numeric": num[:, 1].tolist(),
          "x_star_closed_form": closed[:, 0].tolist(), "y_star_closed_form": closed[:, 1].tolist(),
          "max_rel_gap": float(np.max(np.abs(num / closed - 1.0))),
      })
  return out


def table(rows_mu=TABLE_MUS) -> list[dict]:
  """One row per (rho, alpha, mu): x*, y*, B/N and whether the design fits a FIFO (N >= R, B <= N)."""
  rows = []
  for rho in RHOS:
    for alpha in ALPHAS:
      for mu in rows_mu:
        x_n, y_n = design.optimal_design(mu, rho, lambda x, a=alpha: x ** (2 * a))
        x_c, y_c = design.power_law_design(mu, rho, alpha)
        rows.append({"rho": rho, "alpha": alpha, "mu": mu, "x_star": x_c, "y_star": y_c,
                     "x_star_numeric": x_n, "y_star_numeric": y_n,
                     "rel_gap": max(abs(x_n / x_c - 1), abs(y_n / y_c - 1)),
                     "b_over_n": y_c / x_c, "n_ge_r": x_c >= 1.0, "b_le_n": y_c <= x_c})
  return rows


def plot(data: list[dict], path: str) -> None:
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)

  fig = Figure(figsize=(16.0, 4.6), layout="constrained")
  ax_x, ax_y, ax_r = fig.subplots(1, 3)
  colors = {(0.1, 0.1): "tab:blue", (0.1, 0.2): "tab:orange", (1.0, 0.1): "tab:green",
            (1.0, 0.2): "tab:red"}
  for c in data:
    color = colors[(c["rho"], c["alpha"])]
    label = f"rho = {c['rho']:g}, alpha = {c['alpha']:g}"
    mu = np.array(c["mu"])
    xc, yc = np.array(c["x_star_closed_form"]), np.array(c["y_star_closed_form"])
    xn, yn = np.array(c["x_star_numeric"]), np.array(c["y_star_numeric"])
    for ax, closed, num in ((ax_x, xc, xn), (ax_y, yc, yn), (ax_r, yc / xc, yn / xn)):
      ax.plot(mu, closed, color=color, label=label + " (closed form)")
      ax.plot(mu[::6], num[::6], "o", color=color, mfc="none", label=label + " (numeric)")
  ax_x.axhline(1.0, color="gray", ls=":", lw=1)
  ax_x.text(1.05, 1.05, "N = R", color="gray", fontsize="small", va="bottom")
  ax_r.axhline(1.0, color="gray", ls=":", lw=1)
  ax_r.text(4.5, 1.02, "B = N (above: batch larger than buffer)", color="gray", fontsize="small",
            va="bottom")
  ax_x.set(title="Optimal buffer size per generated rollouts, N/R = x*",
           xlabel="mu (generation cost / training cost per rollout)", ylabel="x* = N/R", yscale="log")
  ax_y.set(title="Optimal batch size per generated rollouts, B/R = y* (replay ratio)",
           xlabel="mu (generation cost / training cost per rollout)", ylabel="y* = B/R")
  ax_r.set(title="Fraction of the buffer sampled per step, B/N = y*/x*",
           xlabel="mu (generation cost / training cost per rollout)", ylabel="B/N")
  for ax in (ax_x, ax_y, ax_r):
    ax.grid(alpha=0.3)
  ax_y.legend(fontsize="x-small", ncol=1)
  fig.suptitle("Theorem 4.5: optimal synchronous design for gradient noise sigma(x) = (x/tau)^alpha "
               "(lines: App. 9.3.2 closed form; circles: numeric argmin)")
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results"),
                      help="directory for theorem45.json and theorem45.png")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  mus = np.round(np.linspace(1.0, 10.0, 91), 10)
  data = curves(mus)
  rows = table()
  print(f"{'rho':>4} {'alpha':>5} {'mu':>5} | {'x*=N/R':>8} {'y*=B/R':>8} {'B/N':>6} | "
        f"{'x* num':>8} {'y* num':>8} {'gap':>8} | N>=R B<=N")
  for r in rows:
    print(f"{r['rho']:4g} {r['alpha']:5g} {r['mu']:5g} | {r['x_star']:8.4f} {r['y_star']:8.4f} "
          f"{r['b_over_n']:6.3f} | {r['x_star_numeric']:8.4f} {r['y_star_numeric']:8.4f} "
          f"{r['rel_gap']:8.1e} | {'yes' if r['n_ge_r'] else 'NO':>4} {'yes' if r['b_le_n'] else 'NO':>4}")
  gap = max(c["max_rel_gap"] for c in data)
  print(f"largest relative gap numeric vs closed form over {len(mus)} mu x {len(data)} settings: "
        f"{gap:.1e}")
  result = {
      "benchmark": "theorem45",
      "description": __doc__.split("\n\n")[1],
      "objective": "x* = argmin_x sigma_bar^2(x) (sqrt(1/mu) + sqrt(rho + 1/x))^2, "
                   "y* = sqrt(mu / (rho + 1/x*)), sigma_bar^2(x) = x^(2 alpha)",
      "closed_form": "y* = (-alpha + sqrt(alpha^2 + mu rho (1 - 2 alpha))) / rho, "
                     "x* = y*^2 / (2 alpha (mu + y*))",
      "max_rel_gap_numeric_vs_closed_form": gap,
      "table": rows,
      "curves": data,
  }
  with open(os.path.join(args.out, "theorem45.json"), "w") as f:
    json.dump(result, f, indent=2)
  plot(data, os.path.join(args.out, "theorem45.png"))
  print(f"wrote {os.path.join(args.out, 'theorem45.json')} and theorem45.png")


if __name__ == "__main__":
  main()
