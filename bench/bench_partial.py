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
   metrics rows, over the steady window (from update max(2, steps // 4) to the last: the first
   ones wait for engine start-ups and compiles; the whole run's idle fraction beside it): the
   trainer's wait for rollouts (time/trainer_wait_s) over the wall time and per update, wall
   seconds per update, generation throughput (pool/tokens / pool/generate_seconds, and per wall
   second); token staleness and versions per rollout of the trained batches; held-out pass@1
   after the last update (same updates: equal training steps) with the measured compute_seconds
   beside it. Per backend and arm the per-seed values and their mean; per seed the paired
   difference continue - off, summarized with a 95% t interval over the seeds.

  python bench/bench_partial.py --sim
  python bench/bench_partial.py --real --backends=jax,vllm --steps=48 --seeds=0,1,2,3,4,5 \
      --backend_seeds=vllm=0,1,2,3 --plot

Prints tables and writes bench/results/partial_rollouts.json (the parts run; a later run keeps the
other part's results in the file).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import shutil
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


def _steady_from(steps: int) -> int:
  """The first update of the steady window: the updates before it wait for the workers' start and
  the samplers' first compiles, which a short run would otherwise mostly measure."""
  return max(2, steps // 4)


def _rates(wall_s: float, wait_s: float, tokens: float, gen_s: float) -> dict:
  return {"wall_s": wall_s, "trainer_wait_s": wait_s,
          "trainer_idle_fraction": wait_s / max(wall_s, 1e-9),
          "gen_tokens": tokens, "gen_seconds": gen_s,
          "tokens_per_generate_s": tokens / max(gen_s, 1e-9),
          "tokens_per_wall_s": tokens / max(wall_s, 1e-9)}


def summarize(workdir: str) -> dict:
  """One run's numbers from its metrics rows: over the whole run and over the steady window
  (`_steady_from` to the end; differences of the cumulative counters)."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  first, last = rows[0], rows[-1]
  train = [r for r in rows if "time/wall_s" in r]
  if "eval/pass@1" not in last or "eval/pass@1" not in first:
    raise RuntimeError(f"{workdir}: the first and last metrics rows must carry eval/pass@1 "
                       "(eval at step 0 and at the last step); rerun with --rerun")
  get = lambda key: [r[key] for r in train if key in r]
  counters = lambda r: (r["time/wall_s"], r["time/trainer_wait_s"], r["pool/tokens"],
                        r["pool/generate_seconds"])
  from_step = _steady_from(last["step"])
  start = next(r for r in train if r["step"] >= from_step)
  steady = _rates(*(b - a for a, b in zip(counters(start), counters(last))))
  steady["from_step"] = start["step"]
  updates = max(last["step"] - start["step"], 1)
  steady["wall_per_update_s"] = steady["wall_s"] / updates
  steady["trainer_wait_per_update_s"] = steady["trainer_wait_s"] / updates
  return {
      "steps": last["step"], **_rates(*counters(last)), "steady": steady,
      # Per completion token (with partial=off every token of a rollout has its version).
      "token_staleness_mean": float(np.mean(get("buffer/token_staleness_mean") or
                                            get("buffer/staleness_mean"))),
      "rollout_staleness_mean": float(np.mean(get("buffer/staleness_mean"))),
      # Of the rollouts trained on (batches), and of all the pool delivered.
      "versions_per_rollout_mean": float(np.mean(get("buffer/versions_per_rollout_mean") or [1.0])),
      "pool_versions_per_rollout_mean": last.get("rollout/versions_per_rollout_mean", 1.0),
      "partial_continued": last.get("rollout/partial_continued", 0.0),
      "fresh_rollouts": float(sum(get("fresh_rollouts"))),
      "compute_seconds": last["compute_seconds"],
      "generation_seconds": last["compute/generation_seconds"],
      "training_seconds": last["compute/training_seconds"],
      "pass1_start": first["eval/pass@1"], "pass1_end": last["eval/pass@1"],
  }


# The numbers compared per backend and arm: (key, where in a run's summary, table header, format).
COMPARED = (
    ("trainer_idle_fraction", ("steady", "trainer_idle_fraction"), "idle", "{:.3f}"),
    ("trainer_idle_fraction_whole", ("trainer_idle_fraction",), "idle all", "{:.3f}"),
    ("wall_per_update_s", ("steady", "wall_per_update_s"), "s/update", "{:.2f}"),
    ("trainer_wait_per_update_s", ("steady", "trainer_wait_per_update_s"), "wait/upd s",
     "{:.2f}"),
    ("tokens_per_generate_s", ("steady", "tokens_per_generate_s"), "tok/gen s", "{:.0f}"),
    ("tokens_per_wall_s", ("steady", "tokens_per_wall_s"), "tok/wall s", "{:.0f}"),
    ("token_staleness_mean", ("token_staleness_mean",), "tok stale", "{:.2f}"),
    ("versions_per_rollout_mean", ("versions_per_rollout_mean",), "versions", "{:.2f}"),
    ("pass1_end", ("pass1_end",), "pass@1", "{:.3f}"),
    ("compute_seconds", ("compute_seconds",), "compute s", "{:.0f}"),
    ("wall_s", ("wall_s",), "wall s", "{:.0f}"),
)


def _value(run: dict, where: tuple) -> float:
  for k in where:
    run = run[k]
  return float(run)


def compare(runs: dict, seeds: dict[str, list[int]]) -> tuple[dict, dict]:
  """Per backend and arm: the mean and the per-seed values of every COMPARED number; per backend
  and seed: continue minus off (paired by seed: same problems, same initial weights), and their
  summary (`science.stats.paired`: mean, 95% t interval, ...) with how many seeds fell below 0."""
  from jaxreplay.science import stats  # pylint: disable=g-import-not-at-top
  arms, paired = {}, {}
  for backend, backend_seeds in seeds.items():
    for mode in ("off", "continue"):
      per_seed = {key: [_value(runs[f"{backend}_{mode}_seed{s}"], where) for s in backend_seeds]
                  for key, where, _, _ in COMPARED}
      arms[f"{backend}_{mode}"] = {
          "mean": {k: float(np.mean(v)) for k, v in per_seed.items()},
          "per_seed": {k: dict(zip(map(str, backend_seeds), v)) for k, v in per_seed.items()}}
    paired[backend] = {
        key: {str(s): _value(runs[f"{backend}_continue_seed{s}"], where)
              - _value(runs[f"{backend}_off_seed{s}"], where) for s in backend_seeds}
        for key, where, _, _ in COMPARED}
    paired[backend]["summary"] = {
        key: dict(stats.paired(list(v.values())), below_zero=sum(x < 0 for x in v.values()))
        for key, v in list(paired[backend].items())}
  return arms, paired


def _table(title: str, rows: list[tuple[str, list[float]]]) -> None:
  print(title)
  widths = [max(len(h), 10) for _, _, h, _ in COMPARED]
  print(f"{'':>24} " + " ".join(f"{h:>{w}}" for (_, _, h, _), w in zip(COMPARED, widths)))
  for name, values in rows:
    cells = [fmt.format(v) for v, (_, _, _, fmt) in zip(values, COMPARED)]
    print(f"{name:>24} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


PLOTTED = (("trainer_idle_fraction", "trainer idle fraction", False),
           ("wall_per_update_s", "wall seconds per update", False),
           ("tokens_per_generate_s", "tokens / generate-s", True))


def plot_real(arms: dict, path: str) -> None:
  """Per arm, over the steady window: the trainer's idle fraction, wall seconds per update and
  generation throughput; each seed a dot over the mean's bar."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top  (Agg, no pyplot)
  fig = Figure(figsize=(11, 3.6))
  names = list(arms)
  x = np.arange(len(names))
  for ax, (key, label, log) in zip(fig.subplots(1, len(PLOTTED)), PLOTTED):
    ax.bar(x, [arms[n]["mean"][key] for n in names],
           color=["tab:blue" if n.endswith("_off") else "tab:orange" for n in names])
    for i, n in enumerate(names):
      vals = list(arms[n]["per_seed"][key].values())
      ax.plot([i] * len(vals), vals, "k.", ms=7)
    if log:
      ax.set_yscale("log")
    ax.set_xticks(x, [n.replace("_", "\n") for n in names])
    ax.set_title(label + " (steady window)", fontsize=9)
  fig.suptitle("rollout.partial off / continue, real async CPU runs of "
               "configs/scratchpad_longtail.py (bars: means, dots: seeds)", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)


def finished(workdir: str, steps: int) -> bool:
  """Whether the run in `workdir` reached update `steps` and its last evaluation."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  lines = open(path).read().splitlines()
  last = json.loads(lines[-1]) if lines else {}
  return last.get("step") == steps and "eval/pass@1" in last


def seeds_of(args) -> dict[str, list[int]]:
  """Per backend, its seeds: --seeds, or --backend_seeds BACKEND=S,S for that backend."""
  backends = args.backends.split(",")
  out = {b: [int(s) for s in args.seeds.split(",")] for b in backends}
  for item in args.backend_seeds:
    backend, _, seeds = item.partition("=")
    if backend not in out or not seeds:
      raise SystemExit(f"--backend_seeds={item!r}: expected BACKEND=S,S with BACKEND one of "
                       f"--backends={args.backends}")
    out[backend] = [int(s) for s in seeds.split(",")]
  return out


def run_real(args) -> dict:
  root = args.workdir
  os.makedirs(root, exist_ok=True)
  backends = args.backends.split(",")
  seeds = seeds_of(args)
  runs = {}
  # Seeds outer, backends inner, arms alternating by seed: load drifts on the shared machine hit
  # every arm, and a cut-short bench has whole seeds of every backend.
  for seed in sorted({s for ss in seeds.values() for s in ss}):
    for backend in [b for b in backends if seed in seeds[b]]:
      order = ("off", "continue") if seed % 2 == 0 else ("continue", "off")
      for mode in order:
        name = f"{backend}_{mode}_seed{seed}"
        workdir = os.path.join(root, name)
        if args.rerun or not finished(workdir, args.steps):
          if os.path.exists(workdir):
            shutil.rmtree(workdir)  # afresh (the launcher would resume a cut-short run)
          t0 = time.time()
          launch(workdir, backend, mode, seed, args.steps, args.set)
          print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        runs[name] = dict(summarize(workdir), backend=backend, mode=mode, seed=seed)
  arms, paired = compare(runs, seeds)
  print(f"\nreal async runs: {args.steps} updates of B=32 on-policy rollouts each, "
        f"{platform.node()} ({os.cpu_count()} shared CPUs); idle and tok/* over the steady window "
        f"(updates {_steady_from(args.steps)}-{args.steps}), idle all over the whole run; pass@1 "
        f"held out after the last update (from {runs[next(iter(runs))]['pass1_start']:.3f})")
  _table("per run:", [(n, [_value(r, where) for _, where, _, _ in COMPARED])
                      for n, r in runs.items()])
  _table(f"\nmeans over seeds ({', '.join(f'{b} {s}' for b, s in seeds.items())}):",
         [(n, [a["mean"][k] for k, _, _, _ in COMPARED]) for n, a in arms.items()])
  _table("\ncontinue - off, paired by seed:",
         [(f"{b} seed{s}", [paired[b][k][str(s)] for k, _, _, _ in COMPARED])
          for b in backends for s in seeds[b]])
  print("\ncontinue - off: mean [95% t interval over seeds] (seeds below 0)")
  for b in backends:
    for key, _, header, fmt in COMPARED:
      p = paired[b]["summary"][key]
      lo, hi = p["ci95"]
      ci = (f"[{fmt.format(lo)}, {fmt.format(hi)}]" if lo is not None else "[-]")
      print(f"  {b:>5} {header:>10}: {fmt.format(p['mean']):>8} {ci:>20} "
            f"({p['below_zero']} of {p['n']})")
  if args.plot:
    path = os.path.join(os.path.dirname(args.out) if args.out.endswith(".json") else args.out,
                        "partial_rollouts.png")
    plot_real(arms, path)
    print("wrote", path)
  return {"command": " ".join(["python", "bench/bench_partial.py"] + sys.argv[1:]),
          "steps": args.steps, "seeds": seeds, "settings": args.set,
          "steady_from_step": _steady_from(args.steps), "runs": runs, "arms": arms,
          "paired_continue_minus_off": paired}


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
  p.add_argument("--backend_seeds", action="append", default=[],
                 help="BACKEND=S,S: that backend's seeds instead of --seeds (repeatable)")
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--set", action="append", default=[], help="more --config.KEY=VALUE flags")
  p.add_argument("--workdir", default="/tmp/jaxreplay-bench-partial")
  p.add_argument("--rerun", action="store_true", help="rerun the runs whose metrics exist")
  p.add_argument("--plot", action="store_true", help="--real: partial_rollouts.png beside the JSON")
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
