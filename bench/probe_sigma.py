r"""Gradient noise against staleness: a dedicated, deterministic probe of Theorem 4.5's sigma(x).

  python bench/probe_sigma.py --config=configs/tiny.py --out=bench/results [--quick]
  (any config file; `--config.KEY=VALUE` overrides as for `jaxreplay.launch`)

The method (training, probe, estimates, fit and design) is described in
`jaxreplay/science/noise_probe.py` (the run) and `jaxreplay/science/noise_stats.py` (the statistics);
this script is their command line.

Prints a table and writes DIR/probe_sigma.json and DIR/probe_sigma.png. Runs on one device (the
first of `jax.devices()`) whatever the config's mesh, so results do not depend on the emulated
device count; deterministic for a given config and flags. `--quick` (K = 4, M = 128, B = 2G,
s in {0, 1, 2, 4}) is the end-to-end test's setting.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# pylint: disable=g-import-not-at-top,wrong-import-position
from jaxreplay.science import noise_probe
from jaxreplay.science import noise_stats
# pylint: enable=g-import-not-at-top,wrong-import-position


# ---- output -----------------------------------------------------------------------------------

def table(result: dict) -> str:
  """The printed summary: one line per staleness, the fit and the design."""
  st = result["settings"]
  lines = [f"gradient noise vs staleness: K={st['steps']} on-policy steps, M={st['rollouts']} "
           f"rollouts per staleness in {st['num_minibatches']} minibatches of B={st['minibatch']}",
           "sigma2/rollout: whole-group minibatches ('groups', the fit and design); 'spread': one "
           "rollout per prompt per minibatch",
           f"{'s':>4} {'sigma2/rollout':>14} {'95% CI':>21} {'ratio s=0':>9} {'ratio CI':>15} "
           f"{'spread':>9} {'ratio':>6} {'bias':>8} {'95% CI':>19} {'reward':>6} {'clip':>5}"]
  for r in result["rows"]:
    lo, hi = r["sigma2_ci"]
    rlo, rhi = r["sigma2_ratio_ci"]
    blo, bhi = r["bias_ci"]
    lines.append(f"{r['staleness']:>4d} {r['sigma2']:>14.5g} [{lo:>9.4g}, {hi:>9.4g}] "
                 f"{r['sigma2_ratio_to_s0']:>9.3f} [{rlo:>6.3f}, {rhi:>6.3f}] "
                 f"{r['sigma2_spread']:>9.4g} {r['sigma2_spread_ratio_to_s0']:>6.3f} "
                 f"{r['bias']:>8.3g} [{blo:>7.3g}, {bhi:>7.3g}] "
                 f"{r['reward_mean']:>6.3f} {r.get('clip_fraction_mean', 0.0):>5.3f}")
  for name, key in (("groups", "fit"), ("spread", "fit_spread")):
    f = result[key]
    if f is not None:
      lines.append(f"fit sigma(s) = (s/tau)^alpha on s >= 1 ({name}): alpha = {f['alpha']:.4f} "
                   f"(95% CI {f['alpha_ci'][0]:.4f} .. {f['alpha_ci'][1]:.4f}), tau = "
                   f"{f['tau'] if isinstance(f['tau'], str) else format(f['tau'], '.4g')} steps, "
                   f"R^2 = {f['r2']:.3f}")
  fs = result["fit_shifted"]
  if fs is not None:
    lines.append(f"fit sigma(s+1) on every s: alpha = {fs['alpha']:.4f}, R^2 = {fs['r2']:.3f}")
  lines.append(f"non-decreasing point estimates: {result['monotone']['non_decreasing_point_estimates']}"
               f"; ratio CI above 1 at s = {result['monotone']['ratio_ci_excludes_1_above']}, "
               f"below 1 at s = {result['monotone']['ratio_ci_excludes_1_below']}")
  lines.append(f"Theorem 4.5 at mu = {result['config']['mu']:g}: N/R = x*, B/R = y*")
  for d in result["design"]:
    pl = d["power_law"]
    pl_s = (f"x* = {pl['x_star']:.4g}, y* = {pl['y_star']:.4g}" if pl["x_star"] is not None
            else pl["why"])
    mx, mn = d["measured_max"], d["measured_mean"]
    lines.append(f"  rho = {d['rho']:g}: power law {pl_s}; measured curve (running max) "
                 f"x* = {_fmt(mx['x_star'])}, y* = {_fmt(mx['y_star'])}; (mean over [0, x]) "
                 f"x* = {_fmt(mn['x_star'])}, y* = {_fmt(mn['y_star'])}")
  w = result["wall_seconds"]
  lines.append(f"wall: {w['total']:.0f} s (train {w['train']:.0f} s, probe {w['probe']:.0f} s)")
  return "\n".join(lines)


def _fmt(x: Any) -> str:
  return format(x, ".4g") if isinstance(x, float) else str(x)


def plot(result: dict, path: str) -> None:
  """Two panels: sigma^2 per rollout vs staleness (intervals, fit), bias vs staleness."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)

  rows = result["rows"]
  s = np.array([r["staleness"] for r in rows], np.float64)
  v = np.array([r["sigma2"] for r in rows])
  ci = np.array([r["sigma2_ci"] for r in rows])
  b = np.array([r["bias"] for r in rows])
  bci = np.array([r["bias_ci"] for r in rows])
  st = result["settings"]
  fig = Figure(figsize=(13.0, 4.8), layout="constrained")
  ax, ax_b = fig.subplots(1, 2)
  ax.errorbar(s, v, yerr=[np.maximum(v - ci[:, 0], 0), np.maximum(ci[:, 1] - v, 0)], fmt="o",
              color="tab:blue", capsize=3,
              label="whole-group minibatches, 95% bootstrap interval")
  vs = np.array([r["sigma2_spread"] for r in rows])
  vsci = np.array([r["sigma2_spread_ci"] for r in rows])
  ax.errorbar(s * 1.04, vs, yerr=[np.maximum(vs - vsci[:, 0], 0), np.maximum(vsci[:, 1] - vs, 0)],
              fmt="^", color="tab:green", capsize=3, alpha=0.7,
              label="one rollout per prompt per minibatch ('spread')")
  ax.axhline(v[0], color="tab:gray", ls=":", label="on-policy level (staleness 0)")
  f = result["fit"]
  if f is not None and isinstance(f["tau"], float):
    xs = np.geomspace(1.0, max(s.max(), 1.0), 100)
    ax.plot(xs, (xs / f["tau"]) ** (2 * f["alpha"]), color="tab:orange",
            label=f"fit (s/tau)^(2 alpha), s >= 1: alpha = {f['alpha']:.3f}, R^2 = {f['r2']:.2f}")
  for a in (ax, ax_b):
    a.set_xscale("symlog", linthresh=1.0)
    a.set_xticks(s)
    a.set_xticklabels([f"{int(x)}" for x in s])
  ax.set_yscale("log")
  ax.set_xlabel("staleness s (optimizer steps between the sampling and the current params)")
  ax.set_ylabel("sigma^2(s): gradient variance per rollout\n(squared L2 norm of d loss / d params)")
  ax.set_title(f"Gradient noise vs staleness (B = {st['minibatch']} rollouts x "
               f"{st['num_minibatches']} minibatches, K = {st['steps']} steps)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  ax_b.errorbar(s, b, yerr=[np.maximum(b - bci[:, 0], 0), np.maximum(bci[:, 1] - b, 0)], fmt="s",
                color="tab:red", capsize=3, label="debiased, 95% bootstrap interval")
  ax_b.plot(s, [r["bias_raw"] for r in rows], "x", color="tab:gray",
            label="raw ||mean g(s) - mean g(0)||")
  ax_b.set_xlabel("staleness s (optimizer steps)")
  ax_b.set_ylabel("||E g(s) - E g(0)|| (L2 norm of d loss / d params)")
  ax_b.set_title("Gradient bias vs staleness (the kappa term)")
  ax_b.legend(fontsize=8)
  ax_b.grid(alpha=0.3)
  fig.savefig(path, dpi=120)


