"""What a user waits for at the console of `python -m jaxreplay.launch` (issue 39), tiny default:

  first_line_s   process start -> the first line on the console (the banner: config, model size,
                 devices, backends), for a new run of configs/tiny.py
  first_step_s   process start -> the first progress line (`step ...`)
  ctrl_c_s       SIGINT sent during start-up (`--ctrl_c_after` seconds after the banner: the build
                 and compiles) -> the process gone; with its exit status (130 expected)
  bad_input_s    process start -> exit for a misspelled key (the one-line error, exit 2)

Each is measured `--reps` times (median, min, max); the runs use the JAX sampler, the suite's
shortened tiny config and a fresh workdir each, with the machine's JAX compilation cache as
configured (JAX_COMPILATION_CACHE_DIR). Prints a table and writes JSON.

  python bench/bench_console.py [--reps 3] [--ctrl_c_after 2] [--out bench/results/console.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_io  # noqa: E402  pylint: disable=g-import-not-at-top

SHORT = ["--config.total_steps=6", "--config.eval.num_problems=16", "--config.eval.n_samples=4",
         "--config.eval.ks=(1,2,4)", "--config.trainer.warmup_steps=1",
         "--config.rollout.backend=jax"]


def launch(workdir: str, *extra: str) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  cmd = [sys.executable, "-m", "jaxreplay.launch", "--config=configs/tiny.py",
         f"--workdir={workdir}", *SHORT, *extra]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1)


def watch(proc: subprocess.Popen, t0: float, marks: dict, lines: list) -> threading.Thread:
  """Reads the console; `marks`: seconds from t0 to the first line, the banner's log line, the
  first progress line."""
  def read():
    for line in proc.stdout:
      now = time.monotonic() - t0
      lines.append(line.rstrip("\n"))
      marks.setdefault("first_line_s", now)
      if line.strip().startswith("log "):
        marks.setdefault("banner_s", now)
      if line.startswith("step "):
        marks.setdefault("first_step_s", now)
  thread = threading.Thread(target=read, daemon=True)
  thread.start()
  return thread


def first_lines(reps: int) -> list[dict]:
  out = []
  for _ in range(reps):
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.monotonic()
      proc = launch(os.path.join(tmp, "run"))
      marks, lines = {}, []
      thread = watch(proc, t0, marks, lines)
      rc = proc.wait(timeout=900)
      thread.join(timeout=10)
      out.append(dict(marks, total_s=time.monotonic() - t0, rc=rc, first_line=lines[0]))
  return out


def ctrl_c(reps: int, after: float) -> list[dict]:
  out = []
  for _ in range(reps):
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.monotonic()
      proc = launch(os.path.join(tmp, "run"))
      marks, lines = {}, []
      thread = watch(proc, t0, marks, lines)
      while "banner_s" not in marks and proc.poll() is None:
        time.sleep(0.02)
      time.sleep(after)
      sent = time.monotonic()
      proc.send_signal(signal.SIGINT)
      rc = proc.wait(timeout=300)
      latency = time.monotonic() - sent
      thread.join(timeout=10)
      out.append({"sent_after_start_s": sent - t0, "latency_s": latency, "rc": rc,
                  "last_line": lines[-1] if lines else ""})
  return out


def bad_input(reps: int) -> list[dict]:
  out = []
  for _ in range(reps):
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.monotonic()
      proc = launch(os.path.join(tmp, "run"), "--config.trainer.learnin_rate=1e-3")
      text = proc.stdout.read()
      rc = proc.wait(timeout=300)
      out.append({"seconds": time.monotonic() - t0, "rc": rc, "output": text.strip(),
                  "created": os.listdir(tmp)})
  return out


def stats(values: list[float]) -> dict:
  return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--ctrl_c_after", type=float, default=2.0,
                 help="seconds after the banner to send SIGINT (inside the build / compiles)")
  p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "console.json"))
  args = p.parse_args()
  runs, stops, bads = first_lines(args.reps), ctrl_c(args.reps, args.ctrl_c_after), \
      bad_input(args.reps)
  result = {
      "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
      "load_avg_1m": os.getloadavg()[0], "reps": args.reps,
      "first_line_s": stats([r["first_line_s"] for r in runs]),
      "first_step_s": stats([r["first_step_s"] for r in runs if "first_step_s" in r]),
      "run_total_s": stats([r["total_s"] for r in runs]),
      "ctrl_c_latency_s": stats([s["latency_s"] for s in stops]),
      "bad_input_s": stats([b["seconds"] for b in bads]),
      "runs": runs, "ctrl_c": stops, "bad_input": bads,
  }
  rows = [("first console line (banner)", result["first_line_s"]),
          ("first progress line", result["first_step_s"]),
          ("whole shortened run (6 steps)", result["run_total_s"]),
          (f"Ctrl-C at start-up ({args.ctrl_c_after:g} s after the banner) -> exit",
           result["ctrl_c_latency_s"]),
          ("misspelled key -> one-line error, exit", result["bad_input_s"])]
  print(f"| what (s, {args.reps} reps, load {result['load_avg_1m']:.1f}) | median | min | max |")
  print("|---|---|---|---|")
  for name, s in rows:
    print(f"| {name} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} |")
  print("exit statuses: run", sorted({r["rc"] for r in runs}), "Ctrl-C",
        sorted({s["rc"] for s in stops}), "bad input", sorted({b["rc"] for b in bads}))
  print("wrote", bench_io.write_json(args.out, "console.json", result))


if __name__ == "__main__":
  main()
