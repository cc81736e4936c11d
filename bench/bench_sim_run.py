"""Where a simulated scratchpad run at B = 512 spends its time: generation, train step, evaluation,
reward scoring, the rest.

Runs `configs/scratchpad_large_batch.py` with the pareto sweep's evaluation protocol (1024 held-out
problems: pass@1 of 4 samples at T=0.1; pass@k of 32 samples at T=1) for a few updates, in this
process, and times each part of it by wrapping the functions that do the work (exclusive times: a
part nested in another counts once, in the inner one):

  generation        the rollout worker's sampler calls (JaxSampler.generate / generate_requests)
  reward_scoring    decoding + scoring the training rollouts (experience.score_groups)
  train_step        sampling the batch, collate, the jitted step (+ regime diagnostics when due)
  generated_hook    the pipeline's generation accounting and log-prob mismatch probe
  eval_generation   the evaluation sampler's calls; eval_scoring: scoring them; eval_other: the rest
  publish, checkpoint, other (startup, compilation outside the parts above, the event loop)

The run evaluates pass@1 only at step 0 and the full protocol (pass@1 + pass@k) at its last step,
so `eval_pass1` / `eval_passk` per evaluation can be read off the table, and projects a whole
pareto run from the per-update and per-evaluation costs. Wall seconds are printed beside process
CPU seconds (all threads): the machine is shared, CPU seconds are the steadier number. An untimed
1-update run first compiles every program (--no_warmup skips it).

  python bench/bench_sim_run.py --arm=onpolicy --updates=6 --label=before
  python bench/bench_sim_run.py --arm=replay --updates=12 --label=after \
      --set scheduler.generation_batch=0 --set eval.batch_size=128

Prints a table and writes bench/results/sim_run_<arm>_<label>.json.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxreplay-bench-jax-cache")

from jaxreplay.data import experience  # noqa: E402
from jaxreplay.rollout import jax_sampler  # noqa: E402
from jaxreplay.run import evaluation  # noqa: E402
from jaxreplay.run import pipeline  # noqa: E402
from jaxreplay.science import runner, sweeps  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PARTS = ("generation", "reward_scoring", "train_step", "generated_hook", "eval_generation",
         "eval_scoring", "eval_other", "publish", "checkpoint", "other")
ARMS = {"onpolicy": sweeps.ON_POLICY, "replay": (),
        "posbias": (("buffer.positive_fraction", 0.5),), "adaptive": sweeps.ADAPTIVE}


class PartTimer:
  """Exclusive wall and process-CPU seconds per part: a timed call inside another timed call
  counts only in the inner part."""

  def __init__(self):
    self.wall = {p: 0.0 for p in PARTS}
    self.cpu = {p: 0.0 for p in PARTS}
    self.calls = {p: 0 for p in PARTS}
    self._stack: list[list[float]] = []  # per open region: [children wall, children cpu]
    self.in_eval = 0
    self.evals: list[dict] = []  # per evaluate call: inclusive wall / cpu seconds, pass@k or not

  @contextlib.contextmanager
  def part(self, name: str):
    w0, c0 = time.perf_counter(), time.process_time()
    self._stack.append([0.0, 0.0])
    try:
      yield
    finally:
      kids_w, kids_c = self._stack.pop()
      w, c = time.perf_counter() - w0, time.process_time() - c0
      self.wall[name] += w - kids_w
      self.cpu[name] += c - kids_c
      self.calls[name] += 1
      if self._stack:
        self._stack[-1][0] += w
        self._stack[-1][1] += c

  def wrap(self, owner, attr: str, name, eval_scope: bool = False):
    """Replaces owner.attr by a timed version; `name` is a part or a fn(timer) -> part."""
    fn = getattr(owner, attr, None)
    if fn is None:
      return
    timer = self

    def timed(*args, **kwargs):
      part = name(timer) if callable(name) else name
      if eval_scope:
        timer.in_eval += 1
      w0, c0 = time.perf_counter(), time.process_time()
      try:
        with timer.part(part):
          return fn(*args, **kwargs)
      finally:
        if eval_scope:
          timer.in_eval -= 1
          timer.evals.append({"wall_s": time.perf_counter() - w0,
                              "cpu_s": time.process_time() - c0,
                              "passk": bool(kwargs.get("n_samples", 16))})
    setattr(owner, attr, timed)


def instrument(timer: PartTimer) -> None:
  gen = lambda t: "eval_generation" if t.in_eval else "generation"
  timer.wrap(jax_sampler.JaxSampler, "generate", gen)
  timer.wrap(jax_sampler.JaxSampler, "generate_requests", gen)
  timer.wrap(experience, "score_groups", "reward_scoring")
  timer.wrap(evaluation, "score_groups", "eval_scoring")
  timer.wrap(evaluation, "evaluate", "eval_other", eval_scope=True)
  timer.wrap(pipeline.Pipeline, "sample_rollouts", "train_step")
  timer.wrap(pipeline.Pipeline, "train_on", "train_step")
  timer.wrap(pipeline.Pipeline, "generated", "generated_hook")
  timer.wrap(pipeline.Pipeline, "publish", "publish")
  timer.wrap(pipeline.Pipeline, "checkpoint", "checkpoint")


def run_config(arm: str, updates: int, eval_problems: int, sets: list[tuple[str, object]]):
  c = runner.load_config(sweeps.LARGE_BATCH_CONFIG)
  sweeps.apply(c, sweeps.resolve(list(sweeps.COMMON), c))
  sweeps.apply(c, sweeps.resolve(list(ARMS[arm]), c))
  end = 1e12  # pass@1 alone at step 0; the full protocol at the last step
  sweeps.apply(c, [("total_steps", updates), ("compute_budget", 0.0),
                   ("eval.num_problems", eval_problems), ("eval.pass1_problems", eval_problems),
                   ("eval.compute_grid", (0.0, end)), ("eval.passk_grid", (end,)),
                   ("checkpoint.every", 0), ("log.every_s", 1e9)])
  sweeps.apply(c, sets)
  return c


def parse_set(text: str) -> tuple[str, object]:
  key, _, value = text.partition("=")
  if not key or not _:
    raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE")
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--arm", choices=sorted(ARMS), default="onpolicy")
  ap.add_argument("--updates", type=int, default=6, help="gradient steps of the timed run")
  ap.add_argument("--eval_problems", type=int, default=1024)
  ap.add_argument("--set", type=parse_set, action="append", default=[],
                  help="KEY=VALUE config override (repeatable)")
  ap.add_argument("--label", default="run")
  ap.add_argument("--project_updates", type=int, default=0,
                  help="updates of the projected whole run (0: 400 on-policy, 800 otherwise)")
  ap.add_argument("--project_pass1_evals", type=int, default=10,
                  help="pass@1-only evaluations of the projected run (the compute grid's points)")
  ap.add_argument("--project_passk_evals", type=int, default=2)
  ap.add_argument("--workdir", default="")
  ap.add_argument("--no_warmup", action="store_true",
                  help="skip the untimed 1-update run that compiles every program first")
  args = ap.parse_args()

  c = run_config(args.arm, args.updates, args.eval_problems, args.set)
  if not args.no_warmup:  # same shapes, so the timed run finds every program compiled
    pipeline.run(run_config(args.arm, 1, 32, args.set), tempfile.mkdtemp(prefix="bench_warm_"))
  timer = PartTimer()
  instrument(timer)
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_sim_run_")
  w0, c0 = time.perf_counter(), time.process_time()
  summary = pipeline.run(c, workdir)
  total_wall, total_cpu = time.perf_counter() - w0, time.process_time() - c0
  timer.wall["other"] += total_wall - sum(timer.wall.values())
  timer.cpu["other"] += total_cpu - sum(timer.cpu.values())

  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  last = rows[-1]
  pass1 = [e for e in timer.evals if not e["passk"]]
  full = [e for e in timer.evals if e["passk"]]
  per_update_parts = ("generation", "reward_scoring", "train_step", "generated_hook", "publish")
  updates = args.project_updates or (400 if args.arm == "onpolicy" else 800)
  per_update, eval_pass1, eval_full, projected = {}, {}, {}, {}
  for unit in ("wall", "cpu"):
    times = getattr(timer, unit)
    per_update[unit] = sum(times[p] for p in per_update_parts) / args.updates
    eval_pass1[unit] = pass1[0][f"{unit}_s"] if pass1 else float("nan")
    eval_full[unit] = full[-1][f"{unit}_s"] if full else float("nan")
    projected[unit] = (updates * per_update[unit] + args.project_pass1_evals * eval_pass1[unit]
                       + args.project_passk_evals * eval_full[unit])
  rnd = lambda d: {k: round(v, 3) for k, v in d.items()}
  out = {
      "arm": args.arm, "label": args.label, "updates": args.updates,
      "eval_problems": args.eval_problems, "overrides": {k: v for k, v in args.set},
      "wall_s": rnd(timer.wall), "cpu_s": rnd(timer.cpu), "calls": timer.calls,
      "total_wall_s": round(total_wall, 3), "total_cpu_s": round(total_cpu, 3),
      "per_update_s": rnd(per_update), "eval_pass1_s": rnd(eval_pass1),
      "eval_full_s": rnd(eval_full), "evals": timer.evals,
      "projected_run": {"updates": updates, "pass1_evals": args.project_pass1_evals,
                        "passk_evals": args.project_passk_evals, "seconds": rnd(projected)},
      "final": {k: last.get(k) for k in ("eval/pass@1", "eval/pass@32", "sim/compute_seconds",
                                         "sim/speculative_rows", "sim/speculative_discarded",
                                         "reward_mean")},
      "summary_step": summary.get("step"),
      "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                  "loadavg_end": os.getloadavg(), "python": platform.python_version()},
      "workdir": workdir,
  }
  print(f"\n{args.arm} / {args.label}: {args.updates} updates, evals of {args.eval_problems} "
        f"problems ({workdir})")
  print(f"{'part':<16}{'wall s':>10}{'cpu s':>10}{'calls':>8}{'cpu share':>10}")
  for p in PARTS:
    print(f"{p:<16}{timer.wall[p]:>10.2f}{timer.cpu[p]:>10.2f}{timer.calls[p]:>8d}"
          f"{timer.cpu[p] / total_cpu:>10.1%}")
  print(f"{'total':<16}{total_wall:>10.2f}{total_cpu:>10.2f}")
  print(f"per update (generation, scoring, train step, hooks): {per_update['cpu']:.2f} cpu s "
        f"({per_update['wall']:.2f} wall); evaluation pass@1: {eval_pass1['cpu']:.1f} cpu s, "
        f"pass@1 + pass@k: {eval_full['cpu']:.1f} cpu s")
  print(f"projected run ({updates} updates, {args.project_pass1_evals} pass@1 + "
        f"{args.project_passk_evals} full evals): {projected['cpu'] / 60:.1f} cpu min "
        f"({projected['wall'] / 60:.1f} wall min here)")
  os.makedirs(RESULTS, exist_ok=True)
  path = os.path.join(RESULTS, f"sim_run_{args.arm}_{args.label}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
