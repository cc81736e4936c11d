"""The train step's GEMMs alone: XLA:CPU (each dot library it offers) vs PyTorch, GFLOP/s.

`bench_train_step.py` finds the jaxreplay step behind the PyTorch + transformers step on the wide
shape (2 layers, hidden 1024, B4 x T256). This bench asks how much of that is the matrix multiply
itself: the wide shape's GEMMs in each form a forward + backward step runs them,

  NN  x @ W        (forward: activations [M, K] times a kernel [K, N])
  NT  g @ W.T      (backward, input gradient: contracting the kernel's output dimension)
  TN  x.T @ g      (backward, kernel gradient: contracting the token dimension)

each a jitted single dot in JAX and the same expression in torch (2 threads = the cores XLA uses,
OMP_WAIT_POLICY=PASSIVE), interleaved over `--rounds` rounds, best time of each side. JAX runs per
XLA dot library in a subprocess with its XLA_FLAGS, the list `--repeats` times over; a library's
ratio to torch is taken within one subprocess (both sides timed together: this VM's speed drifts by
tens of percent between minutes), the best of its repeats:

  default  YNNPACK dot fusions (what the train step uses)
  eigen    --xla_cpu_experimental_ynn_fusion_type=-dot (XLA's own Eigen dot)
  xnnpack  --xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_fusion_type=dot
  onednn   --xla_cpu_use_onednn=true

Prints a table (GFLOP/s per GEMM and library, torch, and the best JAX library over torch) and writes
OUT/dots.json (OUT may also name the .json file).

  python bench/bench_dots.py --out bench/results [--rounds 7] [--repeats 2] [--libraries default,onednn]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_io  # noqa: E402  pylint: disable=g-import-not-at-top

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARIES = {
    "default": "",
    "eigen": "--xla_cpu_experimental_ynn_fusion_type=-dot",
    "xnnpack": "--xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_fusion_type=dot",
    "onednn": "--xla_cpu_use_onednn=true",
}
# (name, M, K, N): the wide shape's GEMMs; M = B x T = 1024 tokens.
GEMMS = [("q/o proj 1024x1024", 1024, 1024, 1024), ("gate/up 1024x3072", 1024, 1024, 3072),
         ("down 3072x1024", 1024, 3072, 1024), ("lm head 1024x8192", 1024, 1024, 8192)]
FORMS = ("NN", "NT", "TN")


def _operands(form: str, m: int, k: int, n: int, rng):
  """Operands whose product is [m, n] (NN, NT) or [k, n] (TN: contracting m)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  if form == "NN":
    return f(m, k), f(k, n)
  if form == "NT":
    return f(m, k), f(n, k)
  return f(m, k), f(m, n)


def _child(rounds: int) -> None:
  """Runs in a subprocess with one library's XLA_FLAGS: prints one JSON line of best seconds."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count() or 1)
  rng = np.random.default_rng(0)
  fns = {"NN": lambda a, b: a @ b, "NT": lambda a, b: a @ b.T, "TN": lambda a, b: a.T @ b}
  out = []
  for name, m, k, n in GEMMS:
    for form in FORMS:
      a, b = _operands(form, m, k, n, rng)
      ja, jb = jax.device_put(a), jax.device_put(b)
      ta, tb = torch.from_numpy(a), torch.from_numpy(b)
      jitted = jax.jit(fns[form])
      jax.block_until_ready(jitted(ja, jb))
      fns[form](ta, tb)
      best = {"jax": float("inf"), "torch": float("inf")}
      for r in range(rounds):
        order = ("jax", "torch") if r % 2 == 0 else ("torch", "jax")
        for side in order:
          start = time.perf_counter()
          if side == "jax":
            jax.block_until_ready(jitted(ja, jb))
          else:
            fns[form](ta, tb)
          best[side] = min(best[side], time.perf_counter() - start)
      out.append({"gemm": name, "form": form, "flops": 2 * m * k * n,
                  **{f"{side}_s": t for side, t in best.items()}})
  print(json.dumps(out))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--libraries", default=",".join(LIBRARIES))
  parser.add_argument("--repeats", type=int, default=2, help="runs of the library list")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args.rounds)
    return
  libraries = [x for x in args.libraries.split(",") if x]
  unknown = sorted(set(libraries) - set(LIBRARIES))
  if unknown:
    raise SystemExit(f"--libraries: unknown {unknown}; expected some of {sorted(LIBRARIES)}")
  runs: dict[str, list] = {lib: [] for lib in libraries}
  for _ in range(args.repeats):
    for library in libraries:
      env = dict(os.environ, XLA_FLAGS=LIBRARIES[library], OMP_WAIT_POLICY="PASSIVE",
                 PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                             f"--rounds={args.rounds}"], env=env, capture_output=True, text=True,
                            timeout=1800)
      if proc.returncode != 0:
        raise SystemExit(f"library {library} failed:\n{proc.stderr[-3000:]}")
      runs[library].append(json.loads(proc.stdout.strip().splitlines()[-1]))
  rows = []
  for i, (name, _, _, _) in enumerate(g for g in GEMMS for _ in FORMS):
    form = FORMS[i % len(FORMS)]
    flops = runs[libraries[0]][0][i]["flops"]
    torch_s = min(run[i]["torch_s"] for lib in libraries for run in runs[lib])
    row = {"gemm": name, "form": form, "torch_gflops": flops / torch_s / 1e9}
    for lib in libraries:
      ratios = [run[i]["torch_s"] / run[i]["jax_s"] for run in runs[lib]]
      best = max(range(len(ratios)), key=ratios.__getitem__)
      row[f"{lib}_gflops"] = flops / runs[lib][best][i]["jax_s"] / 1e9
      row[f"{lib}_over_torch"] = ratios[best]  # speed ratio, same subprocess
    best_lib = max(libraries, key=lambda lib: row[f"{lib}_over_torch"])
    row["best_jax_library"] = best_lib
    row["best_jax_over_torch"] = row[f"{best_lib}_over_torch"]
    rows.append(row)
  header = f"{'GEMM':>20} {'form':>4} " + " ".join(f"{lib:>8}" for lib in libraries)
  print("GFLOP/s, best of rounds (f32, jitted single dot vs torch)")
  print(header + f" {'torch':>8} {'best/torch':>10}   (best/torch: speed ratio in one process)")
  for r in rows:
    gflops = " ".join(f"{r[f'{lib}_gflops']:8.0f}" for lib in libraries)
    print(f"{r['gemm']:>20} {r['form']:>4} {gflops} {r['torch_gflops']:8.0f} "
          f"{r['best_jax_over_torch']:10.2f}")
  total = {lib: sum(1 / r[f"{lib}_over_torch"] for r in rows) / len(rows) for lib in libraries}
  total["best_per_gemm"] = sum(1 / r["best_jax_over_torch"] for r in rows) / len(rows)
  print("mean JAX time over torch's (same process): "
        + ", ".join(f"{lib} {v:.2f}x" for lib, v in total.items()))
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "load_average": os.getloadavg()},
         "jax": jax.__version__, "torch": torch.__version__, "rounds": args.rounds,
         "repeats": args.repeats,
         "libraries": {lib: LIBRARIES[lib] for lib in libraries}, "command": " ".join(sys.argv),
         "mean_time_over_torch": total, "results": rows}
  print(f"wrote {bench_io.write_json(args.out, 'dots.json', out)}")


if __name__ == "__main__":
  main()
