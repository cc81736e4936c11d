"""PNG figures of the sweeps in results.json (`jaxreplay.experiments`), from the summaries only.

Per sweep, in DIR/figures/:
  SWEEP_accuracy.png        held-out pass@1 and the largest pass@k vs compute: median and IQR band
                            over seeds per arm, on the compute grid
  SWEEP_passk.png           pass@k vs k at the final budget (median, IQR bars)
  SWEEP_entropy.png         policy entropy on held-out problems vs compute
  SWEEP_final_peak.png      (n_sweep, wt_sweep) final and peak pass@1 vs N/B or the measured
                            replay ratio (`figure_x`)
  SWEEP_pareto.png          (lr_sweep) per family the best median pass@1 over learning rates at
                            each compute (the Pareto frontier of Fig. 4), each LR thin
  SWEEP_grid.png            (sync_grid) final median pass@1 over N/R x B/R
  SWEEP_compute_to_target.png  (sweeps with learning-rate families, e.g. pareto) per family at its
                            best rate, the compute to reach each accuracy target over on-policy's
                            (geometric mean over paired seeds, 95% t interval band), with the
                            lines 1.0 (as much as on-policy) and 0.6 (the project's goal)
  SWEEP_frontier_to_target.png  the same for each family's frontier (its fastest rate per target
                            and seed) against on-policy's frontier
"""
from __future__ import annotations

import os
import textwrap
from typing import Any, Optional, Sequence

import numpy as np

from jaxreplay.science import stats as stats_lib

COMPUTE_LABEL = "compute (device-seconds of the simulated hardware)"


def _arr(values: Sequence[Optional[float]]) -> np.ndarray:
  return np.array([np.nan if v is None else v for v in values], np.float64)


def _eval_words(sweep: dict[str, Any]) -> dict[str, str]:
  """Readable names of the eval metrics, with the temperature and top-p of the runs."""
  c = next((r["run_config"] for r in sweep.get("_runs", []) if r.get("run_config")), None) or {}
  ev = c.get("eval", {})
  t1, tk, top_p = ev.get("temperature_pass1", 0.1), ev.get("temperature_passk", 1.0), ev.get(
      "top_p", 1.0)
  return {"pass1": f"pass@1 (T={t1:g}, top-p {top_p:g})",
          "passk": f"T={tk:g}, top-p {top_p:g}",
          "problems": f"{ev.get('num_problems', '?')} held-out problems",
          "pass1_problems": _pass1_problems(ev)}


def _pass1_problems(ev: dict[str, Any]) -> str:
  """The held-out problems of the pass@1-only evaluations between the full ones (eval.pass1_problems;
  0 = all of eval.num_problems)."""
  n, every = ev.get("pass1_problems", 0), ev.get("num_problems", "?")
  return f"{every} held-out problems" if not n or n == every else (
      f"{n} held-out problems ({every} at the start and end)")


def _new_figure(panels: int, width: float = 5.5, height: float = 4.0):
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)
  fig = Figure(figsize=(width * panels, height), layout="constrained")
  return fig, fig.subplots(1, panels, squeeze=False)[0]


def _title(fig, text: str) -> None:
  """A suptitle wrapped to the figure's width."""
  width = int(fig.get_figwidth() * 13)
  fig.suptitle("\n".join(textwrap.wrap(text, width)), fontsize="medium")


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, format="png", dpi=110, metadata={"Software": None})
  return path


# More legend entries than this go in one legend below the panels: a 24-arm sweep's legend inside
# a 4-inch panel covers the curves, and constrained layout collapses the axes around it.
LEGEND_INLINE_MAX = 8
LINESTYLES = ("-", "--", ":", "-.", (0, (1, 3)), (0, (5, 5)))


