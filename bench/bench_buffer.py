"""Host-side cost of one training batch: `ReplayBuffer.sample` + `collate`, against a memcpy floor.

For B in {60, 256, 1024} rollouts and total lengths L in {1024, 4096, 8192} tokens (each rollout
has L/2 < length <= L, so the bucket is L), a buffer of capacity 2B is filled and we time (median
of several repetitions):
  sample   buf.sample(B)
  collate  collate(rollouts, buckets) -> Batch (B x L arrays, 6 x [B, L] 4-byte fields)
  memcpy   np.copyto of the Batch's arrays into preallocated, already-touched arrays: the memory
           bandwidth floor for writing those bytes (collate also allocates its outputs)
and report ratio = (sample + collate) / memcpy and the Batch bytes/s. Where
bench/results/train_step.json exists (bench_train_step.py), its measured step times are copied
into the JSON so the host cost can be set against a train step.

  python bench/bench_buffer.py [--quick] [--reps N] [--out bench/results/buffer.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxreplay.data import buffer  # noqa: E402  pylint: disable=g-import-not-at-top
from jaxreplay.data import collate  # noqa: E402  pylint: disable=g-import-not-at-top

BUCKETS = (1024, 2048, 4096, 8192)


def make_buffer(batch_size: int, length: int, seed: int = 0) -> buffer.ReplayBuffer:
  """A full buffer of capacity 2B whose rollouts are views of two shared random pools."""
  capacity = 2 * batch_size
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 150_000, length, dtype=np.int32)
  logprobs = -rng.random(length, dtype=np.float32)
  buf = buffer.ReplayBuffer(capacity=capacity, seed=seed)
  totals = rng.integers(length // 2 + 1, length + 1, capacity)
  prompts = rng.integers(16, length // 4, capacity)
  buf.add([buffer.Rollout(tokens[:p], tokens[p:t], logprobs[p:t], reward=1.0, advantage=0.1,
                          policy_version=0, group_id=i // 16)
           for i, (p, t) in enumerate(zip(prompts.tolist(), totals.tolist()))])
  return buf


def timed(fn, reps: int) -> tuple[float, object]:
  times, out = [], None
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def bench_one(batch_size: int, length: int, reps: int) -> dict:
  buf = make_buffer(batch_size, length)
  t_sample, rollouts = timed(lambda: buf.sample(batch_size), reps)
  t_collate, b = timed(lambda: collate.collate(rollouts, BUCKETS), reps)
  assert b.shape == (batch_size, length), b.shape
  arrays = [x for x in b if x is not None]  # optional fields (per-token versions) are None here
  nbytes = int(sum(x.nbytes for x in arrays))
  src = [np.asarray(x) for x in arrays]
  dst = [np.empty_like(x) for x in src]
  for d, x in zip(dst, src):  # touch the pages once, so the floor is the copy alone
    np.copyto(d, x)
  t_memcpy, _ = timed(lambda: [np.copyto(d, x) for d, x in zip(dst, src)], reps)
  del src, dst, b
  both = t_sample + t_collate
  return {
      "B": batch_size, "length": length, "capacity": 2 * batch_size, "bytes": nbytes,
      "tokens": int(sum(r.length for r in rollouts)),
      "sample_s": t_sample, "collate_s": t_collate, "sample_collate_s": both,
      "memcpy_s": t_memcpy, "ratio_to_memcpy": both / t_memcpy,
      "collate_over_memcpy": t_collate / t_memcpy,
      "bytes_per_s": nbytes / both, "memcpy_bytes_per_s": nbytes / t_memcpy,
  }


def train_step_times() -> dict | None:
  """{name: step_s} from bench/results/train_step.json, or None if it was not run."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "train_step.json")
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return {r["name"]: r["step_s"] for r in json.load(f).get("results", [])}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="B in {60, 256}, L in {1024, 4096}, 3 reps")
  parser.add_argument("--reps", type=int, default=None, help="repetitions per cell (median)")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                    "buffer.json"))
  args = parser.parse_args(argv)
  sizes = (60, 256) if args.quick else (60, 256, 1024)
  lengths = (1024, 4096) if args.quick else (1024, 4096, 8192)
  reps = args.reps or (3 if args.quick else 5)
  t0 = time.perf_counter()
  rows = []
  header = (f"{'B':>5} {'L':>5} {'MB':>7} {'sample ms':>10} {'collate ms':>11} {'memcpy ms':>10} "
            f"{'ratio':>6} {'GB/s':>6} {'memcpy GB/s':>12}")
  print(header)
  print("-" * len(header))
  for batch_size in sizes:
    for length in lengths:
      r = bench_one(batch_size, length, reps)
      rows.append(r)
      print(f"{batch_size:5d} {length:5d} {r['bytes'] / 1e6:7.1f} {r['sample_s'] * 1e3:10.3f} "
            f"{r['collate_s'] * 1e3:11.2f} {r['memcpy_s'] * 1e3:10.2f} "
            f"{r['ratio_to_memcpy']:6.1f} {r['bytes_per_s'] / 1e9:6.2f} "
            f"{r['memcpy_bytes_per_s'] / 1e9:12.2f}", flush=True)
  step = train_step_times()
  if step:
    print("measured train steps (bench_train_step.py), s:", step)
  result = {
      "benchmark": "buffer.sample + collate vs memcpy of the Batch bytes",
      "reps": reps, "quick": args.quick, "buckets": BUCKETS,
      "machine": {"platform": platform.platform(), "python": platform.python_version(),
                  "numpy": np.__version__, "cpu_count": os.cpu_count()},
      "total_s": time.perf_counter() - t0,
      "results": rows,
      "train_step_s": step,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out} ({result['total_s']:.1f} s)")


if __name__ == "__main__":
  main()
