r"""One command for the paper's experiments: named sweeps of arms x seeds, resumable.

  python -m jaxreplay.experiments --sweep=fig1 --seeds=4 --out=experiments
  python -m jaxreplay.experiments --sweep=all --out=experiments --parallel=2
  python -m jaxreplay.experiments --sweep=fig1 --seeds=2 --out=/tmp/x --quick   # CI: ~1 minute

Sweeps and arms are defined in `jaxreplay.science.sweeps`. Each run is one subprocess
  python -m jaxreplay.launch --config=BASE --workdir=DIR/runs/SWEEP/ARM/seed{k} <overrides>
so runs are isolated, and a killed run resumes from its checkpoint when the command is rerun. A run
that exited 0 gets `done.json` (its command and wall time) and is skipped afterwards; the command
can be rerun at any time. Runs whose resolved configs are identical (the default replay arm appears
in several sweeps) run once: the others get a `done.json` that points at it (`alias_of`).

Outputs in DIR:
  plans/SWEEP.json   the resolved plan of each sweep run in DIR (base config, budget, grid, arms)
  runs/...           one directory per run (metrics.jsonl, run_config.json, spec.json, done.json,
                     launch.log, and record.json: what results.json needs; experiments/.gitignore
                     keeps only the small files in git)
  results.json       every planned sweep: every finished run's curves and settings, and the
                     sweep's statistics (`jaxreplay.science.stats`); byte-identical when rebuilt
                     over the same finished runs; rewritten after every finished run
  report.md          results.json's numbers as tables (`jaxreplay.science.report`)
  figures/*.png      per sweep (`jaxreplay.science.plots`)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import fcntl
import fnmatch
import functools
import hashlib
import json
import math
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import ml_collections

from jaxreplay.science import families as families_lib
from jaxreplay.science import report as report_lib
from jaxreplay.science import stats as stats_lib
from jaxreplay.infra import metric_writers as metrics_lib
from jaxreplay.science import sweeps as sweeps_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_FORMAT = 1
# Keys of a metrics row kept in a run's curve (besides every eval/* key).
CURVE_KEYS = ("step", "compute_seconds", "reward_mean", "buffer/replay_ratio",
              "buffer/staleness_mean", "buffer/staleness_max", "compute/gamma", "compute/mu",
              "compute/measured_mu", "sim/gamma", "sim/mu", "learning_rate", "entropy")
# Keys of the thinned per-step rows a run's record keeps (besides every diag/* key): what explains
# a curve (noise scale, staleness, reuse, clipping, KL).
ROW_KEYS = ("step", "compute_seconds", "reward_mean", "batch/reward_mean", "loss", "grad_norm",
            "entropy", "learning_rate", "clip_fraction", "ratio_mean", "ratio_max", "kl",
            "tis_weight_mean", "tis_truncated_fraction", "buffer/staleness_mean",
            "buffer/staleness_max", "buffer/batch_use_count_mean", "buffer/replay_ratio",
            "buffer/size", "compute/gamma", "controller/reuse_target", "controller/signal",
            "controller/optimal", "controller/staleness_bound", "controller/guards_fired",
            "controller/newest_unused", "buffer/never_used_fraction",
            "batch_reuse/replay_ratio")
MAX_ROWS = 120  # thinned rows per record beyond the diagnostics rows


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run: `python -m jaxreplay.launch <args> --workdir=DIR/<rel_dir>`.

  `overrides` are the resolved (key, value) pairs after `--config=config`; `identity` hashes the
  fully resolved config, so two specs with the same identity are the same run. `extends`: for a
  run planned with `--extend`, the overrides of the run it continues (the same run to the sweep's
  own budget); a finished run with those is resumed to this one's budget, not started again.
  """
  sweep: str
  arm: str
  seed: int
  config: str
  overrides: tuple[tuple[str, Any], ...]
  identity: str
  extends: tuple[tuple[str, Any], ...] = ()

  @property
  def rel_dir(self) -> str:
    return os.path.join("runs", self.sweep, self.arm, f"seed{self.seed}")

  def args(self) -> list[str]:
    return self._args(self.overrides)

  def base_args(self) -> Optional[list[str]]:
    """The args of the run this one extends (None when it extends none)."""
    return self._args(self.extends) if self.extends else None

  def _args(self, overrides) -> list[str]:
    return [f"--config={self.config}"] + [f"--config.{k}={sweeps_lib.format_value(v)}"
                                          for k, v in overrides]

  def command(self, workdir: str) -> list[str]:
    return ["python", "-m", "jaxreplay.launch", *self.args(), f"--workdir={workdir}"]


