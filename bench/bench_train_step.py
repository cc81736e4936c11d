"""Train-step time, tokens/s, model FLOPs and the fraction of this machine's measured matmul peak.

Configs: the `tiny` preset, and Qwen3-0.6B shapes with random weights and a reduced layer count
(`--mid_layers`, default 2 on CPU) at a modest sequence length. On GPU the mid config keeps all 28
layers and a longer sequence, and a bf16-compute variant runs too. The peak is measured in the same
run with a large jitted matmul (f32, and bf16 on GPU), so "MFU" here = achieved model FLOP/s divided
by that measured peak (not a datasheet number).

Model FLOPs per step = 3 * ModelConfig.flops_per_token(T) * B * T (forward + backward = 3x forward;
every position counted, the batch has no padding). Time per step is the median over `--steps`
timed steps after one warm-up step (compilation excluded and reported separately).

  python bench/bench_train_step.py [--quick] [--out bench/results/train_step.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxreplay import batch as batch_lib  # noqa: E402
from jaxreplay import optim  # noqa: E402
from jaxreplay import sharding  # noqa: E402
from jaxreplay import trainer  # noqa: E402
from jaxreplay.models import presets  # noqa: E402


def measure_matmul_peak(dtype, n: int, iters: int) -> float:
  """FLOP/s of a jitted [n, n] @ [n, n] matmul (best of `iters`, after a warm-up)."""
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(iters):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


def synthetic_batch(cfg, batch_size: int, seq_len: int, seed: int = 0) -> batch_lib.Batch:
  """Full-length rows: a 16-token prompt, the rest completion (all positions valid)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, cfg.vocab_size, (batch_size, seq_len)).astype(np.int32)
  mask = np.zeros((batch_size, seq_len), np.float32)
  mask[:, min(15, seq_len - 2):seq_len - 1] = 1.0
  return batch_lib.Batch(
      tokens=tokens, positions=np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1)),
      segment_ids=np.ones((batch_size, seq_len), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((batch_size, 1), np.int32)], axis=1),
      completion_mask=mask,
      behaviour_logprobs=np.where(mask > 0, -np.log(cfg.vocab_size), 0.0).astype(np.float32),
      advantages=rng.normal(size=batch_size).astype(np.float32),
      rewards=np.zeros(batch_size, np.float32), policy_version=np.zeros(batch_size, np.int32))


def bench_one(name, cfg, batch_size, seq_len, steps, chunk_size, peaks, num_microbatches=1):
  mesh = sharding.make_mesh((1, -1, 1))
  opt = optim.make_optimizer(1e-5)
  state = trainer.init_train_state(cfg, opt, jax.random.PRNGKey(0), mesh=mesh)
  step = trainer.make_train_step(cfg, opt, trainer.make_loss_fn("grpo"), mesh,
                                 trainer.state_shardings(state, mesh), chunk_size=chunk_size,
                                 num_microbatches=num_microbatches, compute_entropy=True)
  batch = synthetic_batch(cfg, batch_size, seq_len)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  state, metrics = compiled(state, batch)  # warm-up
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state.params, metrics))
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = batch_size * seq_len
  flops = 3.0 * cfg.flops_per_token(seq_len) * tokens
  achieved = flops / step_s
  peak_key = "bf16" if cfg.dtype == "bfloat16" and "bf16" in peaks else "f32"
  row = {
      "name": name, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
      "vocab": cfg.vocab_size, "dtype": cfg.dtype, "params": cfg.num_params(),
      "batch": batch_size, "seq_len": seq_len, "microbatches": num_microbatches,
      "devices": jax.device_count(), "compile_s": compile_s, "step_s": step_s,
      "step_s_all": times, "tokens_per_s": tokens / step_s, "model_flops_per_step": flops,
      "achieved_tflops": achieved / 1e12, "peak_used": peak_key,
      "frac_of_measured_peak": achieved / (peaks[peak_key] * jax.device_count()),
      "loss": float(metrics["loss"]), "finite": bool(np.isfinite(float(metrics["loss"]))),
  }
  if "bf16" in peaks and peak_key != "bf16":
    row["frac_of_measured_bf16_peak"] = achieved / (peaks["bf16"] * jax.device_count())
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps, smaller mid config")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results", "train_step.json"))
  parser.add_argument("--steps", type=int, default=None, help="timed steps per config")
  parser.add_argument("--mid_layers", type=int, default=None)
  parser.add_argument("--mid_seq_len", type=int, default=None)
  parser.add_argument("--mid_batch", type=int, default=None)
  args = parser.parse_args(argv)

  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  steps = args.steps or ((3 if args.quick else 10) if on_gpu else (2 if args.quick else 3))
  peaks = {"f32": measure_matmul_peak(jnp.float32, 8192 if on_gpu else 2048, 5 if on_gpu else 3)}
  if on_gpu:
    peaks["bf16"] = measure_matmul_peak(jnp.bfloat16, 8192, 5)

  configs = []
  tiny = presets.tiny()
  configs.append(("tiny", tiny, 16, 128, 128))
  if on_gpu:
    layers = args.mid_layers or (4 if args.quick else 28)
    seq = args.mid_seq_len or 1024
    bsz = args.mid_batch or 8
    mid = presets.qwen3_0_6b(num_hidden_layers=layers)
    configs.append((f"qwen3-0.6b-shapes L{layers} f32", mid, bsz, seq, 512))
    configs.append((f"qwen3-0.6b-shapes L{layers} bf16", mid.replace(dtype="bfloat16"), bsz, seq,
                    512))
  else:
    layers = args.mid_layers or 2
    seq = args.mid_seq_len or (64 if args.quick else 128)
    bsz = args.mid_batch or 2
    mid = presets.qwen3_0_6b(num_hidden_layers=layers)
    configs.append((f"qwen3-0.6b-shapes L{layers} f32", mid, bsz, seq, 64))

  rows = [bench_one(name, cfg, b, t, steps, chunk, peaks) for name, cfg, b, t, chunk in configs]

  dev = jax.devices()[0]
  result = {
      "backend": backend, "device_kind": dev.device_kind, "device_count": jax.device_count(),
      "host": platform.node(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
      "quick": args.quick, "steps": steps,
      "measured_peak_tflops": {k: v / 1e12 for k, v in peaks.items()}, "results": rows,
  }
  print(f"backend={backend} device={dev.device_kind} x{jax.device_count()}  measured matmul peak: "
        + ", ".join(f"{k} {v / 1e12:.3f} TFLOP/s" for k, v in peaks.items()))
  header = (f"{'config':34s} {'params':>9s} {'B x T':>9s} {'compile s':>9s} {'step s':>8s} "
            f"{'tokens/s':>10s} {'TFLOP/step':>10s} {'TFLOP/s':>8s} {'of peak':>8s}")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['name']:34s} {r['params'] / 1e6:8.1f}M {r['batch']:>4d}x{r['seq_len']:<4d} "
          f"{r['compile_s']:9.1f} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} "
          f"{r['model_flops_per_step'] / 1e12:10.4f} {r['achieved_tflops']:8.4f} "
          f"{100 * r['frac_of_measured_peak']:7.1f}%")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
