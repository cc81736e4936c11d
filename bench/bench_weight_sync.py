"""Weight-refresh cost: publish (device -> host + safetensors write) + vLLM reload, vs a memcpy floor.

For each model config: start an in-process `VllmEngine`, then repeatedly publish new parameters with
`WeightPublisher` (to /dev/shm when present) and load them with `VllmEngine.load_weights`. The
floor is `np.copyto` of the same bytes (host memory bandwidth: what a refresh costs at best without
a faster interconnect). Also checks that after the refresh vLLM's log-probs are the new params'.

  python bench/bench_weight_sync.py [--quick]

Prints a table and writes bench/results/weight_sync.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay import models  # noqa: E402
from jaxreplay.rollout.base import SamplingParams, Weights  # noqa: E402
from jaxreplay.rollout.vllm_worker import VllmEngine  # noqa: E402
from jaxreplay.rollout.weight_sync import WeightPublisher  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "weight_sync.json")


def configs():
  """The tiny test model and a ~64M-parameter Qwen3 (vLLM's CPU attention needs head_dim >= 32)."""
  return {
      "tiny": models.presets.tiny(),
      "qwen3_64m": models.ModelConfig(
          model_type="qwen3", vocab_size=32768, hidden_size=512, intermediate_size=2048,
          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
          rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
          max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
  }


def memcpy_floor(params, repeats: int) -> float:
  """Best-of-`repeats` seconds of np.copyto over host copies of every leaf (same bytes)."""
  src = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(params))]
  dst = [np.empty_like(x) for x in src]
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for d, s in zip(dst, src):
      np.copyto(d, s)
    best = min(best, time.perf_counter() - start)
  return best


def logprob_gap(cfg, params, engine) -> float:
  """Max |vLLM - JAX| log-prob over a few sampled tokens (a refresh that did not land is ~0.1-1)."""
  prompts = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10], np.int32)]
  groups = engine.generate(prompts, 2, SamplingParams(max_tokens=8))
  gap = 0.0
  for g in groups:
    for c in g.completions:
      toks = np.concatenate([g.prompt_tokens, c.tokens])
      ref = np.asarray(models.token_logprobs(cfg, params, toks[None, :-1], toks[None, 1:]))[0]
      gap = max(gap, float(np.abs(ref[len(g.prompt_tokens) - 1:] - c.logprobs).max()))
  return gap


def throughput(engine, num_prompts: int, n: int, max_tokens: int) -> float:
  prompts = [np.array([1, 3 + i % 50, 7], np.int32) for i in range(num_prompts)]
  start = time.perf_counter()
  groups = engine.generate(prompts, n, SamplingParams(max_tokens=max_tokens))
  seconds = time.perf_counter() - start
  return sum(len(c.tokens) for g in groups for c in g.completions) / seconds


def bench_config(name, cfg, repeats: int, publisher: WeightPublisher) -> dict:
  params = [models.init_params(cfg, jax.random.key(s)) for s in (0, 1)]
  jax.block_until_ready(params)
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params[0]))
  version = (publisher.latest.version + 1) if publisher.latest else 0
  hf_dir = publisher.publish(cfg, params[0], version)
  start = time.perf_counter()
  engine = VllmEngine(hf_dir, max_model_len=256, max_num_seqs=64, seed=0)
  startup = time.perf_counter() - start
  try:
    tokens_per_s = throughput(engine, 16, 4, 32)
    rows = []
    for k in range(repeats):
      version += 1
      p = params[(k + 1) % 2]
      hf_dir = publisher.publish(cfg, p, version)
      rec = publisher.latest
      engine.load_weights(Weights(version, hf_dir=hf_dir))
      rows.append({"transfer_s": rec.transfer_seconds, "write_s": rec.write_seconds,
                   "reload_s": engine.last_update_seconds,
                   "total_s": rec.seconds + engine.last_update_seconds})
    gap = logprob_gap(cfg, params[repeats % 2], engine)
  finally:
    engine.close()
  best = {k: min(r[k] for r in rows) for k in rows[0]}
  floor = memcpy_floor(params[0], max(3, repeats))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params[0]))
  return {"config": name, "params": int(n_params), "bytes": int(nbytes), "dtype": "float32",
          "engine_startup_s": startup, "tokens_per_s": tokens_per_s, "repeats": repeats,
          "best": best, "median_total_s": float(np.median([r["total_s"] for r in rows])),
          "memcpy_floor_s": floor, "total_over_floor": best["total_s"] / floor,
          "logprob_max_abs_diff_after_refresh": gap, "runs": rows}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 refreshes per config instead of 5")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()
  repeats = 2 if args.quick else 5
  results = []
  with WeightPublisher(keep=2) as publisher:
    for name, cfg in configs().items():
      results.append(bench_config(name, cfg, repeats, publisher))
    root = publisher.root
  header = (f"{'config':>10} {'params':>8} {'MB':>7} {'start s':>8} {'tok/s':>7} {'d2h ms':>8} "
            f"{'write ms':>9} {'reload ms':>10} {'total ms':>9} {'memcpy ms':>10} {'x floor':>8} "
            f"{'lp diff':>8}")
  print(f"weight sync, publish root {root}, best of {repeats} refreshes")
  print(header)
  for r in results:
    b = r["best"]
    print(f"{r['config']:>10} {r['params'] / 1e6:7.1f}M {r['bytes'] / 2**20:7.1f} "
          f"{r['engine_startup_s']:8.1f} {r['tokens_per_s']:7.0f} {b['transfer_s'] * 1e3:8.1f} "
          f"{b['write_s'] * 1e3:9.1f} {b['reload_s'] * 1e3:10.1f} {b['total_s'] * 1e3:9.1f} "
          f"{r['memcpy_floor_s'] * 1e3:10.2f} {r['total_over_floor']:8.1f} "
          f"{r['logprob_max_abs_diff_after_refresh']:8.1e}")
  out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "jax_backend": jax.default_backend()},
         "publish_root": root, "quick": args.quick, "results": results}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
