"""Weight-refresh cost vs the memcpy floor: trainer params -> a vLLM engine, per phase.

For each model size (tiny, a ~64M Qwen3, a Qwen3-0.6B-sized one) one in-process `VllmEngine` starts
from a config-only directory (placeholder weights) and takes `--repeats` refreshes per transport:

  shm    (rollout.weight_transport="shm", what a CPU run does): `ShmPublisher(kernel_layout="jax")`
         copies the params straight into a /dev/shm segment on the trainer's thread (`stall_s`, of
         which `write_s` is the segment copy), then the engine re-packs each linear layer straight
         from the segment (`rollout.vllm.direct_load`; `engine_s`, of which `load_s` is the load,
         `repack_s` vLLM's CPU re-packing of the linear layers and LM head);
  shm-hf (the path GPU engines take, and CPU runs before `rollout.vllm.direct_load`): the host copy
         (`stall_s`), the HF-layout segment written on a background thread (`write_s`), the
         engine's load through vLLM's weight-transfer API with its generic layerwise reload
         (`load_s` = model.load_weights with the per-layer processing, `repack_s` inside it,
         `finalize_s`);
  file   (the fallback): `FilePublisher.publish` (safetensors dir) + vLLM `reload_weights`.

`total_s` = publish + wait until written + engine load (the refresh's latency when nothing
overlaps). The floor is
`np.copyto` of the published bytes into buffers written before (no page faults), best of several,
measured in the same run between the refreshes; `total_over_floor` = total / floor, and, since
vLLM's own re-packing on CPU is a cost of any transport, `total_over_floor_plus_repack` = total /
(floor + repack). After the refreshes the engine's log-probs are checked against the JAX forward.
`--tiny_default_steps N` also runs the tiny default (`configs/tiny.py`, vLLM, shm) for N steps and
reports its trainer stall per refresh against its train step (time/publish_s vs time/step_s).

  python bench/bench_weight_sync.py --out bench/results [--quick]

Each transport first takes a few unmeasured refreshes (every slot written once: a run's steady
state), then `--repeats` measured ones; the table shows the best of those.

Prints a table and writes OUT/weight_sync.json (OUT may also name the .json file).

`--lora_rank R` (> 0) measures LoRA's adapter-only refresh instead (writes weight_sync_lora.json):
per model, the full-weight "shm" refresh above against `AdapterDirPublisher` (the adapters of rank
R on all seven kernels, alpha 2R, as a PEFT directory in /dev/shm, on the trainer's thread:
`stall_s`, of which `write_s` the files) + `VllmEngine.load_weights` of a LoRA engine (vLLM's
`add_lora` of a new adapter id, `remove_lora` of the previous one, prefix-cache reset: `engine_s`),
the log-probs checked against the JAX forward with the adapters attached; and the tiny default's
trainer stall per refresh (vLLM) with and without `--config.model.lora_rank=8`.

  python bench/bench_weight_sync.py --lora_rank 16 --transports shm --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_io  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay.models import logprobs as logprobs_lib  # noqa: E402
from jaxreplay.models import presets  # noqa: E402
from jaxreplay.models import transformer  # noqa: E402
from jaxreplay.models.config import ModelConfig  # noqa: E402
from jaxreplay.models import hf_io  # noqa: E402
from jaxreplay.models import lora  # noqa: E402
from jaxreplay.rollout.weights.adapter_publisher import AdapterDirPublisher  # noqa: E402
from jaxreplay.rollout.base import SamplingParams  # noqa: E402
from jaxreplay.rollout.weights.shm_publisher import ShmPublisher  # noqa: E402
from jaxreplay.rollout.vllm.engine import VllmEngine  # noqa: E402
from jaxreplay.rollout.weights.file_publisher import FilePublisher  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")


def configs(quick: bool):
  """tiny, ~64M and Qwen3-0.6B-sized (vLLM's CPU attention needs head_dim >= 32)."""
  out = {
      "tiny": presets.tiny(),
      "qwen3_64m": ModelConfig(
          model_type="qwen3", vocab_size=32768, hidden_size=512, intermediate_size=2048,
          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
          rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
          max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0),
      "qwen3_0.6b": presets.qwen3_0_6b(max_position_embeddings=512),
  }
  if quick:
    out.pop("qwen3_0.6b")
  return out


class Floor:
  """Best seconds of np.copyto of `nbytes` between two pre-touched buffers (host bandwidth)."""

  def __init__(self, nbytes: int):
    self.src = np.ones(nbytes // 4, np.float32)
    self.dst = np.zeros_like(self.src)
    self.best = float("inf")

  def measure(self, repeats: int = 3) -> float:
    for _ in range(repeats):
      start = time.perf_counter()
      np.copyto(self.dst, self.src)
      self.best = min(self.best, time.perf_counter() - start)
    return self.best


def logprob_gap(cfg, params, engine) -> float:
  """Max |vLLM - JAX| log-prob over a few sampled tokens (a refresh that did not land is ~0.1-1)."""
  prompts = [np.array([1, 5, 6, 7], np.int32), np.array([1, 9, 10], np.int32)]
  groups = engine.generate(prompts, 2, SamplingParams(max_tokens=8))
  gap = 0.0
  for g in groups:
    for c in g.completions:
      toks = np.concatenate([g.prompt_tokens, c.tokens])
      ref = np.asarray(logprobs_lib.token_logprobs(cfg, params, toks[None, :-1], toks[None, 1:]))[0]
      gap = max(gap, float(np.abs(ref[len(g.prompt_tokens) - 1:] - c.logprobs).max()))
  return gap


def _publisher(cfg, transport: str):
  """shm: the CPU default (kernels in the trainer's layout, written on the trainer's thread,
  re-packed straight from the segment); shm-hf: HF layout written in the background and vLLM's
  generic layerwise reload (the GPU path's shape, and this bench's before); file: safetensors."""
  if transport == "shm":
    return ShmPublisher(cfg, "float32", keep=2, kernel_layout="jax")
  if transport == "shm-hf":
    return ShmPublisher(cfg, "float32", keep=2, kernel_layout="hf")
  if transport == "file":
    return FilePublisher(cfg, keep=1)
  raise ValueError(f"transport {transport!r}: expected shm, shm-hf or file")


def _best(rows, key):
  return min(r[key] for r in rows)


def bench_config(name, cfg, repeats: int, transports) -> dict:
  # Two versions sharing the big tensors (the second has other norms: other log-probs): every
  # refresh still moves every byte, and host memory holds one model.
  first = transformer.init_params(cfg, jax.random.key(0))
  second = dict(first, norm=first["norm"] * 0.5,
                layers=dict(first["layers"], input_layernorm=first["layers"]["input_layernorm"] * 1.5))
  params = [first, second]
  jax.block_until_ready(params)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params[0]))
  result = {"config": name, "params": int(n_params), "dtype": "float32", "repeats": repeats}
  model_dir = tempfile.mkdtemp(prefix="bench-weight-sync-", dir="/dev/shm")
  hf_io.write_config_files(cfg, model_dir, "float32")
  floor = None
  version = 0
  start = time.perf_counter()
  engine = VllmEngine(model_dir, weights_pending=True, max_model_len=256, max_num_seqs=32, seed=0)
  try:
    for transport in transports:
      # One publisher at a time: a 0.6B model's slots (3 x 2.4 GB per publisher) must fit in RAM.
      with _publisher(cfg, transport) as publisher:
        if floor is None:
          nbytes = publisher._nbytes()  # pylint: disable=protected-access
          floor = Floor(nbytes)
          floor.measure()
          engine.load_weights(publisher.publish(params[0], version))
          result["engine_startup_s"] = time.perf_counter() - start
        rows = []
        # Unmeasured refreshes first: every slot of the ring (and the file path's directories) has
        # been written once, as in a run's steady state (fresh /dev/shm pages cost ~5x a memcpy).
        warmup = publisher.keep + 1 if transport.startswith("shm") else 1
        engine.direct_load = transport == "shm"
        for k in range(warmup + repeats):
          version += 1
          p = params[(version) % 2]
          floor.measure()
          if transport.startswith("shm"):
            t0 = time.perf_counter()
            weights = publisher.publish(p, version)
            weights.wait()
            rec = publisher.latest
            phases = engine.load_weights(weights)
            total = time.perf_counter() - t0
            rows.append({"stall_s": rec.stall_s, "write_s": rec.write_s,
                         "load_s": phases["load_s"], "repack_s": phases["repack_s"],
                         "finalize_s": phases["finalize_s"], "engine_s": phases["total_s"],
                         "direct": phases["direct"], "total_s": total})
          else:
            t0 = time.perf_counter()
            weights = publisher.publish(p, version)
            rec = publisher.latest
            engine.load_weights(weights)
            total = time.perf_counter() - t0
            rows.append({"stall_s": rec.stall_s, "write_s": rec.write_s,
                         "d2h_s": rec.stall_s - rec.write_s, "engine_s": engine.last_update_seconds,
                         "total_s": total})
          floor.measure()
          if k < warmup:
            rows.pop()
        gap = logprob_gap(cfg, params[version % 2], engine)
        best = {k: _best(rows, k) for k in rows[0]}
        entry = {"best": best, "median_total_s": float(np.median([r["total_s"] for r in rows])),
                 "logprob_max_abs_diff_after_refresh": gap, "runs": rows}
        result[transport] = entry
  finally:
    engine.close()
    shutil.rmtree(model_dir, ignore_errors=True)
  result.update(bytes=int(floor.src.nbytes), memcpy_floor_s=floor.best)
  for transport in transports:
    entry, best = result[transport], result[transport]["best"]
    entry["total_over_floor"] = best["total_s"] / floor.best
    if "repack_s" in best:
      entry["total_over_floor_plus_repack"] = best["total_s"] / (floor.best + best["repack_s"])
      entry["stall_over_floor"] = best["stall_s"] / floor.best
  return result


