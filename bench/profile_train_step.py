"""Where jaxreplay's train step spends its time on CPU: XLA ops by kind, and the slowest fusions.

Runs the step of `bench_train_step.py` (same shapes, same weights and batch), traces a few steps with
`jax.profiler.trace` and reads the trace back with `jax.profiler.ProfileData` (part of jaxlib: no
TensorBoard or xprof needed). Prints two tables per shape and writes them to JSON:
  - time per op kind (the fusion name without its number: `ynn_fusion` = dots run by YNNPACK,
    `copy_*` / `transpose_*` = layout copies, ...), summed over XLA's CPU threads [ms per step];
  - the slowest fusions, each with its output shape, the HLO root of its fused computation (the dot
    and its contracting dims), and GFLOP/s for dots.
Caveats: YNNPACK's work on helper threads is not traced as events, so the per-thread sums undercount
dots and cannot measure thread utilisation; the per-fusion rate is the traced event's wall time, which
includes time shared with thunks that run concurrently.

  python bench/profile_train_step.py [--shapes small,wide] [--steps 3] [--top 15]
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

import bench_train_step as bts  # noqa: E402
from jaxreplay.models import hf_io  # noqa: E402
from jaxreplay.models import transformer  # noqa: E402

_SKIP = ("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool")


def _dot_flops(root: str, hlo: str, fusion_num: str) -> float:
  """2 * M * N * K of the fusion's root dot (0 when the root is not a dot)."""
  m = re.search(r"dot\(%(\S+), %(\S+)\), lhs_contracting_dims=\{(\d+)\}", root)
  out = re.search(r"= f32\[([\d,]+)\]", root)
  if not m or not out:
    return 0.0
  body = re.search(r"%fused_computation\." + fusion_num + r" [^{]*\{(.*?)\n\}", hlo, re.S)
  lhs = re.search(r"%" + re.escape(m.group(1)) + r" = f32\[([\d,]+)\]", body.group(1)) if body else None
  if not lhs:
    return 0.0
  k = int(lhs.group(1).split(",")[int(m.group(3))])
  n_out = 1
  for d in out.group(1).split(","):
    n_out *= int(d)
  return 2.0 * n_out * k


def profile_shape(name: str, steps: int, top: int) -> dict:
  cfg, batch_size, seq_len, prompt_len, tcfg = bts.shapes()[name]
  hf_dir = tempfile.mkdtemp(prefix="profile-hf-")
  hf_io.save_hf(cfg, transformer.init_params(cfg, jax.random.PRNGKey(0)), hf_dir)
  step = bts.JaxStep(cfg, hf_dir, bts.synthetic_batch(cfg, batch_size, seq_len, prompt_len), tcfg)
  for _ in range(3):
    step.step()
  start = time.perf_counter()
  for _ in range(steps):
    step.step()
  step_s = (time.perf_counter() - start) / steps
  trace_dir = tempfile.mkdtemp(prefix="profile-trace-")
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      step.step()
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  by_op: collections.Counter = collections.Counter()
  for plane in ProfileData.from_file(path).planes:
    for line in plane.lines:
      if "XLAEigen" not in line.name:
        continue
      for ev in line.events:
        if not ev.name.startswith(_SKIP):
          by_op[ev.name] += ev.duration_ns / 1e6 / steps
  by_kind: collections.Counter = collections.Counter()
  for op, ms in by_op.items():
    by_kind[op.split(".")[0]] += ms
  hlo = step.compiled.as_text()
  fusions = []
  for op, ms in by_op.most_common(top):
    shape = re.search(r"\n\s*%" + re.escape(op) + r" = (\S+)", hlo)
    num = op.split(".")[1] if "." in op else ""
    body = re.search(r"%fused_computation\." + num + r" [^{]*\{(.*?)\n\}", hlo, re.S) if num else None
    root = ""
    if body:
      roots = [line.strip() for line in body.group(1).split("\n") if "ROOT" in line]
      root = re.sub(r", metadata=.*", "", roots[0]) if roots else ""
    flops = _dot_flops(root, hlo, num) if num else 0.0
    fusions.append({"op": op, "ms_per_step": ms, "shape": shape.group(1) if shape else "",
                    "root": root, "gflop_per_s": flops / ms / 1e6 if flops and ms else None})
  return {"shape": name, "batch": batch_size, "seq_len": seq_len, "step_ms": step_s * 1e3,
          "traced_ms_per_step": sum(by_op.values()),
          "by_kind_ms": dict(by_kind.most_common()), "top_fusions": fusions}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="small,wide")
  parser.add_argument("--steps", type=int, default=3, help="traced steps per shape")
  parser.add_argument("--top", type=int, default=15, help="slowest fusions listed")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "results", "train_step_profile.json"))
  args = parser.parse_args(argv)
  results = []
  for name in args.shapes.split(","):
    r = profile_shape(name, args.steps, args.top)
    results.append(r)
    print(f"\n{name}: B{r['batch']} x T{r['seq_len']}, {r['step_ms']:.0f} ms per step; traced op "
          f"time {r['traced_ms_per_step']:.0f} ms per step (summed over XLA's threads)")
    print(f"{'op kind':32s} {'ms/step':>8s}")
    for kind, ms in list(r["by_kind_ms"].items())[:12]:
      print(f"{kind:32s} {ms:8.1f}")
    print(f"{'fusion':24s} {'ms/step':>8s} {'GFLOP/s':>8s}  output / root")
    for f in r["top_fusions"]:
      rate = f"{f['gflop_per_s']:.0f}" if f["gflop_per_s"] else "-"
      print(f"{f['op']:24s} {f['ms_per_step']:8.1f} {rate:>8s}  {f['shape']}  {f['root'][:110]}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