# (spec, absolute run directory, log file) -> the launch's exit status.
Runner = Callable[[RunSpec, str, str], int]


def load_config(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file (relative paths: to the repository root)."""
  full = path if os.path.isabs(path) else os.path.join(REPO, path)
  if not os.path.isfile(full):
    raise FileNotFoundError(f"config file {full} not found")
  return runpy.run_path(full)["get_config"]()


def _config_arg(path: str) -> str:
  """A user's --config path as stored in the plan: relative to the repository when inside it."""
  full = os.path.abspath(path)
  rel = os.path.relpath(full, REPO)
  return full if rel.startswith(os.pardir) else rel


def plan_sweep(sweep: sweeps_lib.Sweep, seeds: int, quick: bool = False,
               config: Optional[str] = None, budget: Optional[float] = None,
               extend: float = 1.0) -> dict[str, Any]:
  """Resolves a sweep against its base config: the plan stored in DIR/plans/SWEEP.json.

  extend > 1: every run goes on to extend x the budget (`sweeps.extended_grid`: the grid keeps its
  points and goes on at its own spacing; pass@k also at the new end); a run finished to the
  sweep's own budget is resumed from its last checkpoint (the sweeps' learning rates are
  constant, `sweeps.COMMON`: nothing in a run depends on its horizon), not started again.

  Returns {"sweep", "description", "config", "budget", "grid", "seeds", "quick", "baseline",
  "figure", "figure_x", "arms": {name: {"overrides", "baseline", "family", "tags"}},
  "specs": [RunSpec]}, and "extends": {"budget", "grid"} (the unextended ones) with extend > 1.
  """
  config_path = config or sweep.config
  base = load_config(config_path)
  common = list(sweeps_lib.COMMON) + (list(sweeps_lib.QUICK) if quick else [])
  common = list(dict(common).items())  # QUICK replaces COMMON's values
  common = sweeps_lib.resolve(common, base)
  if base.eval.num_problems < sweeps_lib.EVAL_PROBLEMS and not quick:
    print(f"note: the task of {config_path} holds fewer than {sweeps_lib.EVAL_PROBLEMS} held-out "
          f"problems: {sweep.name} evaluates on {base.eval.num_problems}")
  if budget is None and sweep.budget is not None and not quick:
    budget = sweep.budget
  if budget is None:
    own = float(base.get("compute_budget", 0.0) or 0.0)
    updates = sweeps_lib.QUICK_BUDGET_UPDATES if quick else sweep.budget_updates
    budget = own if own > 0 and not quick else updates * sweeps_lib.update_seconds(base)
  budget = float(f"{budget:.6g}")
  points = sweeps_lib.QUICK_GRID_POINTS if quick else sweep.grid_points
  grid = sweeps_lib.compute_grid(budget, points, sweep.grid_first)
  if extend < 1.0:
    raise ValueError(f"--extend={extend}: a factor >= 1 of the sweep's budget")
  extended = None
  if extend > 1.0:
    extended = sweeps_lib.extended_grid(grid, points, sweep.grid_first, extend)
  arms, specs = {}, []

  def run_end_of(c, grid_, budget_):
    passk = sweeps_lib.passk_grid(grid)  # an extension adds its end to the sweep's own points
    passk = passk if budget_ == budget else tuple(sorted(set(passk + (budget_,))))
    return [("compute_budget", budget_), ("eval.compute_grid", grid_),
            ("eval.passk_grid", passk), ("total_steps", sweeps_lib.total_steps_cap(budget_, c))]

  for arm in sweep.arms:
    c = ml_collections.ConfigDict(base.to_dict())
    protocol = sweeps_lib.resolve(sweep.protocol, c) if not quick else []
    own_overrides = sweeps_lib.resolve(arm.overrides, c)
    base_end = run_end_of(c, grid, budget)
    run_end = base_end if extended is None else run_end_of(c, extended, extended[-1])
    sweeps_lib.apply(c, run_end)
    # One flag per key (a repeated --config.KEY flag is not "last one wins"): later values replace.
    run_overrides = list(dict(common + protocol + own_overrides + run_end).items())
    base_overrides = (list(dict(common + protocol + own_overrides + base_end).items())
                      if extended is not None else [])
    arms[arm.name] = {"overrides": [[k, v] for k, v in own_overrides],
                      "baseline": sweep.baseline_of(arm), "family": arm.family,
                      "tags": {k: v for k, v in arm.tags}}
    for seed in range(seeds):
      sweeps_lib.apply(c, [("seed", seed)])
      identity = hashlib.sha256(json.dumps(c.to_dict(), sort_keys=True, default=str)
                                .encode()).hexdigest()[:16]
      specs.append(RunSpec(sweep.name, arm.name, seed, config_path,
                           tuple(run_overrides) + (("seed", seed),), identity,
                           tuple(base_overrides) + (("seed", seed),) if base_overrides else ()))
  plan = {"sweep": sweep.name, "description": sweep.description, "config": config_path,
          "budget": budget if extended is None else extended[-1],
          "grid": list(grid if extended is None else extended), "seeds": list(range(seeds)),
          "quick": quick, "baseline": sweep.baseline, "figure": sweep.figure,
          "figure_x": sweep.figure_x, "arms": arms, "specs": specs}
  if sweep.targets:
    plan["targets"] = list(sweep.targets)
  if extended is not None:
    plan["extends"] = {"budget": budget, "grid": list(grid)}
  return plan


# ---- running ----------------------------------------------------------------------------------

def _read_json(path: str) -> Optional[dict]:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json(path: str, obj: Any) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, allow_nan=False)
    f.write("\n")
  os.replace(tmp, path)


