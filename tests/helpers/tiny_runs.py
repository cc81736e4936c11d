"""Shortened tiny-config runs of `python -m jaxreplay.launch` for the end-to-end and fault tests.

`SHORT` makes a 6-step run (evals at 3 and 6, checkpoints every 2 steps) of `configs/tiny.py` on the
JAX backend; `ENV` runs it on one CPU device with a JAX compilation cache shared by the test session
(each run then compiles nothing the previous ones compiled, however fast it compiled).
"""
import json
import os
import subprocess
import sys
import tempfile

from tests.helpers.paths import REPO


SFT = os.path.join(REPO, "assets", "tiny-arith-sft")

SHORT = [
    "--config.total_steps=6", "--config.eval.every=3", "--config.eval.num_problems=16",
    "--config.eval.n_samples=4", "--config.eval.ks=(1,2,4)", "--config.checkpoint.every=2",
    "--config.buffer.size=128", "--config.buffer.batch_size=32", "--config.rollout.group_size=4",
    "--config.rollout.prompts_per_request=4", "--config.log.every_s=1",
    "--config.trainer.warmup_steps=1",  # tiny.py's cosine schedule needs total_steps > warmup
    "--config.rollout.backend=jax",  # tiny.py says auto; the vLLM tests override this
]

# Under pytest, tests/conftest.py has already set the session's cache (every compiled program);
# setdefault keeps it and gives the same cache to a script that imports this module alone.
ENV = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
ENV.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get(
    "JAXREPLAY_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "jaxreplay-test-jax-cache")))
ENV.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Keys that legitimately differ between two runs of one config: wall-clock timings and measured
# (not simulated) compute.
TIMING_PREFIXES = ("time/", "compute/", "eval/seconds")


def launch_cmd(workdir, *extra):
  return [sys.executable, "-m", "jaxreplay.launch", f"--config={REPO}/configs/tiny.py",
          f"--workdir={workdir}", *SHORT, *extra]


def run_launch(workdir, *extra, timeout=400, expect_rc=0):
  proc = subprocess.run(launch_cmd(workdir, *extra), cwd=REPO, env=ENV, capture_output=True,
                        text=True, timeout=timeout)
  if expect_rc is not None:
    assert proc.returncode == expect_rc, (proc.returncode, proc.stderr[-4000:])
  return proc


def start(workdir, *extra, log_path=None):
  """The launch command as a background process (stdout/stderr to `log_path` or discarded)."""
  out = open(log_path, "w") if log_path else subprocess.DEVNULL
  return subprocess.Popen(launch_cmd(workdir, *extra), cwd=REPO, env=ENV, stdout=out,
                          stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)


def read_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def comparable(row):
  """The keys of a metrics row that a rerun of the same config must reproduce bit for bit."""
  return {k: v for k, v in row.items()
          if k.startswith("sim/") or not (k.startswith(TIMING_PREFIXES) or k == "compute_seconds")}
