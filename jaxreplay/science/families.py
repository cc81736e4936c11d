"""Learning-rate families of a sweep (issues 26, 37): each family's best rate and bracket, the
accuracy targets, each family's compute to them as a ratio to the baseline family's (at the best
rates, and over the frontiers), and Fig. 4's replay / on-policy frontier. Pure functions over the
summaries of `jaxreplay.science.stats` and the runs' curves.

Methods (issue 37: fit for 4-8 seeds):
  a family's best rate the rate with the highest median final pass@1 among the rates with >= 2
                       finished seeds (`MIN_SEEDS`); "bracketed" when the nearest finished rates
                       below and above it both have >= 2 seeds and lower medians.
  family targets       `FAMILY_TARGETS` = 4 targets equally spaced from the start to the
                       baseline family's final accuracy: start + i / 4 * (final - start), i = 1..4,
                       start = the median first evaluation of every finished run, final = the
                       median final pass@1 of the baseline family (on-policy) at its best rate
                       (`family_targets`, rounded down to 4 decimals).
  ratio to on-policy   for each target, each family's best-rate arm against the baseline
                       family's best-rate arm, paired by seed over the seeds where both reach the
                       target: the geometric mean of the per-seed ratios, exp(mean log ratio), with
                       the 95% t interval of the mean log ratio mapped through exp
                       (`compute_ratios`); "reached_seeds" counts those seeds.
  frontier ratio       as "ratio to on-policy", but each family over its frontier instead of its
                       best-rate arm: per seed the least compute any of its rates needs for the
                       target, against the baseline family's frontier at the same seed, over the
                       seeds every rate of both has (`add_frontier_to_target`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxreplay.science.stats import (FAMILY_TARGETS, MIN_SEEDS, PRIMARY, Row,
                                     compute_to_target, interp_range, json_number,
                                     paired_ratio, series, target_bracket)


def frontier_ratios(arms: Mapping[str, Mapping[str, Any]], families: Mapping[str, str],
                    targets: Sequence[float], numerator: str, denominator: str
                    ) -> dict[str, dict[str, Any]]:
  """Fig. 4's Pareto reading: per target and seed, the least compute any arm of a family needs to
  reach it (the family's frontier, e.g. the best learning rate of each seed), and the ratio of the
  two families' frontiers.

  Args:
    arms: `sweep_summary(...)["arms"]` (each with compute_to_target[target]["values"] per seed).
    families: arm name -> family ("onpolicy", "replay").
    targets: the pass@1 targets.
    numerator, denominator: the two families (ratio = numerator / denominator).
  Returns:
    target key ("0.307") -> {numerator: per-seed compute, denominator: per-seed compute ("inf"
    never reached), "ratio": geometric mean of the per-seed ratios with a t interval
    (computed in log space; seeds where either never reaches the target are left out), "arms":
    the arm that reached the target first per seed, per family}.
  """
  out = {}
  for t in targets:
    key = f"{t:.3f}"
    best: dict[str, list[float]] = {}
    best_arm: dict[str, list[Optional[str]]] = {}
    for family in (numerator, denominator):
      members = [a for a, f in families.items() if f == family and a in arms]
      seeds = max((len(arms[a]["compute_to_target"].get(key, {}).get("values", [])) for a in members),
                  default=0)
      best[family], best_arm[family] = [], []
      for s in range(seeds):
        cands = []
        for a in members:
          values = arms[a]["compute_to_target"].get(key, {}).get("values", [])
          v = values[s] if s < len(values) else None
          if v is not None:
            cands.append((float(v), a))
        c, a = min(cands) if cands else (math.inf, None)
        best[family].append(c)
        best_arm[family].append(a)
    p = paired_ratio([n / d if math.isfinite(n) and math.isfinite(d) else None
                      for n, d in zip(best[numerator], best[denominator])])
    ratio = {"n": p["n"], "geomean": p["mean"], "ci95": p["ci95"]}
    out[key] = {numerator: [json_number(x) for x in best[numerator]],
                denominator: [json_number(x) for x in best[denominator]],
                "ratio": ratio, "arms": best_arm}
  return out


def family_summary(arms: Mapping[str, Mapping[str, Any]], plan_arms: Mapping[str, Mapping[str, Any]],
                   metric: str = PRIMARY, lr_key: str = "trainer.learning_rate"
                   ) -> dict[str, dict[str, Any]]:
  """Each family's learning-rate bracket (issues 26, 37; the module docstring's rule).

  Args:
    arms: `sweep_summary(...)["arms"]` (finished arms only).
    plan_arms: the plan's arms: {arm: {"family", "overrides": [[key, value], ...], ...}}.
    metric: the accuracy compared (final median over seeds).
    lr_key: the override that holds an arm's learning rate.
  Returns:
    {family: {"lrs": the learning rates with finished runs (ascending), "final_by_lr": the final
    median of each, "seeds_by_lr": its finished seeds, "best_lr", "best_arm" (highest final median
    among the rates with >= MIN_SEEDS seeds; among all when none has), "bracketed": whether the
    nearest finished rates below and above the best both have >= MIN_SEEDS seeds and end lower,
    "final_pass1": the best arm's final quantiles over seeds (median, q25, q75, n), "vs_baseline":
    its paired final difference with its baseline arm (mean, t ci95, bootstrap ci95, n; None
    without one)}}; arms without a family or without a learning-rate override are left out.
  """
  by_family: dict[str, list[tuple[float, str]]] = {}
  for arm, spec in plan_arms.items():
    lr = dict((k, v) for k, v in spec.get("overrides", [])).get(lr_key)
    if arm in arms and spec.get("family") and lr is not None:
      by_family.setdefault(spec["family"], []).append((float(lr), arm))
  out = {}
  for family, members in by_family.items():
    members.sort()
    finals = [json_number(arms[a]["final"][metric]["median"]) for _, a in members]
    seeds = [int(arms[a]["final"][metric].get("n") or 0) for _, a in members]
    scored = [(f, lr, a, n) for (lr, a), f, n in zip(members, finals, seeds) if f is not None]
    if not scored:
      continue
    eligible = [x for x in scored if x[3] >= MIN_SEEDS] or scored
    best, best_lr, best_arm, best_n = max(eligible, key=lambda x: x[0])
    lower = [x for x in scored if x[1] < best_lr]
    higher = [x for x in scored if x[1] > best_lr]
    sides = [max(lower, key=lambda x: x[1]) if lower else None,
             min(higher, key=lambda x: x[1]) if higher else None]
    bracketed = best_n >= MIN_SEEDS and all(
        x is not None and x[3] >= MIN_SEEDS and x[0] < best for x in sides)
    vs = arms[best_arm].get("vs_baseline")
    out[family] = {
        "lrs": [lr for lr, _ in members], "final_by_lr": [json_number(f) for f in finals],
        "seeds_by_lr": seeds, "best_lr": best_lr, "best_arm": best_arm, "bracketed": bracketed,
        "final_pass1": {q: arms[best_arm]["final"][metric][q]
                        for q in ("median", "q25", "q75", "n")},
        "vs_baseline": ({"baseline": vs["baseline"], **vs["final"][metric]} if vs else None)}
  return out


def family_targets(curves: Mapping[str, Mapping[int, Sequence[Row]]],
                   baseline: Optional[Mapping[str, Any]], metric: str = PRIMARY,
                   count: int = FAMILY_TARGETS) -> list[float]:
  """`count` targets equally spaced from the start to the baseline family's final accuracy
  (`TARGET_RULE`): start = the median first evaluation over every run in `curves`, final = the
  baseline family's best arm's median final (`family_summary(...)[family]`); none when it does not
  end above the start."""
  if not baseline or baseline.get("final_pass1", {}).get("median") is None:
    return []
  firsts = [float(series(c, metric)[1][0]) for by_seed in curves.values()
            for c in by_seed.values() if len(series(c, metric)[1])]
  if not firsts:
    return []
  start, final = float(np.median(firsts)), float(baseline["final_pass1"]["median"])
  if final <= start:
    return []
  # Rounded down to 4 decimals: rounding up could put the last target above the final accuracy
  # it stands for (0.98486 -> 0.9849), out of reach of the run that defines it.
  return [math.floor((start + i / count * (final - start)) * 1e4 + 1e-6) / 1e4
          for i in range(1, count + 1)]


def compute_ratios(arm: Mapping[int, Sequence[Row]], base: Mapping[int, Sequence[Row]],
                   targets: Sequence[float], metric: str = PRIMARY) -> list[dict[str, Any]]:
  """Per target, compute to reach it of `arm`'s seeds over `base`'s at the same seed (the module
  docstring's rule): [{"target", "ratio" (geometric mean), "ci95" (exp of the t interval of the
  mean log ratio), "reached_seeds" (seeds where both reach it), "seeds" (seeds both have),
  "values" (per-seed ratio, None where either never reaches it), "interp_range" (`interp_range`:
  what the ratio could be if interpolation were wrong anywhere within the grid)}]."""
  entries = _ratio_entries({"arm": arm}, {"base": base}, sorted(set(arm) & set(base)), targets,
                           metric)
  for e in entries:
    del e["arms"]  # always ("arm", "base")
  return entries


def add_compute_to_target(families: dict[str, dict[str, Any]],
                          curves: Mapping[str, Mapping[int, Sequence[Row]]],
                          baseline_family: Optional[str], metric: str = PRIMARY,
                          fixed: Optional[Sequence[float]] = None) -> list[float]:
  """Adds "compute_to_target" (`compute_ratios` of its best arm against the baseline family's best
  arm at `family_targets`, or at the `fixed` targets of a sweep that has them) to every family of
  `family_summary`'s result; returns the targets."""
  base = families.get(baseline_family or "")
  targets = [float(t) for t in fixed] if fixed else family_targets(curves, base, metric)
  for fam in families.values():
    fam["compute_to_target"] = (
        compute_ratios(curves.get(fam["best_arm"], {}), curves.get(base["best_arm"], {}),
                       targets, metric) if base is not None else [])
  return targets


