"""The shipped GPU configs compiled for H100 and H200 without a GPU: analytic plan vs XLA's peak.

For each config x target, `run.gpu_compile.compile_all` compiles every program the run runs on its
trainer GPUs (deviceless, JAX's CUDA plugin) and `config.memory_plan.plan` makes the analytic
plan on the same devices. Prints a table (config, target, analytic plan, XLA peak and its program,
XLA / analytic, fits at devices.memory_fraction with the share to spare, compile seconds) and the
8B train step's collectives and step time, and writes DIR/gpu_compile.json (every program's
record, the time records). Needs `pip install -e '.[gpu-compile]'`; ~10 minutes on 2 cores.

  python bench/gpu_compile.py [--configs qwen3_8b,...] [--targets h100,h200] [--out bench/results]
      [--set trainer.num_microbatches=10 ...] [--replan bench/results/gpu_compile.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPU devices; no GPU backend here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_io import write_json  # pylint: disable=g-import-not-at-top
from jaxreplay.config import gpu_targets  # pylint: disable=g-import-not-at-top
from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top
from jaxreplay.run import gpu_compile  # pylint: disable=g-import-not-at-top

CONFIGS = ("qwen3_8b", "qwen2_5_7b", "llama3_2_3b", "qwen3_0_6b")
GIB = 2 ** 30


def load_config(name: str, overrides: list[str]):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  for item in overrides:
    key, value = item.split("=", 1)
    section, field = key.split(".")
    old = c[section][field]
    if not isinstance(old, str):
      value = type(old)(eval(value))  # pylint: disable=eval-used
    c[section][field] = value
  return c


def measure(name: str, target_name: str, overrides: list[str], recorded: dict = None) -> dict:
  """One config on one target: the analytic plan and every compiled program (`recorded`: a row of
  an earlier run whose compiled programs are reused: only the analytic side is recomputed)."""
  c = load_config(name, overrides)
  target = gpu_targets.load(target_name)
  start = time.perf_counter()
  if recorded is None:
    compiled, time_rec, devices = gpu_compile.compile_all(
        c, target, log=lambda line: print(f"  {name}: {line}", flush=True))
  else:
    compiled, time_rec = recorded["plan"]["compiled"], recorded["plan"]["time"]
    devices = gpu_compile.compile_devices(target)
  limit = int(target.memory_bytes * c.devices.memory_fraction)
  p = memory_plan.plan(c, devices, device_memory=limit)
  p["target"] = {"name": target.name, "description": target.description,
                 "memory_bytes": target.memory_bytes, "memory_fraction": c.devices.memory_fraction}
  p["compiled"] = compiled
  p["time"].update(time_rec)
  memory_plan.with_compiled_fit(p)
  return {"config": name, "target": target_name, "overrides": overrides,
          "analytic_peak_bytes": p["peak"]["analytic_bytes"],
          "xla_peak_bytes": p["peak"]["xla_bytes"],
          "xla_peak_program": p["peak"]["xla_program"],
          "xla_over_analytic": p["peak"]["xla_over_analytic"],
          "usable_bytes": limit, "fits": p["fits"], "spare_fraction": p["peak"]["spare_fraction"],
          "compile_seconds": sum(r["compile_seconds"] for r in compiled.values()),
          "wall_seconds": (time.perf_counter() - start if recorded is None
                           else recorded["wall_seconds"]), "plan": p}


def fits(r: dict) -> str:
  return f"{'yes' if r['fits'] else 'NO'} ({100 * r['spare_fraction']:.1f}%)"


def table(rows: list[dict]) -> str:
  head = (f"{'config':<14}{'target':<7}{'analytic GiB':>13}{'XLA peak GiB':>13}  {'program':<16}"
          f"{'XLA/plan':>9}{'fits (spare)':>15}{'compile s':>10}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['config']:<14}{r['target']:<7}{r['analytic_peak_bytes'] / GIB:>13.2f}"
                 f"{r['xla_peak_bytes'] / GIB:>13.2f}  {r['xla_peak_program']:<16}"
                 f"{r['xla_over_analytic']:>9.3f}{fits(r):>15}{r['compile_seconds']:>10.0f}")
  return "\n".join(lines)


def step_lines(r: dict) -> list[str]:
  tp = r["plan"]["time"]
  out = [f"{r['config']} on {r['target']}: train step {tp['step_flops_per_device'] / 1e12:.0f} "
         f"TFLOP per device ({tp['flops_source'].split(':')[0]}; the model's count "
         f"{tp['model_flops_per_device'] / 1e12:.0f}) -> {tp['compute_s']:.1f} s at MFU "
         f"{tp['assumed']['mfu']:g}; collectives "
         f"{tp['comm_traffic_bytes_per_device'] / 1e9:.0f} GB "
         f"per device -> {tp['comm_s']:.2f} s at {tp['assumed']['nvlink_gbps']:g} GB/s"]
  for kind, v in tp["collectives"].items():
    out.append(f"  {kind:<20}{v['count']:>7} per step {v['bytes'] / 1e9:>9.1f} GB "
               f"ring traffic {v['traffic_bytes'] / 1e9:>8.1f} GB {v['seconds']:>7.3f} s")
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--configs", default=",".join(CONFIGS))
  ap.add_argument("--targets", default=",".join(gpu_targets.names()))
  ap.add_argument("--set", nargs="*", default=[], help="config overrides section.key=value")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  ap.add_argument("--replan", default="", help="a gpu_compile.json whose compiled programs are "
                  "kept: only the analytic plan is recomputed (no compile)")
  args = ap.parse_args()
  rows = []
  if args.replan:
    with open(args.replan) as f:
      for old in json.load(f)["rows"]:
        rows.append(measure(old["config"], old["target"], old["overrides"], recorded=old))
  for name in args.configs.split(",") if not args.replan else ():
    for target in args.targets.split(","):
      rows.append(measure(name, target, args.set))
      print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(table(rows))
  for r in rows:
    if r["target"] == "h100":
      print("\n".join(step_lines(r)))
  path = write_json(args.out, "gpu_compile.json", {
      "rows": rows, "jax_platform_note": "compile-only devices of JAX's CUDA-13 plugin; no GPU"})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
