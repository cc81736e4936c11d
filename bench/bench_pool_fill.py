"""Delivery throughput of one vLLM worker vs the requests it generates per call (engine fill).

One `VllmWorkerProcess` (the async pipeline's worker) behind a `WorkerPool` whose source has a
fixed number of requests of `prompts_per_request` prompts x `group_size` samples; per setting of
`requests_per_call` (1 = the old behaviour: one blocking call per request) it times the delivery
of them all: rollouts (completions) delivered per second. Random weights, so completions run to
`max_tokens` unless an eos token is sampled.

  python bench/bench_pool_fill.py [--quick]

Prints a table and writes bench/results/pool_fill.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.models import hf_io  # noqa: E402
from jaxreplay.models import presets  # noqa: E402
from jaxreplay.models import transformer  # noqa: E402
from jaxreplay.rollout.base import SamplingParams  # noqa: E402
from jaxreplay.rollout.pool import PromptBatch, WorkerPool  # noqa: E402
from jaxreplay.rollout.vllm.engine import VllmWorkerProcess  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pool_fill.json")


class _Unclosed:
  """The started engine, lent to one pool: the pool's close at stop leaves it running."""

  def __init__(self, worker):
    self.worker = worker
    self.policy_version = worker.policy_version

  def generate(self, *args):
    return self.worker.generate(*args)

  def load_weights(self, weights):
    raise AssertionError("no refresh in this benchmark")

  def close(self):
    pass


def measure(worker, requests_per_call: int, num_requests: int, prompts_per_request: int,
            group_size: int, max_tokens: int) -> dict:
  """Seconds for a one-worker pool to deliver `num_requests` requests (after one warm call)."""
  counter = itertools.count()
  rng = np.random.default_rng(0)
  sampling = SamplingParams(max_tokens=max_tokens)
  delivered = []
  done = threading.Event()

  def make_batch(k):
    prompts = [np.concatenate([[1], rng.integers(3, 60, size=7)]).astype(np.int32)
               for _ in range(prompts_per_request)]
    return PromptBatch(prompts, group_size, sampling, meta=k)

  def source(_):
    k = next(counter)
    return make_batch(k) if k < num_requests else None

  def sink(d):
    delivered.append((sum(len(g.completions) for g in d.groups), d.num_tokens))
    if len(delivered) == num_requests:
      done.set()

  worker.generate(make_batch(-1).prompts, group_size, sampling)  # warm-up (first-call compilation)
  pool = WorkerPool(lambda i: _Unclosed(worker), 1, source, sink,
                    requests_per_call=requests_per_call)
  start = time.perf_counter()
  pool.start()
  if not done.wait(1800):
    raise TimeoutError(f"{num_requests} requests not delivered in 30 minutes")
  seconds = time.perf_counter() - start
  pool.stop(60)
  rollouts = sum(r for r, _ in delivered)
  tokens = sum(t for _, t in delivered)
  return {"requests_per_call": requests_per_call,
          "sequences_per_call": requests_per_call * prompts_per_request * group_size,
          "requests": len(delivered), "calls": pool.metrics()["calls"], "rollouts": rollouts,
          "tokens": tokens, "seconds": seconds, "rollouts_per_s": rollouts / seconds,
          "tokens_per_s": tokens / seconds}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="8 requests per setting instead of 32")
  p.add_argument("--requests_per_call", default="1,2,4")
  p.add_argument("--out", default=RESULTS)
  args = p.parse_args(argv)
  num_requests = 8 if args.quick else 32
  ppr, g, max_tokens, max_num_seqs = 4, 16, 64, 256
  cfg = presets.tiny()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    hf_io.save_hf(cfg, transformer.init_params(cfg, jax.random.key(0)), tmp)
    worker = VllmWorkerProcess(tmp, max_model_len=128, max_num_seqs=max_num_seqs, seed=0,
                               eos_token_ids=())
    try:
      for k in (int(x) for x in args.requests_per_call.split(",")):
        rows.append(measure(worker, k, num_requests, ppr, g, max_tokens))
        r = rows[-1]
        print(f"requests/call {k:2d} ({r['sequences_per_call']:4d} seqs): "
              f"{r['rollouts_per_s']:8.1f} rollouts/s {r['tokens_per_s']:9.0f} tokens/s "
              f"({r['requests']} requests in {r['seconds']:.1f} s)", flush=True)
    finally:
      worker.close()
  out = {"model": "tiny (2 layers, hidden 128, vocab 64)", "prompts_per_request": ppr,
         "group_size": g, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs,
         "requests_per_setting": num_requests, "machine": platform.processor() or platform.machine(),
         "cpus": os.cpu_count(), "rows": rows}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