def frontier_arms(curves: Mapping[str, Mapping[int, Sequence[Row]]],
                  plan_arms: Mapping[str, Mapping[str, Any]], family: str) -> list[str]:
  """A family's arms that its frontier is taken over: those with >= MIN_SEEDS finished seeds
  (all finished arms of the family when none has that many), sorted by name."""
  members = sorted(a for a, spec in plan_arms.items()
                   if spec.get("family") == family and curves.get(a))
  return [a for a in members if len(curves[a]) >= MIN_SEEDS] or members


def _first_crossing(curves: Mapping[str, Sequence[Row]], target: float, metric: str
                    ) -> tuple[Optional[float], Optional[str], Optional[tuple[float, float]]]:
  """Over the arms' curves at one seed ({arm: curve}): the least compute any needs to reach
  `target`, that arm, and the range the least crossing could lie in (least lower, least upper
  bracketing evaluation over the arms that reach it); Nones when none reaches it."""
  best: tuple[Optional[float], Optional[str]] = (None, None)
  brackets = []
  for a, curve in curves.items():
    xs, ys = series(curve, metric)
    c = compute_to_target(xs, ys, target)
    if c is None:
      continue
    brackets.append(target_bracket(xs, ys, target))
    if best[0] is None or c < best[0]:
      best = (c, a)
  bracket = (min(b[0] for b in brackets), min(b[1] for b in brackets)) if brackets else None
  return best[0], best[1], bracket