def bench_adapters(name, cfg, rank: int, repeats: int) -> dict:
  """LoRA's adapter-only refresh of a vLLM engine (see the module docstring), best of `repeats`
  after a few unmeasured ones."""
  spec = lora.LoraSpec(rank, 2.0 * rank)
  base = transformer.init_params(cfg, jax.random.key(0))
  versions = []
  for seed in (1, 2):  # two adapter versions with b != 0: other log-probs each
    adapters = lora.init_adapters(cfg, spec, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 10), len(adapters)))
    versions.append({t: {"a": ab["a"], "b": 0.02 * jax.random.normal(next(keys), ab["b"].shape)}
                     for t, ab in adapters.items()})
  jax.block_until_ready(versions)
  base_dir = tempfile.mkdtemp(prefix="bench-lora-base-", dir="/dev/shm")
  result = {"config": name, "params": int(sum(x.size for x in jax.tree_util.tree_leaves(base))),
            "rank": rank, "alpha": spec.alpha, "adapter_params": lora.num_params(cfg, spec),
            "dtype": "float32", "repeats": repeats}
  start = time.perf_counter()
  try:
    hf_io.save_hf(cfg, jax.device_get(base), os.path.join(base_dir, "base"))
    engine = VllmEngine(os.path.join(base_dir, "base"), max_lora_rank=lora.vllm_max_lora_rank(rank),
                        max_model_len=256, max_num_seqs=32, seed=0, policy_version=-1)
    result["engine_startup_s"] = time.perf_counter() - start
    try:
      with AdapterDirPublisher(cfg, spec, "float32", keep=3) as publisher:
        rows, warmup = [], publisher.keep + 1
        for k in range(warmup + repeats):
          t0 = time.perf_counter()
          weights = publisher.publish(versions[k % 2], k + 1)
          rec = publisher.latest
          phases = engine.load_weights(weights)
          total = time.perf_counter() - t0
          if k >= warmup:
            rows.append({"stall_s": rec.stall_s, "write_s": rec.write_s,
                         "engine_s": phases["total_s"], "total_s": total})
        result["bytes"] = int(rec.nbytes)
        current = lora.attach(base, versions[(warmup + repeats - 1) % 2], spec)
        result["lora"] = {"best": {k: _best(rows, k) for k in rows[0]},
                          "median_total_s": float(np.median([r["total_s"] for r in rows])),
                          "logprob_max_abs_diff_after_refresh": logprob_gap(cfg, current, engine),
                          "runs": rows}
    finally:
      engine.close()
  finally:
    shutil.rmtree(base_dir, ignore_errors=True)
  return result


