"""DIR/report.md: the numbers of results.json as Markdown tables, one section per sweep.

Written by `python -m jaxreplay.experiments` next to results.json (and by `--report_only`), so every
number EXPERIMENTS.md quotes can be found in a table generated from results.json, with its spread:
median [q25, q75] over seeds for an arm, mean [95% t interval] for per-seed paired differences
against the sweep's baseline arm (`stats.paired`; the bootstrap interval stays in results.json as
ci95_bootstrap), geometric mean [95% log-space t interval] for per-seed compute ratios
(`stats.paired_ratio`). Sweeps with learning-rate families also get a family table: each family's best
rate and bracket (judged on >= 2 seeds per rate) and its compute to each family target as a ratio
to the baseline family's (geometric mean over paired seeds [95% t interval], seeds reaching it).
Compute is in device-seconds of the simulated hardware; "-" is a value that does not exist (not
reached, not measured, or no paired seed).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from jaxreplay.science import families as families_lib
from jaxreplay.science import stats as stats_lib


def _f(x: Optional[float], digits: int = 3) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def _q(q: Optional[dict[str, Any]], digits: int = 3) -> str:
  """median [q25, q75] (n seeds)."""
  if not q or q.get("median") is None:
    return "-"
  return f"{_f(q['median'], digits)} [{_f(q.get('q25'), digits)}, {_f(q.get('q75'), digits)}]"


def _p(p: Optional[dict[str, Any]], digits: int = 3, sign: str = "+") -> str:
  """mean [ci95] (n) of per-seed paired values: differences (signed) or ratios (sign="")."""
  if not p or p.get("mean") is None:
    return "-"
  lo, hi = p.get("ci95", (None, None))
  return f"{p['mean']:{sign}.{digits}f} [{_f(lo, digits)}, {_f(hi, digits)}] (n={p.get('n')})"


def _passk_key(metrics: Sequence[str]) -> Optional[str]:
  keys = [m for _, m in stats_lib.passk_keys(metrics)[1:]]
  return keys[-1] if keys else None


def sweep_table(name: str, sweep: dict[str, Any]) -> list[str]:
  """The Markdown lines of one sweep: one row per arm, then compute to each target."""
  summ = sweep["summary"]
  metrics, arms = summ["metrics"], summ["arms"]
  pk = _passk_key(metrics)
  lines = [f"## {name}", "", sweep.get("description", ""), "",
           f"Budget {sweep['budget']:g} device-seconds per run; {sweep.get('finished_runs', 0)} of "
           f"{sweep.get('planned_runs', '?')} runs finished; baseline arm `{sweep['baseline']}`. "
           f"Command: `{sweep.get('command', '')}`.", ""]
  if not arms:
    return lines + ["No finished run yet.", ""]
  head = ["arm", "seeds", "final pass@1", "peak pass@1", "final pass@1 - baseline",
          "last-quarter gain"]
  if pk:
    head += [f"final {pk[5:]}", f"final {pk[5:]} - baseline"]
  head += ["final entropy", "replay ratio", "batch staleness", "steps"]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for arm in sweep["arms"]:
    if arm not in arms:
      lines.append(f"| {arm} | 0 |" + " |" * (len(head) - 2))
      continue
    s, vs = arms[arm], arms[arm].get("vs_baseline", {})
    row = [arm, str(len(s["seeds"])), _q(s["final"].get(stats_lib.PRIMARY)),
           _q(s["peak"].get(stats_lib.PRIMARY)), _p(vs.get("final", {}).get(stats_lib.PRIMARY)),
           _q(s.get("last_quarter_gain"))]
    if pk:
      row += [_q(s["final"].get(pk)), _p(vs.get("final", {}).get(pk))]
    st = s.get("run_stats", {})
    uses = st.get("uses_per_rollout", st.get("buffer/replay_ratio"))  # ppo / gate reuse counted
    row += [_q(s["final"].get("eval/entropy")), _q(uses, 2),
            _q(st.get("buffer/staleness_mean"), 2), _q(st.get("step"), 0)]
    lines.append("| " + " | ".join(row) + " |")
  lines.append("")
  targets = summ.get("targets", [])
  if targets:
    head = ["arm"] + [f"compute to pass@1 {t:.3f}" for t in targets] + [
        f"ratio to baseline at {t:.3f}" for t in targets]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in sweep["arms"]:
      if arm not in arms:
        continue
      s, vs = arms[arm], arms[arm].get("vs_baseline", {})
      key = [f"{t:.3f}" for t in targets]
      row = [arm] + [_q(s["compute_to_target"].get(k), 0) for k in key] + [
          _p(vs.get("compute_to_target", {}).get(k, {}).get("ratio"), 2, sign="") for k in key]
      lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Compute to a target is read only between two real evaluation points that "
              "bracket it; a seed that never reaches it counts as infinite in the median.", ""]
    if sweep.get("figure") == "pareto":
      lines += frontier_table(sweep, targets)
  return lines + family_table(summ)


def _ratio_cell(e: dict[str, Any], seeds: str) -> str:
  """ratio [ci95] (seeds) of a compute-ratio entry; "-" when no seed reached the target."""
  if e["ratio"] is None:
    return "-"
  return f"{e['ratio']:.2f} [{_f(e['ci95'][0], 2)}, {_f(e['ci95'][1], 2)}] ({seeds})"


def family_table(summ: dict[str, Any]) -> list[str]:
  """Each learning-rate family: best rate, bracket, final pass@1, the paired difference to its
  baseline arm, and compute to each family target over the baseline family's."""
  families = summ.get("families") or {}
  if not families:
    return []
  ft = summ.get("family_targets", {})
  targets = ft.get("targets", [])
  head = ["family", "best lr (seeds)", "bracketed", "final pass@1", "minus baseline [t 95%]"] + [
      f"compute to {t:.3f} / {ft.get('baseline_family', 'baseline')}" for t in targets]
  lines = [f"Families: best rate = highest median final pass@1 among rates with >= "
           f"{stats_lib.MIN_SEEDS} seeds; bracketed = the nearest rates on both sides have >= "
           f"{stats_lib.MIN_SEEDS} seeds and end lower. Targets: {ft.get('rule', '-')}. Ratio "
           "cells: geometric mean over the seeds where both reach it [95% t interval] (seeds).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for fam, f in families.items():
    seeds = dict(zip(f["lrs"], f.get("seeds_by_lr", [])))
    row = [fam, f"{f['best_lr']:.3g} ({seeds.get(f['best_lr'], '?')})",
           "yes" if f["bracketed"] else "no", _q(f["final_pass1"]), _p(f.get("vs_baseline"))]
    row += [_ratio_cell(e, f"{e['reached_seeds']}") for e in f.get("compute_to_target", [])]
    lines.append("| " + " | ".join(row) + " |")
  lines += ["", f"Frontiers: per seed, each family's least compute to the target over its rates "
            f"with >= {stats_lib.MIN_SEEDS} seeds, against {ft.get('baseline_family', 'baseline')}'s "
            "frontier at the same seed, over the seeds every one of those rates has. Cells: "
            "geometric mean [95% t interval] (seeds reaching / seeds).", "",
            "| family | rates | " + " | ".join(f"frontier to {t:.3f}" for t in targets) + " |",
            "|" + "---|" * (2 + len(targets))]
  for fam, f in families.items():
    row = [fam, ", ".join(f.get("frontier_arms", [])) or "-"]
    row += [_ratio_cell(e, f"{e['reached_seeds']}/{e['seeds']}")
            for e in f.get("frontier_to_target", [])]
    lines.append("| " + " | ".join(row) + " |")
  return lines + [""]


def frontier_table(sweep: dict[str, Any], targets: Sequence[float]) -> list[str]:
  """Fig. 4's frontier: per seed the best arm of each family (replay, on-policy) to each target."""
  families = {a: spec.get("family") or a for a, spec in sweep["arms"].items()}
  if not {"replay", "onpolicy"} <= set(families.values()):
    return []
  fr = families_lib.frontier_ratios(sweep["summary"]["arms"], families, targets, "replay", "onpolicy")
  lines = ["Frontier (Fig. 4): per seed, the least compute any arm of a family needs to reach the "
           "target (its best learning rate for that seed); ratio = replay / on-policy, geometric "
           "mean over seeds [95% t interval].", "",
           "| target pass@1 | on-policy frontier per seed | replay frontier per seed | replay / on-policy | best arms (on-policy; replay) |",
           "|---|---|---|---|---|"]
  for key, f in fr.items():
    r = f["ratio"]
    ratio = ("-" if r["geomean"] is None else
             f"{r['geomean']:.2f} [{_f(r['ci95'][0], 2)}, {_f(r['ci95'][1], 2)}] (n={r['n']})")
    seeds = lambda v: ", ".join("never" if x is None else f"{x:.0f}" for x in v)  # noqa: E731
    lines.append(f"| {key} | {seeds(f['onpolicy'])} | {seeds(f['replay'])} | {ratio} | "
                 f"{', '.join(str(a) for a in f['arms']['onpolicy'])}; "
                 f"{', '.join(str(a) for a in f['arms']['replay'])} |")
  return lines + [""]


def report(results: dict[str, Any]) -> str:
  """The whole report.md text."""
  lines = ["# Sweep report (generated from results.json by jaxreplay.science.report)", "",
           "Cells: median [q25, q75] over seeds; differences to the baseline arm: mean of per-seed "
           "paired differences [95% t interval] (n seeds); ratios of compute to a target: "
           "geometric mean of the per-seed ratios [95% t interval of the mean log ratio, mapped "
           "through exp] (n seeds). pass@1 at T=0.1; pass@k at "
           "T=1.0; top-p 0.95; compute in device-seconds of the simulated hardware.", ""]
  for name, sweep in results["sweeps"].items():
    lines += sweep_table(name, sweep)
  return "\n".join(lines).rstrip() + "\n"


def write_report(results: dict[str, Any], path: str) -> str:
  with open(path, "w", encoding="utf-8") as f:
    f.write(report(results))
  return path