def _ratio_entries(num: Mapping[str, Mapping[int, Sequence[Row]]],
                   den: Mapping[str, Mapping[int, Sequence[Row]]], seeds: Sequence[int],
                   targets: Sequence[float], metric: str) -> list[dict[str, Any]]:
  """Per target, the least compute any arm of `num` needs ({arm: {seed: curve}}) over the least
  any arm of `den` needs, paired by seed: the entries of `compute_ratios` (one arm each) and
  `add_frontier_to_target`, with "arms" (per seed [num's arm, den's arm] that reached it)."""
  entries = []
  for t in targets:
    ratios, which, brackets = [], [], []
    for sd in seeds:
      c, a, a_br = _first_crossing({k: v[sd] for k, v in num.items()}, t, metric)
      b, ba, b_br = _first_crossing({k: v[sd] for k, v in den.items()}, t, metric)
      ratios.append(c / b if c is not None and b is not None and b > 0 else None)
      which.append([a, ba])
      brackets.append((a_br, b_br) if ratios[-1] else None)
    p = paired_ratio(ratios)
    entries.append({"target": float(t), "ratio": json_number(p["mean"]) if p["n"] else None,
                    "ci95": [None if x is None else json_number(x) for x in p["ci95"]],
                    "reached_seeds": p["n"], "seeds": len(seeds), "values": p["values"],
                    "arms": which, "interp_range": interp_range(brackets)})
  return entries


def add_frontier_to_target(families: dict[str, dict[str, Any]],
                           curves: Mapping[str, Mapping[int, Sequence[Row]]],
                           plan_arms: Mapping[str, Mapping[str, Any]],
                           baseline_family: Optional[str], targets: Sequence[float],
                           metric: str = PRIMARY) -> None:
  """The frontier reading of each family against the baseline family (the stricter comparison:
  on-policy tuned per target, not only at its best final rate).

  Per seed and target, a family's frontier is the least compute any of its `frontier_arms` needs
  to reach the target (the best learning rate for that target and seed). Only seeds that every one
  of those arms of both families has finished count, so both frontiers are minima over the same
  rates at every seed. Adds to each family "frontier_arms" and "frontier_to_target": [{"target",
  "ratio" (geometric mean of the per-seed frontier ratios, `paired_ratio`), "ci95" (log-space t
  interval), "reached_seeds" (seeds where both frontiers reach it), "seeds" (seeds counted),
  "values" (per-seed ratio, None where either never reaches it), "arms" (per seed [the family's
  arm, the baseline's arm] that reached it first), "interp_range" (as in `compute_ratios`)}]; []
  without a baseline family."""
  if baseline_family not in families:
    for fam in families.values():
      fam["frontier_arms"], fam["frontier_to_target"] = [], []
    return
  base_arms = frontier_arms(curves, plan_arms, baseline_family)
  for name, fam in families.items():
    arms = frontier_arms(curves, plan_arms, name)
    both = arms + base_arms
    seeds = sorted(set.intersection(*(set(curves[a]) for a in both))) if both else []
    entries = _ratio_entries({a: curves[a] for a in arms}, {a: curves[a] for a in base_arms},
                             seeds, targets, metric)
    fam["frontier_arms"], fam["frontier_to_target"] = arms, entries

