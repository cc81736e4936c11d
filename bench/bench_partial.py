"""Partial rollouts (`rollout.partial="continue"`) on long-tailed completion lengths, with and without.

Two measurements, both on the completion lengths of `configs/scratchpad_longtail.py` (1-8 digit
scratchpad additions with a geometric tail: 12 to 82 tokens, most short):

1. Simulated costs (`--sim`, seconds, no training): a discrete-event model of W pool workers beside
   one trainer that consumes B fresh rollouts per update (the on-policy queue) and publishes new
   weights after each update. A worker call of R rows costs prefill + decode steps, by one of two
   cost models: "padded" (the JAX sampler: every decode step costs a whole batch of R rows until
   the call's longest completion ends) and "continuous" (vLLM: a step costs in proportion to the
   rows still running). "off" generates whole requests per call; "continue" advances the rows in
   chunks of C tokens, refills finished rows at chunk boundaries, re-prefills the contexts
   (prompt + tokens so far) every chunk, and tags each token with the version of its chunk. The
   costs are calibrated on this machine's JAX sampler (one decode step of a batch of R rows, and
   prefill per token), so the model's time unit is seconds here. Reported: the trainer's idle
   fraction, generation throughput (generated tokens per worker-busy second), token staleness at
   training time, and the rollouts spanning several versions.
2. Real async runs (`--real`): `python -m jaxreplay.launch --config=configs/scratchpad_longtail.py`
   with the on-policy queue, per backend (jax, vllm) and arm (off, continue), seeds interleaved
   (the machine is shared: arms alternate so that load drifts hit both). Reported from the
   metrics rows: the trainer's wait for rollouts (time/trainer_wait_s) over the wall time,
   generation throughput (pool/tokens / pool/generate_seconds, and per wall second), token
   staleness, and held-out pass@1 at the same number of updates (same rollouts consumed: equal
   training compute) with the measured compute_seconds beside it.

  python bench/bench_partial.py --sim
  python bench/bench_partial.py --real --backends=jax,vllm --steps=24 --seeds=0,1

Prints tables and writes bench/results/partial_rollouts.json (the parts run; a later run keeps the
other part's results in the file).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_io import write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
CONFIG = os.path.join(REPO, "configs", "scratchpad_longtail.py")


# ---- the completion lengths ---------------------------------------------------------------------

def task_lengths(n: int, seed: int = 0) -> np.ndarray:
  """Completion lengths [tokens] (worked solution + eos) of `n` training problems of the longtail
  config's task: what its warm-started policy writes."""
  from jaxreplay.run import build  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(REPO, "configs"))
  import scratchpad_longtail  # pylint: disable=g-import-not-at-top
  task = build.make_task(scratchpad_longtail.get_config().task)
  problems = task.sample(np.random.default_rng(seed), n)
  task.close()
  return np.asarray([len(p.answer) + 1 for p in problems], np.int64)


# ---- calibration of the simulated costs ------------------------------------------------------