def _check_spec(out: str, spec: RunSpec) -> None:
  """Fails when DIR holds this run directory from a different configuration."""
  for name in ("spec.json", "done.json"):
    old = _read_json(os.path.join(out, spec.rel_dir, name))
    if old is not None and old.get("args") not in (spec.args(), spec.base_args()):
      raise RuntimeError(
          f"{os.path.join(out, spec.rel_dir)} was started with other settings ({name}: "
          f"{old.get('args')}); use another --out or delete that directory to rerun it with "
          f"{spec.args()}")


def _keep_the_extended_run(d: str, spec: RunSpec) -> None:
  """Before a finished run is resumed to an extended budget: its done.json and record.json are
  kept as done.base.json / record.base.json (what the sweep's own budget gave)."""
  done = _read_json(os.path.join(d, "done.json"))
  if done is None or spec.base_args() is None or done.get("args") != spec.base_args():
    return
  if os.path.isfile(os.path.join(d, "record.json")):
    shutil.copyfile(os.path.join(d, "record.json"), os.path.join(d, "record.base.json"))
  os.replace(os.path.join(d, "done.json"), os.path.join(d, "done.base.json"))


def _die_with_parent() -> None:
  """Linux: the launch gets SIGTERM when the thread that started it dies, so a killed experiments
  command leaves no run behind writing into a directory a rerun will resume."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def launch_subprocess(spec: RunSpec, workdir: str, log_path: str,
                      env: Optional[dict[str, str]] = None) -> int:
  """Runs the spec's launch command in a subprocess (output appended to `log_path`)."""
  cmd = [sys.executable] + spec.command(workdir)[1:]
  with open(log_path, "a", encoding="utf-8") as log:
    log.write(f"\n$ {shlex.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                          preexec_fn=_die_with_parent, check=False).returncode


def subprocess_runner(out: str) -> Runner:
  """`launch_subprocess` with a persistent JAX compilation cache shared by the runs of DIR
  (DIR/jax_cache, unless JAX_COMPILATION_CACHE_DIR is set): a program compiles once, not per run."""
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(os.path.join(out, "jax_cache")))
  return functools.partial(launch_subprocess, env=env)



