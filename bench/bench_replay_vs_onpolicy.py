"""Replay buffer vs the on-policy baseline on the tiny default: held-out pass@1 against compute.

  python bench/bench_replay_vs_onpolicy.py [--seeds 0,1,2] [--steps 400] [--out bench/results]

Runs `configs/tiny.py` (simulated schedule (W, T) = (4, 1), mu 6.84, JAX backend so every run is
deterministic) once per seed with the replay buffer (N=256, B=64) and once with
`buffer.on_policy=True` (a queue: each rollout used once), the paper's Figure 1 comparison.
`compute_seconds` is the simulated device-seconds of the paper's hardware split (generation +
training), so the x axis does not depend on this machine's noise.

Prints a table, writes `replay_vs_onpolicy.json` (per arm: median final pass@1, median compute, and
the compute at which the median pass@1 curve first reaches each target) and
`replay_vs_onpolicy.png` (median and IQR over seeds, from `jaxreplay.plot`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxreplay import plot  # pylint: disable=wrong-import-position

ARMS = {"replay": [], "onpolicy": ["--config.buffer.on_policy=True"]}


def run_arm(workdir: str, seed: int, steps: int, eval_every: int, extra: list[str]) -> float:
  cmd = [sys.executable, "-m", "jaxreplay.launch", f"--config={REPO}/configs/tiny.py",
         f"--workdir={workdir}", f"--config.seed={seed}", f"--config.total_steps={steps}",
         f"--config.eval.every={eval_every}", "--config.rollout.backend=jax",
         f"--config.checkpoint.every={steps}", *extra]
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
  return time.time() - t0


def median_curve(run_dirs: list[str], y: str) -> tuple[np.ndarray, np.ndarray]:
  """(x grid, median y over runs) on the overlap of the runs' compute ranges."""
  series = [plot.load_series(d, "compute_seconds", y) for d in run_dirs]
  agg = plot.aggregate(series)
  return agg["x"], agg["median"]


def first_reach(x: np.ndarray, y: np.ndarray, target: float) -> float | None:
  hit = np.nonzero(y >= target)[0]
  return float(x[hit[0]]) if len(hit) else None


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--eval_every", type=int, default=25)
  ap.add_argument("--runs", default="/tmp/jaxreplay_bench_runs")
  ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
  ap.add_argument("--targets", default="0.75,0.8,0.85")
  args = ap.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  targets = [float(t) for t in args.targets.split(",")]
  os.makedirs(args.out, exist_ok=True)

  dirs: dict[str, list[str]] = {arm: [] for arm in ARMS}
  wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
  for seed in seeds:
    for arm, extra in ARMS.items():
      d = os.path.join(args.runs, f"{arm}_s{seed}")
      if os.path.exists(os.path.join(d, "metrics.jsonl")):
        subprocess.run(["rm", "-rf", d], check=True)
      wall[arm].append(run_arm(d, seed, args.steps, args.eval_every, extra))
      dirs[arm].append(d)
      print(f"{arm} seed {seed}: {wall[arm][-1]:.0f} s wall", flush=True)

  result = {"config": "configs/tiny.py", "steps": args.steps, "seeds": seeds, "arms": {}}
  for arm, run_dirs in dirs.items():
    finals = [plot.load_series(d, "step", "eval/pass@1") for d in run_dirs]
    starts = [float(y[0]) for _, y in finals]
    ends = [float(y[-1]) for _, y in finals]
    compute = [float(plot.load_series(d, "step", "compute_seconds")[1][-1]) for d in run_dirs]
    grid, med = median_curve(run_dirs, "eval/pass@1")
    by_step: dict[int, list[float]] = {}
    for xs, ys in finals:
      for st, v in zip(xs, ys):
        by_step.setdefault(int(st), []).append(float(v))
    result["arms"][arm] = {
        "pass@1_start": float(np.median(starts)), "pass@1_final_median": float(np.median(ends)),
        "pass@1_final": ends, "compute_seconds_final_median": float(np.median(compute)),
        "wall_seconds_median": float(np.median(wall[arm])),
        "compute_to_reach": {f"{t:g}": first_reach(grid, med, t) for t in targets},
        "median_pass@1_by_step": {k: float(np.median(v)) for k, v in sorted(by_step.items())},
    }
  rep, onp = result["arms"]["replay"], result["arms"]["onpolicy"]
  result["compute_ratio_replay_over_onpolicy"] = {
      k: (rep["compute_to_reach"][k] / onp["compute_to_reach"][k]
          if rep["compute_to_reach"][k] and onp["compute_to_reach"][k] else None)
      for k in rep["compute_to_reach"]}

  png = os.path.join(args.out, "replay_vs_onpolicy.png")
  all_dirs = [d for ds in dirs.values() for d in ds]
  plot.plot_runs(all_dirs, x="compute_seconds", ys=["eval/pass@1", "eval/pass@1_t1"], out=png,
                 group=r"(.*)_s\d+")
  with open(os.path.join(args.out, "replay_vs_onpolicy.json"), "w") as f:
    json.dump(result, f, indent=1)

  print(f"\n{'arm':10s} {'pass@1 start':>12s} {'final (median)':>15s} {'compute s':>10s} "
        + " ".join(f"{'to ' + format(t, 'g'):>9s}" for t in targets) + f" {'wall s':>7s}")
  for arm, r in result["arms"].items():
    reach = " ".join(f"{(v if v is not None else float('nan')):9.0f}"
                     for v in r["compute_to_reach"].values())
    print(f"{arm:10s} {r['pass@1_start']:12.3f} {r['pass@1_final_median']:15.3f} "
          f"{r['compute_seconds_final_median']:10.0f} {reach} {r['wall_seconds_median']:7.0f}")
  print("compute to reach target, replay / on-policy:",
        {k: (round(v, 3) if v else None)
         for k, v in result["compute_ratio_replay_over_onpolicy"].items()})
  print(f"wrote {png}")


if __name__ == "__main__":
  main()
