"""Replay-buffer sample + collate time vs the memcpy floor of the same batch bytes.

  python bench/bench_buffer.py [--quick]

For B rollouts of L total tokens (prompt L/4, completion 3L/4) in a buffer of capacity 2B: median of
several `buf.sample(B)` + `collate(...)`, the time to np.copyto the batch's bytes (the memory floor),
and the ratio; and, where bench/results/train_step.json exists, the fraction of a measured train step.
Prints a table and writes bench/results/buffer.json.
"""
import argparse
import json
import os
import time

import numpy as np

from jaxreplay import buffer as buffer_lib
from jaxreplay import collate as collate_lib

HERE = os.path.dirname(os.path.abspath(__file__))


def make(rng, length, version):
  lp = length // 4
  lc = length - lp
  return buffer_lib.Rollout(prompt_tokens=rng.integers(1, 1000, lp, dtype=np.int32),
                            completion_tokens=rng.integers(1, 1000, lc, dtype=np.int32),
                            logprobs=-rng.random(lc, dtype=np.float32), reward=1.0, advantage=0.5,
                            policy_version=version, group_id=0)


def bench(b, length, reps):
  rng = np.random.default_rng(0)
  buf = buffer_lib.ReplayBuffer(capacity=2 * b, seed=0)
  buf.add([make(rng, length, 0) for _ in range(2 * b)])
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    batch = collate_lib.collate(buf.sample(b, current_version=1), buckets=(length,), batch_size=b)
    times.append(time.perf_counter() - t0)
  nbytes = sum(x.nbytes for x in batch)
  src = [np.asarray(x) for x in batch]
  dst = [np.empty_like(x) for x in src]
  copies = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
      np.copyto(d, s)
    copies.append(time.perf_counter() - t0)
  return {"B": b, "length": length, "bytes": nbytes, "sample_collate_s": float(np.median(times)),
          "memcpy_s": float(np.median(copies)),
          "ratio_to_memcpy": float(np.median(times) / max(np.median(copies), 1e-9)),
          "bytes_per_s": nbytes / float(np.median(times))}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  sizes = [(60, 1024), (256, 4096)] if args.quick else [
      (b, n) for b in (60, 256, 1024) for n in (1024, 4096, 8192)]
  reps = 3 if args.quick else 5
  step = None
  path = os.path.join(HERE, "results", "train_step.json")
  if os.path.isfile(path):
    with open(path) as f:
      r = json.load(f)["results"]
    step = {x["name"]: x["step_s"] for x in r}
  rows = [bench(b, n, reps) for b, n in sizes]
  print(f"{'B':>5} {'len':>5} {'MB':>8} {'sample+collate s':>17} {'memcpy s':>9} {'ratio':>7} {'GB/s':>6}")
  for r in rows:
    print(f"{r['B']:>5} {r['length']:>5} {r['bytes'] / 1e6:>8.1f} {r['sample_collate_s']:>17.4f} "
          f"{r['memcpy_s']:>9.4f} {r['ratio_to_memcpy']:>7.1f} {r['bytes_per_s'] / 1e9:>6.2f}")
  if step:
    print("measured train steps (bench_train_step.py):", step)
  os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
  with open(os.path.join(HERE, "results", "buffer.json"), "w") as f:
    json.dump({"quick": args.quick, "results": rows, "train_step_s": step}, f, indent=1)


if __name__ == "__main__":
  main()