def _json_safe(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return noise_stats.finite_or_str(x)
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x


def main(argv, flags_mod) -> None:
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]}")
  f = flags_mod.FLAGS
  if f.quick:
    settings = noise_probe.ProbeSettings.quick()
  else:
    settings = noise_probe.ProbeSettings(
        steps=f.steps, rollouts=f.rollouts, minibatch=f.minibatch,
        staleness=tuple(int(x) for x in f.staleness.split(",")),
        bootstrap=f.bootstrap, seed=f.bootstrap_seed)
  result = noise_probe.run_probe(f.config, settings)
  result["command"] = " ".join(sys.argv)
  os.makedirs(f.out, exist_ok=True)
  print(table(result))
  with open(os.path.join(f.out, "probe_sigma.json"), "w") as fh:
    json.dump(_json_safe(result), fh, indent=1)
  plot(result, os.path.join(f.out, "probe_sigma.png"))
  print(f"wrote {os.path.join(f.out, 'probe_sigma.json')} and probe_sigma.png")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  config_flags.DEFINE_config_file("config", None, "Python config file (get_config()).",
                                  lock_config=True)
  flags.DEFINE_string("out", os.path.join(REPO, "bench", "results"), "Output directory.")
  flags.DEFINE_bool("quick", False, "Tiny sizes (K=4, M=128, s in 0,1,2,4) for the test.")
  flags.DEFINE_integer("steps", noise_probe.ProbeSettings.steps, "K on-policy training steps.")
  flags.DEFINE_integer("rollouts", noise_probe.ProbeSettings.rollouts, "M rollouts per staleness.")
  flags.DEFINE_integer("minibatch", noise_probe.ProbeSettings.minibatch,
                       "B rollouts per minibatch (whole groups); 0: buffer.batch_size; -k: k groups.")
  flags.DEFINE_string("staleness", ",".join(map(str, noise_probe.DEFAULT_STALENESS)),
                      "Staleness grid (steps), comma-separated; capped at --steps.")
  flags.DEFINE_integer("bootstrap", noise_probe.ProbeSettings.bootstrap, "Bootstrap replicates.")
  flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the bootstrap resampling.")
  flags.mark_flags_as_required(["config"])
  app.run(lambda argv: main(argv, flags))