def calibrate(rows: int, prompt_len: int = 16) -> dict[str, float]:
  """Seconds of the JAX sampler (the longtail config's nano model) per decode step of a batch of
  `rows`, and per prefilled context token (median of repeats, after compiling)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import presets, transformer  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.base import SamplingParams  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  cfg = presets.nano(vocab_size=32)
  sampler = JaxSampler(cfg, transformer.init_params(cfg, jax.random.key(0)), max_len=112,
                       batch_size=rows, eos_token_ids=())
  def timed(prompt, max_tokens, repeats=5):
    prompts = [np.full(prompt, 3, np.int32)] * rows
    sampler.generate(prompts, 1, SamplingParams(max_tokens=max_tokens))  # compile
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      sampler.generate(prompts, 1, SamplingParams(max_tokens=max_tokens))
      ts.append(time.perf_counter() - t0)
    return float(np.median(ts))
  short, long_ = timed(prompt_len, 1), timed(prompt_len, 33)
  step = (long_ - short) / 32
  long_prompt = timed(4 * prompt_len, 1)
  per_token = max((long_prompt - short) / (3 * prompt_len * rows), 0.0)
  return {"decode_step_s": step, "prefill_token_s": per_token, "call_overhead_s":
          max(short - step - prompt_len * rows * per_token, 0.0), "rows": rows}


# ---- the simulated pool -------------------------------------------------------------------------

class Request:
  def __init__(self, lengths, prompt_len):
    self.lengths = list(lengths)
    self.done = [0] * len(lengths)
    self.versions = [[] for _ in lengths]
    self.prompt_len = prompt_len

  def finished(self):
    return all(d >= n for d, n in zip(self.done, self.lengths))


def simulate(mode: str, cost_model: str, lengths: np.ndarray, costs: dict, *, workers: int,
             rows: int, group: int, batch: int, train_s: float, steps: int, chunk: int,
             queue: int, prompt_len: int = 14, seed: int = 0) -> dict:
  """One simulated run (module docstring) until the trainer has taken `steps` updates."""
  rng = np.random.default_rng(seed)
  draw = lambda: rng.choice(lengths, group)
  step_cost = costs["decode_step_s"]
  poll = step_cost  # an idle trainer or worker looks again after one decode step
  per_row = step_cost / rows  # continuous batching: a step costs in proportion to its rows

  def call_seconds(contexts, active_per_step):
    prefill = costs["call_overhead_s"] + costs["prefill_token_s"] * sum(contexts)
    if cost_model == "padded":
      return prefill + step_cost * len(active_per_step)
    return prefill + sum(per_row * a for a in active_per_step)

  version, clock = 0, 0.0
  queue_held: list = []    # delivered rollouts: (versions list)
  in_flight_rows = 0
  trainer_busy_until, trainer_idle, trained, staleness, spans = 0.0, 0.0, 0, [], []
  gen_tokens, gen_busy = 0, 0.0
  state = [dict(held=[], version=0) for _ in range(workers)]
  events = [(0.0, "worker", i) for i in range(workers)] + [(0.0, "trainer", -1)]
  heapq.heapify(events)
  idle_since = 0.0
  while trained < steps:
    clock, kind, i = heapq.heappop(events)
    if kind == "trainer":
      if len(queue_held) >= batch:
        taken, queue_held[:] = queue_held[-batch:], queue_held[:-batch]  # LIFO: the newest B
        for v in taken:
          staleness.extend(version - np.asarray(v))
          spans.append(len(set(v)) > 1)
        trainer_idle += clock - idle_since
        trained += 1
        heapq.heappush(events, (clock + train_s, "publish", -1))
      else:
        heapq.heappush(events, (clock + poll, "trainer", -1))
      continue
    if kind == "publish":
      version += 1
      idle_since = clock
      heapq.heappush(events, (clock, "trainer", -1))
      continue
    # a worker is free: refresh to the newest, refill, run one call (whole requests or a chunk)
    w = state[i]
    w["version"] = version
    held = w["held"]
    for r in [r for r in held if r.finished()]:
      for k in range(len(r.lengths)):
        queue_held.append(r.versions[k])
      in_flight_rows -= len(r.lengths)
      held.remove(r)
    # Refill up to R rows (off: every call ends with all its requests, so it starts empty),
    # as long as the queue has room for what is held and in flight (the intake's rule).
    active = sum(len(r.lengths) for r in held)
    while active + group <= rows and len(queue_held) + in_flight_rows + group <= queue:
      held.append(Request(draw(), prompt_len))
      active += group
      in_flight_rows += group
    if not held:
      heapq.heappush(events, (clock + poll, "worker", i))
      continue
    seqs = [(r, k) for r in held for k in range(len(r.lengths)) if r.done[k] < r.lengths[k]]
    left = [r.lengths[k] - r.done[k] for r, k in seqs]
    span = max(left) if mode == "off" else min(chunk, max(left))
    contexts = [r.prompt_len + r.done[k] for r, k in seqs]
    per_step = [sum(1 for x in left if x > s) for s in range(span)]
    seconds = call_seconds(contexts, per_step)
    for (r, k), x in zip(seqs, left):
      n = min(x, span)
      r.done[k] += n
      r.versions[k].extend([w["version"]] * n)
      gen_tokens += n
    gen_busy += seconds
    heapq.heappush(events, (clock + seconds, "worker", i))
  st = np.asarray(staleness, np.float64)
  return {"mode": mode, "cost_model": cost_model, "trainer_idle_fraction": trainer_idle / clock,
          "wall_s": clock, "tokens_per_busy_s": gen_tokens / gen_busy,
          "tokens_per_wall_s": gen_tokens / clock,
          "token_staleness_mean": float(st.mean()), "token_staleness_p95": float(np.quantile(st, 0.95)),
          "spanning_fraction": float(np.mean(spans))}


def run_sim(args) -> dict:
  lengths = task_lengths(20000)
  rows = args.rows
  costs = calibrate(rows)
  print(f"completion lengths: mean {lengths.mean():.1f}, p50 {np.median(lengths):.0f}, "
        f"p95 {np.quantile(lengths, 0.95):.0f}, max {lengths.max()} tokens")
  print(f"calibrated JAX sampler costs (rows={rows}): decode step {costs['decode_step_s'] * 1e3:.2f} ms, "
        f"prefill {costs['prefill_token_s'] * 1e6:.2f} us/token, call {costs['call_overhead_s'] * 1e3:.1f} ms")
  # The trainer's step time: one update of B rollouts ~ generation of B mean-length rollouts / mu
  # with the paper's mu = 6.84 on W = 2 workers (so generation, not training, is the bottleneck).
  train_s = costs["decode_step_s"] * lengths.mean() * args.batch / rows / 6.84
  out = []
  for cost_model in ("padded", "continuous"):
    for mode in ("off", "continue"):
      r = simulate(mode, cost_model, lengths, costs, workers=args.workers, rows=rows,
                   group=args.group, batch=args.batch, train_s=train_s, steps=args.sim_steps,
                   chunk=args.chunk, queue=2 * args.batch)
      out.append(r)
  print(f"\nsimulated costs: W={args.workers} workers of {rows} rows, requests of {args.group}, "
        f"B={args.batch} consumed per update ({train_s * 1e3:.1f} ms), C={args.chunk}, "
        f"{args.sim_steps} updates")
  print(f"{'cost model':>11} {'partial':>9} {'trainer idle':>13} {'tok/busy s':>11} "
        f"{'tok/wall s':>11} {'token stale':>12} {'p95':>5} {'spanning':>9}")
  for r in out:
    print(f"{r['cost_model']:>11} {r['mode']:>9} {r['trainer_idle_fraction']:>13.3f} "
          f"{r['tokens_per_busy_s']:>11.0f} {r['tokens_per_wall_s']:>11.0f} "
          f"{r['token_staleness_mean']:>12.2f} {r['token_staleness_p95']:>5.0f} "
          f"{r['spanning_fraction']:>9.2f}")
  return {"lengths": {"mean": float(lengths.mean()), "p50": float(np.median(lengths)),
                      "p95": float(np.quantile(lengths, 0.95)), "max": int(lengths.max())},
          "costs": costs, "train_s": train_s,
          "settings": {"workers": args.workers, "rows": rows, "group": args.group,
                       "batch": args.batch, "chunk": args.chunk, "updates": args.sim_steps},
          "arms": out}


# ---- real async runs ----------------------------------------------------------------------------

def launch(workdir: str, backend: str, mode: str, seed: int, steps: int, extra) -> None:
  cmd = [sys.executable, "-m", "jaxreplay.launch", f"--config={CONFIG}", f"--workdir={workdir}",
         f"--config.rollout.backend={backend}", f"--config.rollout.partial={mode}",
         f"--config.seed={seed}", f"--config.total_steps={steps}", "--config.buffer.on_policy=True",
         "--config.buffer.size=64", f"--config.eval.every={steps}",
         f"--config.checkpoint.every={steps}", *extra]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxreplay-bench-jax-cache")
  with open(workdir + ".log", "w") as log:
    subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def summarize(workdir: str) -> dict:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  last, first = rows[-1], rows[0]
  train = [r for r in rows if "loss" in r]
  get = lambda key: [r[key] for r in train if key in r]
  wall = last["time/wall_s"]
  return {
      "steps": last["step"], "wall_s": wall,
      "trainer_wait_s": last["time/trainer_wait_s"],
      "trainer_idle_fraction": last["time/trainer_wait_s"] / wall,
      "gen_tokens": last["pool/tokens"], "gen_seconds": last["pool/generate_seconds"],
      "tokens_per_generate_s": last["pool/tokens"] / max(last["pool/generate_seconds"], 1e-9),
      "tokens_per_wall_s": last["pool/tokens"] / wall,
      "token_staleness_mean": float(np.mean(get("buffer/token_staleness_mean") or
                                            get("buffer/staleness_mean"))),
      "rollout_staleness_mean": float(np.mean(get("buffer/staleness_mean"))),
      "versions_per_rollout_mean": float(np.mean(get("buffer/versions_per_rollout_mean") or [1.0])),
      "partial_continued": last.get("rollout/partial_continued", 0.0),
      "compute_seconds": last["compute_seconds"],
      "pass1_start": first.get("eval/pass@1"), "pass1_end": last.get("eval/pass@1"),
  }


def run_real(args) -> dict:
  root = args.workdir
  os.makedirs(root, exist_ok=True)
  runs = {}
  for backend in args.backends.split(","):
    for seed in [int(s) for s in args.seeds.split(",")]:
      order = ("off", "continue") if seed % 2 == 0 else ("continue", "off")  # interleaved
      for mode in order:
        name = f"{backend}_{mode}_seed{seed}"
        workdir = os.path.join(root, name)
        if not os.path.exists(os.path.join(workdir, "metrics.jsonl")) or args.rerun:
          t0 = time.time()
          launch(workdir, backend, mode, seed, args.steps, args.set)
          print(f"{name}: {time.time() - t0:.0f} s")
        runs[name] = dict(summarize(workdir), backend=backend, mode=mode, seed=seed)
  print(f"\nreal async runs ({args.steps} updates of B=32 on-policy rollouts each; "
        f"{platform.node()}, shared CPUs)")
  print(f"{'run':>22} {'idle':>6} {'tok/gen s':>10} {'tok/wall s':>11} {'tok stale':>10} "
        f"{'versions':>9} {'pass@1 0->end':>14} {'compute s':>10} {'wall s':>7}")
  for name, r in runs.items():
    print(f"{name:>22} {r['trainer_idle_fraction']:>6.3f} {r['tokens_per_generate_s']:>10.0f} "
          f"{r['tokens_per_wall_s']:>11.0f} {r['token_staleness_mean']:>10.2f} "
          f"{r['versions_per_rollout_mean']:>9.2f} {r['pass1_start']:>6.3f}->{r['pass1_end']:.3f} "
          f"{r['compute_seconds']:>10.0f} {r['wall_s']:>7.0f}")
  summary = {}
  for backend in args.backends.split(","):
    for mode in ("off", "continue"):
      rs = [r for r in runs.values() if r["backend"] == backend and r["mode"] == mode]
      summary[f"{backend}_{mode}"] = {k: float(np.mean([r[k] for r in rs])) for k in (
          "trainer_idle_fraction", "tokens_per_generate_s", "tokens_per_wall_s",
          "token_staleness_mean", "pass1_end", "compute_seconds", "wall_s")}
  print("\nmeans over seeds:")
  for k, v in summary.items():
    print(f"  {k:>14}: " + ", ".join(f"{kk} {vv:.3f}" for kk, vv in v.items()))
  return {"steps": args.steps, "seeds": args.seeds, "settings": args.set, "runs": runs,
          "means": summary}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sim", action="store_true", help="the simulated-cost model")
  p.add_argument("--real", action="store_true", help="real async runs")
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--rows", type=int, default=32, help="rows a worker holds in flight")
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--chunk", type=int, default=16)
  p.add_argument("--sim_steps", type=int, default=400)
  p.add_argument("--backends", default="jax,vllm")
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--set", action="append", default=[], help="more --config.KEY=VALUE flags")
  p.add_argument("--workdir", default="/tmp/jaxreplay-bench-partial")
  p.add_argument("--rerun", action="store_true")
  p.add_argument("--out", default=RESULTS)
  args = p.parse_args()
  path = args.out if args.out.endswith(".json") else os.path.join(args.out, "partial_rollouts.json")
  data = json.load(open(path)) if os.path.exists(path) else {}
  if args.sim:
    data["simulated"] = run_sim(args)
  if args.real:
    data["real"] = run_real(args)
  data["machine"] = {"node": platform.node(), "cpus": os.cpu_count()}
  print("wrote", write_json(args.out, "partial_rollouts.json", data))


if __name__ == "__main__":
  main()