def execute(specs: Sequence[RunSpec], out: str, runner: Runner,
            parallel: int = 1, log: Callable[[str], None] = print,
            on_finish: Optional[Callable[[], None]] = None) -> list[str]:
  """Runs every spec not finished yet (`parallel` at a time, seed-major); returns the failed
  run dirs.

  Specs of one identity run once: the member already done (or started) runs, the others get a
  done.json with `alias_of` when it succeeds. `on_finish()` is called (under a lock) after each
  run that succeeds, e.g. to rewrite results.json while a long sweep goes on.
  """
  for s in specs:
    _check_spec(out, s)
  groups: dict[str, list[RunSpec]] = {}
  for s in specs:
    groups.setdefault(s.identity, []).append(s)

  def rank(s: RunSpec) -> int:
    d = os.path.join(out, s.rel_dir)
    done = _read_json(os.path.join(d, "done.json"))
    if done is not None and "alias_of" not in done and done.get("args") == s.args():
      return 0
    return 1 if os.path.isfile(os.path.join(d, "spec.json")) else 2

  todo = []
  for members in groups.values():
    canonical = min(members, key=rank)  # min is stable: the first of equal rank
    todo.append((canonical, [m for m in members if m is not canonical]))
  # Seed-major: every arm's first seed runs before any arm's second, so a sweep stopped early
  # (a session's end) still compares every arm.
  pending = sorted(((c, al) for c, al in todo if rank(c) != 0), key=lambda item: item[0].seed)
  aliases_of = {c.identity: al for c, al in todo}

  def _write_alias(a: RunSpec, canonical: RunSpec) -> None:
    done = _read_json(os.path.join(out, a.rel_dir, "done.json"))
    if rank(a) != 0 and (done is None or done.get("args") != a.args()):
      _write_json(os.path.join(out, a.rel_dir, "done.json"), {
          "args": a.args(), "identity": a.identity, "alias_of": canonical.rel_dir})

  log(f"{len(specs)} runs, {len(groups)} distinct, {len(pending)} to run")
  lock, failed, counter = threading.Lock(), [], [0]

  def run_one(canonical: RunSpec) -> bool:
    d = os.path.join(out, canonical.rel_dir)
    os.makedirs(d, exist_ok=True)
    _keep_the_extended_run(d, canonical)
    _write_json(os.path.join(d, "spec.json"), {"args": canonical.args(),
                                               "identity": canonical.identity})
    t0 = time.time()
    rc = runner(canonical, os.path.abspath(d), os.path.join(d, "launch.log"))
    wall = time.time() - t0
    with open(os.path.join(d, "attempts.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps({"returncode": rc, "wall_seconds": round(wall, 1)}) + "\n")
    with lock:
      counter[0] += 1
      log(f"[{counter[0]}/{len(pending)}] {canonical.rel_dir}: "
          f"{'done' if rc == 0 else f'FAILED (exit {rc}, see launch.log)'} in {wall:.0f} s")
    if rc != 0:
      return False
    with open(os.path.join(d, "attempts.jsonl"), encoding="utf-8") as f:
      attempts = [json.loads(line) for line in f]
    _write_json(os.path.join(d, "done.json"), {
        "args": canonical.args(), "command": shlex.join(canonical.command(os.path.abspath(d))),
        "identity": canonical.identity, "attempts": len(attempts),
        "wall_seconds": round(sum(a["wall_seconds"] for a in attempts), 1)})
    write_record(d)
    with lock:
      for alias in aliases_of[canonical.identity]:
        _write_alias(alias, canonical)
      if on_finish is not None:
        on_finish()
    return True

  results = {}
  with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
    futures = {pool.submit(run_one, c): c for c, _ in pending}
    try:
      for f in concurrent.futures.as_completed(futures):
        results[futures[f]] = f.result()
    except BaseException:  # Ctrl-C: start nothing more (running launches got the signal too)
      for f in futures:
        f.cancel()
      raise
  for canonical, aliases in todo:
    if not results.get(canonical, rank(canonical) == 0):
      failed.append(canonical.rel_dir)
      continue
    for a in aliases:
      _write_alias(a, canonical)
  return failed


# ---- results ----------------------------------------------------------------------------------

def _curve(rows: Sequence[dict]) -> list[dict]:
  """The rows at evaluation points, trimmed to CURVE_KEYS and eval/*, with `reward_mean_window`:
  the mean training reward of the rows since the previous evaluation point."""
  curve, window = [], []
  for r in rows:
    v = r.get("reward_mean")
    if isinstance(v, (int, float)) and math.isfinite(v):
      window.append(float(v))
    if isinstance(r.get(stats_lib.PRIMARY), (int, float)):
      row = {k: r[k] for k in CURVE_KEYS if k in r}
      row.update({k: v for k, v in r.items() if k.startswith("eval/")})
      row["reward_mean_window"] = sum(window) / len(window) if window else None
      curve.append(row)
      window = []
  return stats_lib.eval_rows(curve)


def _thinned_rows(rows: Sequence[dict]) -> list[dict]:
  """The per-step rows a record keeps: every row with regime diagnostics (diag/noise_scale, every
  log.diagnostics_every steps) and every n-th of the others (at most MAX_ROWS), trimmed to ROW_KEYS
  and diag/*."""
  train = [r for r in rows if r.get("step", 0) > 0]
  every = max(1, math.ceil(len(train) / MAX_ROWS))
  out = []
  for i, r in enumerate(train):
    if "diag/noise_scale" in r or i % every == 0 or i == len(train) - 1:
      row = {k: r[k] for k in ROW_KEYS if k in r}
      row.update({k: v for k, v in r.items() if k.startswith("diag/")})
      out.append(row)
  return out


def _run_stats(rows: Sequence[dict], done: dict) -> dict[str, Any]:
  """Per-run numbers for the summaries: final replay ratio, gamma, mu, steps and compute; mean
  batch staleness over the steps; wall seconds."""
  last = rows[-1] if rows else {}
  stale = [r["buffer/staleness_mean"] for r in rows
           if isinstance(r.get("buffer/staleness_mean"), (int, float))]
  out = {k: last.get(k) for k in ("buffer/replay_ratio", "compute/gamma", "compute/mu",
                                  "compute/measured_mu", "step", "compute_seconds")}
  # Uses per rollout whatever reuses it: the buffer's count, or with several updates per fresh
  # batch (ppo_epochs, the gradient gate) that reuse, which the buffer's count does not see.
  out["uses_per_rollout"] = last.get("batch_reuse/replay_ratio", out["buffer/replay_ratio"])
  out["buffer/staleness_mean"] = sum(stale) / len(stale) if stale else None
  out["wall_seconds"] = done.get("wall_seconds")
  # The off-policy options' statistics (issue 27), when the run logged them: mean over its steps
  # of each masked / truncated fraction, and the rollouts max_uses retired by the end.
  for key in sorted({k for r in rows for k in r if _is_off_policy_stat(k)}):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    out[key] = sum(values) / len(values) if values else None
  if isinstance(last.get("buffer/retired"), (int, float)):
    out["buffer/retired"] = last["buffer/retired"]
  return out


def _is_off_policy_stat(key: str) -> bool:
  """A training row's masked / truncated fraction (`learner.corrections`, `data.buffer`)."""
  return not key.startswith("eval/") and (
      key.endswith(("masked_fraction", "masked_sequence_fraction", "truncated_fraction",
                    "zero_variance_fraction")) or key == "m2po_second_moment")


RECORD = "record.json"


def write_record(run_dir: str) -> dict[str, Any]:
  """Writes RUN/record.json: the run's curve (metrics rows at eval points), statistics and
  resolved config, all results.json needs, and its thinned per-step rows (`_thinned_rows`: the
  regime diagnostics that explain a figure; kept here, not copied into results.json). It is small
  (tens of KB), so a sweep directory can be kept in git without metrics.jsonl, checkpoints or
  TensorBoard files, and a fresh clone rebuilds results.json and skips the finished runs."""
  done = _read_json(os.path.join(run_dir, "done.json")) or {}
  rows = metrics_lib.read_metrics(run_dir)
  record = _sanitize({"curve": _curve(rows), "stats": _run_stats(rows, done),
                      "run_config": _read_json(os.path.join(run_dir, "run_config.json")),
                      "rows": _thinned_rows(rows)})
  _write_json(os.path.join(run_dir, RECORD), record)
  return record


def load_run(out: str, spec_args: list[str], rel_dir: str) -> Optional[dict[str, Any]]:
  """A finished run's record for results.json (None when it has not finished)."""
  done = _read_json(os.path.join(out, rel_dir, "done.json"))
  if done is None:
    return None
  source = done.get("alias_of", rel_dir)
  src_done = _read_json(os.path.join(out, source, "done.json")) or {}
  record = _read_json(os.path.join(out, source, RECORD))
  if record is None:
    record = write_record(os.path.join(out, source))
  return {"args": spec_args, "source": source, "wall_seconds": src_done.get("wall_seconds"),
          "run_config": record["run_config"], "stats": record["stats"], "curve": record["curve"]}


def _sanitize(obj: Any) -> Any:
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if isinstance(obj, dict):
    return {str(k): _sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_sanitize(v) for v in obj]
  return obj


def build_results(out: str) -> dict[str, Any]:
  """results.json from every plan in DIR/plans (sweeps in definition order) and finished run."""
  plans = {}
  for name in sweeps_lib.SWEEPS:
    p = _read_json(os.path.join(out, "plans", f"{name}.json"))
    if p is not None:
      plans[name] = p
  results: dict[str, Any] = {"format": RESULTS_FORMAT, "sweeps": {}, "runs": {}}
  for name, plan in plans.items():
    curves: dict[str, dict[int, list]] = {}
    run_stats: dict[str, dict[int, dict]] = {}
    for spec in plan["runs"]:
      run = load_run(out, spec["args"], spec["rel_dir"])
      if run is None:
        continue
      run.update(sweep=name, arm=spec["arm"], seed=spec["seed"])
      results["runs"][spec["rel_dir"]] = run
      curves.setdefault(spec["arm"], {})[spec["seed"]] = run["curve"]
      run_stats.setdefault(spec["arm"], {})[spec["seed"]] = run["stats"]
    summary = stats_lib.sweep_summary(
        curves, run_stats, plan["grid"], {a: v["baseline"] for a, v in plan["arms"].items()},
        plan["baseline"])
    if any(a.get("family") for a in plan["arms"].values()):
      families = families_lib.family_summary(summary["arms"], plan["arms"])
      base_family = plan["arms"].get(plan["baseline"], {}).get("family")
      targets = families_lib.add_compute_to_target(families, curves, base_family,
                                                   fixed=plan.get("targets"))
      families_lib.add_frontier_to_target(families, curves, plan["arms"], base_family, targets)
      summary["families"] = families
      summary["family_targets"] = {"baseline_family": base_family, "targets": targets,
                                   "rule": (stats_lib.TARGET_RULE if not plan.get("targets") else
                                            "fixed by the sweep (sweeps.DENSE_TARGETS)")}
    results["sweeps"][name] = {k: v for k, v in plan.items() if k != "runs"}
    results["sweeps"][name]["finished_runs"] = sum(len(v) for v in curves.values())
    results["sweeps"][name]["planned_runs"] = len(plan["runs"])
    results["sweeps"][name]["summary"] = summary
  return _sanitize(results)


def write_results(out: str) -> dict[str, Any]:
  """DIR/results.json and DIR/report.md (its tables, `jaxreplay.science.report`)."""
  results = build_results(out)
  _write_json(os.path.join(out, "results.json"), results)
  report_lib.write_report(results, os.path.join(out, "report.md"))
  return results


def save_plan(out: str, plan: dict[str, Any], command: str) -> None:
  record = {k: v for k, v in plan.items() if k != "specs"}
  record["command"] = command
  record["runs"] = [{"arm": s.arm, "seed": s.seed, "rel_dir": s.rel_dir, "args": s.args()}
                    for s in plan["specs"]]
  _write_json(os.path.join(out, "plans", f"{plan['sweep']}.json"), _sanitize(record))


# ---- command line -----------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None, runner: Optional[Runner] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxreplay.experiments", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sweep", required=True,
                      help=f"comma-separated sweeps or all: {', '.join(sweeps_lib.SWEEPS)}")
  parser.add_argument("--seeds", type=int, default=None,
                      help="seeds per arm (default: the sweep's minimum, 4 for fig1, 3 otherwise)")
  parser.add_argument("--out", required=True, help="output directory DIR")
  parser.add_argument("--quick", action="store_true",
                      help="tiny budget and evaluation: the whole pipeline in about a minute")
  parser.add_argument("--config", default=None, help="base config file replacing the sweeps' own")
  parser.add_argument("--budget", type=float, default=None,
                      help="compute budget of every run [device-seconds] (default: the base "
                      "config's compute_budget, else the sweep's budget in on-policy updates)")
  parser.add_argument("--extend", type=float, default=1.0,
                      help="a factor > 1: every run goes on to this multiple of the budget, its "
                      "evaluation grid continued at the grid's own spacing; runs finished to the "
                      "sweep's budget are resumed from their last checkpoint (constant learning "
                      "rates), their first records kept as done.base.json / record.base.json")
  parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
  parser.add_argument("--arms", default="",
                      help="comma-separated arm names or globs (e.g. 'adaptive_*,replay_lr3x'): "
                      "run only these arms' seeds; results.json still reports every finished run")
  parser.add_argument("--dry_run", action="store_true", help="print the run commands and exit")
  parser.add_argument("--report_only", action="store_true",
                      help="launch nothing: rebuild results.json and figures from finished runs")
  args = parser.parse_args(argv)
  out = args.out
  config = _config_arg(args.config) if args.config else None
  plans = []
  for sweep in sweeps_lib.get(args.sweep):
    seeds = args.seeds if args.seeds is not None else sweep.min_seeds
    if seeds < sweep.min_seeds:
      print(f"warning: {sweep.name} with {seeds} seeds (< {sweep.min_seeds}, the method's minimum)")
    plan = plan_sweep(sweep, seeds, quick=args.quick, config=config, budget=args.budget,
                      extend=args.extend)
    command = " ".join(["python -m jaxreplay.experiments", f"--sweep={sweep.name}",
                        f"--seeds={seeds}", f"--out={out}"] + (["--quick"] if args.quick else [])
                       + ([f"--config={config}"] if config else [])
                       + ([f"--budget={args.budget:g}"] if args.budget is not None else [])
                       + ([f"--extend={args.extend:g}"] if args.extend != 1.0 else []))
    plans.append((plan, command))
  arm_patterns = [a for a in args.arms.split(",") if a]
  if arm_patterns:
    known = {a for p, _ in plans for a in p["arms"]}
    unmatched = [a for a in arm_patterns if not fnmatch.filter(known, a)]
    if unmatched:
      raise SystemExit(f"--arms: {', '.join(unmatched)} match no arm of {args.sweep} "
                       f"(arms: {', '.join(sorted(known))})")
  specs = [s for p, _ in plans for s in p["specs"]
           if not arm_patterns or any(fnmatch.fnmatch(s.arm, a) for a in arm_patterns)]
  if args.dry_run:
    for s in specs:
      print(shlex.join(s.command(os.path.join(out, s.rel_dir))))
    return 0
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, ".lock"), "w", encoding="utf-8") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
    except BlockingIOError:
      print(f"another `jaxreplay.experiments` command is running in {out}: wait for it")
      return 2
    return _run(out, plans, runner or subprocess_runner(out), args.parallel, args.report_only,
                specs)


def _run(out: str, plans: list[tuple[dict[str, Any], str]], runner: Runner, parallel: int,
         report_only: bool, selected: Optional[list] = None) -> int:
  """Checks, saves the plans, runs what is left (of `selected`, default every planned run),
  writes results.json and the figures."""
  specs = [s for p, _ in plans for s in p["specs"]] if selected is None else selected
  for s in specs:  # before any plan is written: a mismatch leaves DIR as it was
    _check_spec(out, s)
  for plan, command in plans:
    save_plan(out, plan, command)
  failed = [] if report_only else execute(specs, out, runner=runner, parallel=parallel,
                                          on_finish=lambda: write_results(out))
  results = write_results(out)
  from jaxreplay.science import plots  # pylint: disable=g-import-not-at-top  (matplotlib)
  paths = plots.plot_all(results, os.path.join(out, "figures"))
  print(f"wrote {os.path.join(out, 'results.json')} and {len(paths)} figures in "
        f"{os.path.join(out, 'figures')}")
  if failed:
    print(f"{len(failed)} runs failed (rerun the command to resume them): {', '.join(failed)}")
    return 1
  return 0