def tiny_default_stall(steps: int, extra: tuple = ()) -> dict:
  """`configs/tiny.py` with vLLM (shm) for `steps` steps: the trainer's stall per refresh
  (time/publish_s) against its train step (time/step_s), medians over the steps after the first.
  `extra`: more command-line overrides (e.g. LoRA)."""
  workdir = tempfile.mkdtemp(prefix="bench-tiny-default-")
  cmd = [sys.executable, "-m", "jaxreplay.launch", "--config=configs/tiny.py", f"--workdir={workdir}",
         f"--config.total_steps={steps}", "--config.rollout.backend=vllm",
         "--config.rollout.weight_transport=shm", "--config.eval.every=0",
         "--config.eval.num_problems=8", "--config.eval.n_samples=1", "--config.eval.ks=(1,)",
         "--config.checkpoint.every=0", *extra]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
  if proc.returncode != 0:
    raise RuntimeError(f"tiny default run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if "time/step_s" in r][1:]  # the first step compiles
  publish = np.array([r["time/publish_s"] for r in rows])
  step = np.array([r["time/step_s"] for r in rows])
  return {"steps": len(rows), "publish_s_median": float(np.median(publish)),
          "step_s_median": float(np.median(step)),
          "stall_over_step": float(np.median(publish) / np.median(step)),
          "publish_s": publish.tolist(), "step_s": step.tolist()}


def print_table(results, tiny_default):
  print(f"{'config':>10} {'params':>8} {'MB':>7} {'transport':>9} {'stall ms':>9} {'write ms':>9} "
        f"{'load ms':>8} {'repack ms':>9} {'engine ms':>9} {'total ms':>9} {'floor ms':>9} "
        f"{'x floor':>8} {'x(fl+rp)':>8} {'lp diff':>8}")
  for r in results:
    for transport in ("shm", "shm-hf", "file"):
      if transport not in r:
        continue
      e, b = r[transport], r[transport]["best"]
      ms = lambda k: f"{b[k] * 1e3:.1f}" if k in b else "-"  # noqa: E731
      ratio = f"{e['total_over_floor_plus_repack']:.2f}" if "total_over_floor_plus_repack" in e else "-"
      print(f"{r['config']:>10} {r['params'] / 1e6:7.1f}M {r['bytes'] / 2**20:7.1f} {transport:>9} "
            f"{ms('stall_s'):>9} {ms('write_s'):>9} {ms('load_s'):>8} {ms('repack_s'):>9} "
            f"{ms('engine_s'):>9} {ms('total_s'):>9} {r['memcpy_floor_s'] * 1e3:9.2f} "
            f"{e['total_over_floor']:8.1f} {ratio:>8} "
            f"{e['logprob_max_abs_diff_after_refresh']:8.1e}")
  if tiny_default:
    print(f"tiny default (configs/tiny.py, vllm, shm), {tiny_default['steps']} steps: trainer stall "
          f"{tiny_default['publish_s_median'] * 1e3:.2f} ms per refresh, train step "
          f"{tiny_default['step_s_median'] * 1e3:.1f} ms: {100 * tiny_default['stall_over_step']:.1f}%")


def print_lora_table(results, stalls):
  print(f"{'config':>10} {'params':>8} {'refresh':>8} {'MB':>8} {'stall ms':>9} {'write ms':>9} "
        f"{'engine ms':>9} {'total ms':>9} {'lp diff':>8}")
  for full, adapter in results:
    rows = [("full", full["bytes"], full["shm"]["best"], full["shm"]["logprob_max_abs_diff_after_refresh"]),
            (f"lora r{adapter['rank']}", adapter["bytes"], adapter["lora"]["best"],
             adapter["lora"]["logprob_max_abs_diff_after_refresh"])]
    for label, nbytes, b, gap in rows:
      print(f"{full['config']:>10} {full['params'] / 1e6:7.1f}M {label:>8} {nbytes / 2**20:8.2f} "
            f"{b['stall_s'] * 1e3:9.2f} {b['write_s'] * 1e3:9.2f} {b['engine_s'] * 1e3:9.2f} "
            f"{b['total_s'] * 1e3:9.2f} {gap:8.1e}")
  for label, t in stalls.items():
    print(f"tiny default (vllm) {label}: trainer stall {t['publish_s_median'] * 1e3:.2f} ms per "
          f"refresh, train step {t['step_s_median'] * 1e3:.1f} ms: {100 * t['stall_over_step']:.1f}%")


def main_lora(args, repeats: int) -> None:
  """--lora_rank R: full-weight (shm) vs adapter-only refreshes; weight_sync_lora.json."""
  results = []
  wanted = [n for n in args.configs.split(",") if n]
  for name, cfg in configs(args.quick).items():
    if name == "tiny" or (wanted and name not in wanted):
      continue
    results.append((bench_config(name, cfg, repeats, ["shm"]),
                    bench_adapters(name, cfg, args.lora_rank, repeats)))
  steps = args.tiny_default_steps if args.tiny_default_steps >= 0 else (6 if args.quick else 20)
  stalls = {}
  if steps:
    stalls = {"full": tiny_default_stall(steps),
              "lora r8": tiny_default_stall(steps, ("--config.model.lora_rank=8",))}
  print(f"weight refresh, full (shm) vs LoRA adapters only, best of {repeats}")
  print_lora_table(results, stalls)
  out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "jax_backend": jax.default_backend(), "load_average": os.getloadavg()},
         "quick": args.quick, "lora_rank": args.lora_rank,
         "results": [{"full": f, "lora": a} for f, a in results], "tiny_default": stalls}
  print(f"wrote {bench_io.write_json(args.out, 'weight_sync_lora.json', out)}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny and 64M only, 2 refreshes per transport, 6 tiny-default steps")
  parser.add_argument("--out", default=RESULTS, help="a directory (weight_sync.json in it) or a .json")
  parser.add_argument("--repeats", type=int, default=0, help="refreshes per transport (0: 2 / 5)")
  parser.add_argument("--transports", default="shm,shm-hf,file")
  parser.add_argument("--tiny_default_steps", type=int, default=-1,
                      help="steps of the tiny-default stall run (-1: 6 quick / 20; 0: skip)")
  parser.add_argument("--configs", default="",
                      help="--lora_rank: a comma list of the models to run (default all)")
  parser.add_argument("--lora_rank", type=int, default=0,
                      help="> 0: LoRA adapter-only refreshes of this rank vs full weights "
                      "(weight_sync_lora.json)")
  args = parser.parse_args()
  repeats = args.repeats or (2 if args.quick else 5)
  if args.lora_rank > 0:
    main_lora(args, repeats)
    return
  transports = [t for t in args.transports.split(",") if t]
  # Qwen3-0.6B-sized (2.4 GB f32): shm only (a file copy of it too does not fit 23 GB beside it).
  big = [t for t in transports if t.startswith("shm")]
  results = [bench_config(name, cfg, repeats, transports if "0.6b" not in name else big)
             for name, cfg in configs(args.quick).items()]
  steps = args.tiny_default_steps if args.tiny_default_steps >= 0 else (6 if args.quick else 20)
  tiny_default = tiny_default_stall(steps) if steps else None
  print(f"weight refresh, best of {repeats} per transport (total = stall + write + engine load)")
  print_table(results, tiny_default)
  out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "jax_backend": jax.default_backend(),
                     "load_average": os.getloadavg()},
         "quick": args.quick, "results": results, "tiny_default": tiny_default}
  print(f"wrote {bench_io.write_json(args.out, 'weight_sync.json', out)}")


if __name__ == "__main__":
  main()