def _legend(fig, axes) -> None:
  """Each panel's own legend while it is short; else the first panel's entries once, in columns
  below the panels, with the figure grown by their rows."""
  handles, labels = axes[0].get_legend_handles_labels()
  if len(labels) <= LEGEND_INLINE_MAX:
    for ax in axes:
      ax.legend(fontsize="small")
    return
  ncol = max(1, int(fig.get_figwidth() // 2.7))
  rows = -(-len(labels) // ncol)
  fig.set_figheight(fig.get_figheight() + 0.2 * rows)
  fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize="small")


def _families(sweep: dict[str, Any]) -> dict[str, list[str]]:
  """{family: its arms in plan order}; an arm without a family is its own."""
  plan = sweep.get("arms", {})
  families: dict[str, list[str]] = {}
  for arm in sweep["summary"]["arms"]:
    families.setdefault(plan.get(arm, {}).get("family") or arm, []).append(arm)
  return families


def _arm_styles(sweep: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """{arm: {"color", "linestyle"}}: one color per family, one line style per arm within it in plan
  order (the rates), so 24 arms of 9 families stay apart."""
  from matplotlib import colormaps  # pylint: disable=g-import-not-at-top
  families = _families(sweep)
  cmap = colormaps["tab10" if len(families) <= 10 else "tab20"]
  return {arm: {"color": cmap(i % cmap.N), "linestyle": LINESTYLES[j % len(LINESTYLES)]}
          for i, members in enumerate(families.values()) for j, arm in enumerate(members)}


def _band(ax, x, q: dict[str, Sequence], label: str, **kw) -> None:
  med, lo, hi = _arr(q["median"]), _arr(q["q25"]), _arr(q["q75"])
  ok = ~np.isnan(med)
  if not ok.any():
    return
  line, = ax.plot(np.asarray(x)[ok], med[ok], marker="o", markersize=3, label=label, **kw)
  ax.fill_between(np.asarray(x)[ok], lo[ok], hi[ok], color=line.get_color(), alpha=0.2)


def _label(arm: str, s: dict[str, Any]) -> str:
  return f"{arm} (n={len(s['seeds'])})"


def plot_curves(name: str, sweep: dict[str, Any], metrics: Sequence[tuple[str, str]],
                path: str, title: str) -> Optional[str]:
  """One panel per (metric, y label): median and IQR over seeds per arm on the compute grid."""
  summ = sweep["summary"]
  metrics = [(m, y) for m, y in metrics if m in summ["metrics"]]
  if not metrics or not summ["arms"]:
    return None
  fig, axes = _new_figure(len(metrics))
  styles = _arm_styles(sweep)
  for ax, (m, ylabel) in zip(axes, metrics):
    for arm, s in summ["arms"].items():
      _band(ax, summ["grid"], s["grid"][m], _label(arm, s), **styles[arm])
    ax.set_xlabel(COMPUTE_LABEL)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
  _legend(fig, axes)
  _title(fig, f"{name}: {title}")
  return _save(fig, path)


def plot_passk(name: str, sweep: dict[str, Any], path: str, words: dict[str, str]
               ) -> Optional[str]:
  summ = sweep["summary"]
  fig, axes = _new_figure(1)
  ax, drawn, styles = axes[0], False, _arm_styles(sweep)
  for arm, s in summ["arms"].items():
    pk = s["passk_final"]
    if not pk["k"]:
      continue
    med, lo, hi = _arr(pk["median"]), _arr(pk["q25"]), _arr(pk["q75"])
    ax.errorbar(pk["k"], med, yerr=[med - lo, hi - med], marker="o", capsize=3,
                label=_label(arm, s), **styles[arm])
    drawn = True
  if not drawn:
    return None
  ax.set_xscale("log", base=2)
  ks = sorted({k for s in summ["arms"].values() for k in s["passk_final"]["k"]})
  ax.set_xticks(ks, [str(k) for k in ks])
  ax.set_xlabel("k (samples per problem)")
  ax.set_ylabel(f"pass@k ({words['passk']})")
  ax.grid(alpha=0.3)
  _legend(fig, axes)
  _title(fig, f"{name}: pass@k at the final compute budget ({sweep['budget']:g} device-seconds),"
               f" median and IQR over seeds")
  return _save(fig, path)


_X_WORDS = {"buffer/replay_ratio": "replay ratio (mean uses per rollout, measured)",
            "N/B": "N/B (buffer size / batch size)",
            "buffer/staleness_mean": "mean batch staleness (steps, measured)"}


def plot_final_peak(name: str, sweep: dict[str, Any], path: str, words: dict[str, str]
                    ) -> Optional[str]:
  """Final and peak pass@1 per arm against `sweep["figure_x"]`: a per-run statistic (median over
  seeds) or an arm tag."""
  summ, xkey = sweep["summary"], sweep.get("figure_x") or "buffer/replay_ratio"
  pts = []
  for arm, s in summ["arms"].items():
    tags = sweep["arms"].get(arm, {}).get("tags", {})
    x = tags.get(xkey, s["run_stats"].get(xkey, {}).get("median"))
    if x is not None and s["final"].get(stats_lib.PRIMARY, {}).get("median") is not None:
      pts.append((x, arm, s))
  if not pts:
    return None
  pts.sort(key=lambda p: p[0])
  fig, axes = _new_figure(1)
  ax = axes[0]
  for key, marker in (("final", "o"), ("peak", "s")):
    q = [p[2][key][stats_lib.PRIMARY] for p in pts]
    med, lo, hi = (_arr([v[k] for v in q]) for k in ("median", "q25", "q75"))
    ax.errorbar([p[0] for p in pts], med, yerr=[med - lo, hi - med], marker=marker, capsize=3,
                label=f"{key} {words['pass1']}")
  for x, arm, s in pts:
    ax.annotate(arm, (x, s["final"][stats_lib.PRIMARY]["median"]), fontsize="small",
                xytext=(4, -10), textcoords="offset points")
  if xkey in sweep["arms"].get(pts[0][1], {}).get("tags", {}):
    ax.set_xscale("log", base=2)
    ax.set_xticks([p[0] for p in pts], [f"{p[0]:g}" for p in pts])
  ax.set_xlabel(_X_WORDS.get(xkey, xkey))
  ax.set_ylabel(words["pass1"])
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  _title(fig, f"{name}: final and peak accuracy vs {_X_WORDS.get(xkey, xkey).split(' (')[0]} "
         "(median and IQR over seeds)")
  return _save(fig, path)


def plot_pareto(name: str, sweep: dict[str, Any], path: str, words: dict[str, str]
                ) -> Optional[str]:
  summ, families = sweep["summary"], _families(sweep)
  fig, axes = _new_figure(1, width=7.0)
  ax, grid, styles = axes[0], np.asarray(summ["grid"]), _arm_styles(sweep)
  for fam, members in families.items():
    curves = np.stack([_arr(summ["arms"][a]["grid"][stats_lib.PRIMARY]["median"])
                       for a in members])
    frontier = np.full(len(grid), np.nan)
    ok = ~np.isnan(curves).all(axis=0)
    frontier[ok] = np.nanmax(curves[:, ok], axis=0)
    line, = ax.plot(grid[ok], frontier[ok], linewidth=2.5, label=f"{fam}: best over LRs",
                    color=styles[members[0]]["color"])
    for a, c, style in zip(members, curves, LINESTYLES[1:]):
      m = ~np.isnan(c)
      ax.plot(grid[m], c[m], linewidth=0.9, linestyle=style, color=line.get_color(), alpha=0.7,
              label=a)
  ax.set_xlabel(COMPUTE_LABEL)
  ax.set_ylabel(f"median {words['pass1']}")
  ax.grid(alpha=0.3)
  _legend(fig, axes)
  _title(fig, f"{name}: Pareto frontier over constant learning rates (thin: each LR)")
  return _save(fig, path)


def plot_grid(name: str, sweep: dict[str, Any], path: str, words: dict[str, str]
              ) -> Optional[str]:
  summ, arms = sweep["summary"], sweep["arms"]
  cells = {}
  for arm, s in summ["arms"].items():
    tags = arms[arm]["tags"]
    if "N/R" in tags and "B/R" in tags:
      cells[(tags["N/R"], tags["B/R"])] = s["final"][stats_lib.PRIMARY]["median"]
  if not cells:
    return None
  xs, ys = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
  z = np.full((len(ys), len(xs)), np.nan)
  for (x, y), v in cells.items():
    z[ys.index(y), xs.index(x)] = np.nan if v is None else v
  fig, axes = _new_figure(1, width=6.5)
  ax = axes[0]
  im = ax.imshow(z, origin="lower", cmap="viridis", aspect="auto")
  for i in range(len(ys)):
    for j in range(len(xs)):
      if not np.isnan(z[i, j]):
        ax.text(j, i, f"{z[i, j]:.3f}", ha="center", va="center", color="w", fontsize="small")
  ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
  ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
  ax.set_xlabel("N/R (buffer size / rollouts generated per step)")
  ax.set_ylabel("B/R (batch size / rollouts generated per step)")
  fig.colorbar(im, ax=ax, label=f"final median {words['pass1']}")
  _title(fig, f"{name}: synchronous schedule, accuracy at the budget ({sweep['budget']:g} "
               "device-seconds)")
  return _save(fig, path)


GOAL_RATIO = 0.6  # issue 37's goal: every target with <= 0.6x on-policy's compute
RATIO_AXIS = (0.125, 8.0)  # the compute-ratio figures' y range (log axis)


def plot_compute_to_target(name: str, sweep: dict[str, Any], path: str, words: dict[str, str],
                           key: str = "compute_to_target") -> Optional[str]:
  """Per family (`summary.families[F][key]`: "compute_to_target", each family's best rate against
  the baseline's, or "frontier_to_target", each family's fastest rate per target and seed against
  the baseline's): ratio to the baseline family's compute vs the target, the 95% t interval as a
  band, horizontal lines at 1.0 and GOAL_RATIO."""
  summ = sweep["summary"]
  families = {f: v for f, v in summ.get("families", {}).items() if v.get(key)}
  if not families:
    return None
  base = summ.get("family_targets", {}).get("baseline_family") or "on-policy"
  fig, axes = _new_figure(1, width=11.0, height=4.8)
  ax, drawn = axes[0], False
  for fam, v in families.items():
    entries = v[key]
    x = np.array([e["target"] for e in entries], np.float64)
    y = _arr([e["ratio"] for e in entries])
    lo, hi = _arr([e["ci95"][0] for e in entries]), _arr([e["ci95"][1] for e in entries])
    ok = ~np.isnan(y)
    if not ok.any():
      continue
    seeds = ", ".join(str(e["reached_seeds"]) for e in entries)
    which = (f"at lr {v['best_lr']:.3g}" if key == "compute_to_target" else
             f"over {len(v.get('frontier_arms', []))} rate(s)")
    line, = ax.plot(x[ok], y[ok], marker="o", markersize=4,
                    label=f"{fam} {which} (seeds reaching: {seeds})")
    band = ok & ~np.isnan(lo) & ~np.isnan(hi)
    ax.fill_between(x[band], lo[band], hi[band], color=line.get_color(), alpha=0.15)
    drawn = True
  if not drawn:
    return None
  ax.axhline(1.0, color="black", linewidth=1.0, label=f"1.0: as much compute as {base}")
  ax.axhline(GOAL_RATIO, color="black", linestyle="--", linewidth=1.0,
             label=f"{GOAL_RATIO}: the goal (<= {GOAL_RATIO}x {base}'s compute)")
  ax.set_xlabel(f"target accuracy: {words['pass1']} on {words['pass1_problems']}")
  # Ratios and their (log-space) intervals are symmetric on a log axis; a 2-seed interval can span
  # 100x, so the axis is held to [1/8, 8] and a band beyond it is cut at the frame.
  ax.set_yscale("log")
  ax.set_ylim(RATIO_AXIS)
  ticks = [0.125, 0.25, 0.5, GOAL_RATIO, 1.0, 2.0, 4.0, 8.0]
  ax.set_yticks(ticks)
  ax.set_yticklabels([f"{t:g}" for t in ticks])
  ax.minorticks_off()
  ax.set_ylabel(f"compute to the target / {base}'s (ratio, log scale)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
  how = (f"ratio to {base} at its best learning rate" if key == "compute_to_target" else
         f"ratio of each family's fastest learning rate per target to {base}'s (frontiers)")
  _title(fig, f"{name}: compute (device-seconds) each design needs to reach each accuracy, as a "
         f"{how}; geometric mean over paired seeds with its 95% t interval")
  return _save(fig, path)


def plot_sweep(name: str, sweep: dict[str, Any], out_dir: str) -> list[str]:
  """Every figure of one sweep of results.json; returns the paths written."""
  if not sweep["summary"]["arms"]:
    return []
  words = _eval_words(sweep)
  metrics = sweep["summary"]["metrics"]
  passk = [m for _, m in stats_lib.passk_keys(metrics)[1:]][-1:]
  paths = [
      plot_curves(name, sweep, [(stats_lib.PRIMARY, words["pass1"])] + [
          (m, f"{m[5:]} ({words['passk']})") for m in passk],
                  os.path.join(out_dir, f"{name}_accuracy.png"),
                  f"accuracy on {words['problems']} vs compute, median and IQR over seeds"),
      plot_passk(name, sweep, os.path.join(out_dir, f"{name}_passk.png"), words),
      plot_curves(name, sweep, [("eval/entropy", f"entropy (nats per token, {words['passk']})")],
                  os.path.join(out_dir, f"{name}_entropy.png"),
                  "policy entropy on held-out problems vs compute, median and IQR over seeds"),
  ]
  extra = {"final_peak": plot_final_peak, "pareto": plot_pareto, "grid": plot_grid}
  if sweep.get("figure") in extra:
    paths.append(extra[sweep["figure"]](
        name, sweep, os.path.join(out_dir, f"{name}_{sweep['figure']}.png"), words))
  for key in ("compute_to_target", "frontier_to_target"):
    paths.append(plot_compute_to_target(name, sweep, os.path.join(out_dir, f"{name}_{key}.png"),
                                        words, key))
  return [p for p in paths if p]


def plot_all(results: dict[str, Any], out_dir: str) -> list[str]:
  """Figures of every sweep of `results` (results.json's structure)."""
  paths = []
  for name, sweep in results["sweeps"].items():
    runs = [r for r in results["runs"].values() if r.get("sweep") == name]
    paths += plot_sweep(name, {**sweep, "_runs": runs}, out_dir)
  return paths
