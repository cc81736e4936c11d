"""Multi-process trainer (jax.distributed, what launch/multi_host.sh starts on several hosts), here as
two local CPU processes with two emulated devices each, against one process with four devices."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np

import pytest

from tests.helpers.deps import require
from tests.helpers.paths import REPO
from tests.helpers.tiny_runs import ENV, SHORT, read_rows

pytestmark = pytest.mark.slow  # end to end: `pytest -m 'not slow'` skips them

ARGS = [*SHORT, "--config.trainer.schedule=constant", "--config.trainer.mesh_shape=(1,-1,1)"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, devices, *extra, process=None, port=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_COMPILATION_CACHE_DIR=ENV["JAX_COMPILATION_CACHE_DIR"])
  cmd = [sys.executable, "-m", "jaxreplay.launch", f"--config={REPO}/configs/tiny.py",
         f"--workdir={workdir}", *ARGS, *extra]
  if process is not None:
    cmd += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
            f"--process_id={process}"]
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _run_two_processes(workdir, *extra):
  port = _free_port()
  procs = [_launch(workdir, 2, *extra, process=i, port=port) for i in range(2)]
  errs = [p.communicate(timeout=600)[1] for p in procs]
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-4000:]
  return errs


def test_two_trainer_processes_match_one_process_and_resume(tmp_path):
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  ref = _launch(single, 4)
  errs = _run_two_processes(multi)
  assert ref.communicate(timeout=600)[1] is not None and ref.returncode == 0
  for i, err in enumerate(errs):
    assert f"trainer process {i}/2: 2 local, 4 global devices" in err

  rows_m, rows_s = read_rows(multi), read_rows(single)
  assert [r["step"] for r in rows_m] == list(range(7))
  for key in ("loss", "grad_norm", "param_norm", "batch/reward_mean"):
    got = np.array([r[key] for r in rows_m[1:]])
    want = np.array([r[key] for r in rows_s[1:]])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=key)
  assert rows_m[-1]["eval/pass@1"] == rows_s[-1]["eval/pass@1"]
  # Only process 0 writes rows (the step list above has no duplicates); checkpoint and HF export.
  assert os.path.isdir(os.path.join(multi, "checkpoints", "6"))
  with open(os.path.join(multi, "hf", "config.json")) as f:
    assert json.load(f)["model_type"] == "qwen3"

  # Re-running the same command with more steps resumes both processes from the checkpoint.
  errs = _run_two_processes(multi, "--config.total_steps=8")
  assert all("resumed at step 6" in e for e in errs)
  rows = read_rows(multi)
  assert [r["step"] for r in rows] == list(range(9))


ASYNC = ["--config.scheduler.kind=async", "--config.rollout.num_workers=2"]


def _two_processes(workdir, *extra):
  port = _free_port()
  return [_launch(workdir, 2, *extra, process=i, port=port) for i in range(2)]


def _delivered(log):
  """(rollouts the pool delivered, rollouts the buffer took) from process 0's closing log lines."""
  pool = re.search(r"rollout pool stopped: \d+ requests, (\d+) rollouts delivered", log)
  buffer = re.search(r"replay buffer: (\d+) rollouts added", log)
  assert pool and buffer, log[-3000:]
  return int(pool.group(1)), int(buffer.group(1))


def test_async_over_two_processes_with_ray_workers_one_killed(tmp_path):
  """launch/local_processes.sh: 2 trainer processes, the async schedule, 2 rollout workers as Ray
  actors of a local Ray instance. Process 0 owns the one buffer and the workers, process 1 trains
  on the batches it receives and generates nothing; every rollout the workers delivered entered
  the buffer once; an actor SIGKILLed mid-run is restarted by Ray and the run finishes."""
  ray = require("ray")
  del ray
  workdir = str(tmp_path / "ray")
  env = dict(os.environ, PORT=str(_free_port()),
             PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
             JAX_COMPILATION_CACHE_DIR=ENV["JAX_COMPILATION_CACHE_DIR"])
  args = [a for a in ARGS if "mesh_shape" not in a]  # the script sets it (tuples append)
  script = subprocess.Popen(["bash", "launch/local_processes.sh", "2", workdir, *args,
                             "--config.total_steps=24", "--config.checkpoint.every=8"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
  log0 = os.path.join(workdir, "process_0.log")
  deadline, killed = time.monotonic() + 600, None
  while killed is None and script.poll() is None and time.monotonic() < deadline:
    text = open(log0).read() if os.path.exists(log0) else ""
    started = re.search(r"rollout actor 1 started: pid (\d+)", text)
    if started and re.search(r"step ([3-9]|1\d)/24", text):
      killed = int(started.group(1))
      os.kill(killed, signal.SIGKILL)
    time.sleep(0.2)
  out = script.communicate(timeout=600)[0]
  assert script.returncode == 0, out[-4000:]
  assert killed is not None, "the run ended before an actor could be killed"
  logs = [open(os.path.join(workdir, f"process_{i}.log")).read() for i in range(2)]
  assert "follows trainer process 0" in logs[1]
  assert "rollout actor" not in logs[1] and "rollout pool" not in logs[1]  # no worker on process 1
  assert re.search(r"rollout actor 1 restarted by Ray: pid (?!%d\b)\d+" % killed, logs[0]), logs[0][-3000:]
  delivered, added = _delivered(logs[0])
  assert delivered == added > 0
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == list(range(25))
  assert rows[-1]["pool/restarts"] >= 1 and rows[-1]["pool/live_threads"] == 2
  assert all(np.isfinite(r["loss"]) for r in rows[1:])


def test_async_over_two_processes_killed_mid_way_resumes(tmp_path):
  """Both trainer processes of an async run SIGKILLed once step 6 is checkpointed; the same command
  resumes both from it (the one buffer restored on process 0) and finishes."""
  workdir = str(tmp_path / "async")
  procs = _two_processes(workdir, *ASYNC, "--config.total_steps=200")
  deadline = time.monotonic() + 600
  while not os.path.isdir(os.path.join(workdir, "checkpoints", "6")):
    assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
    assert time.monotonic() < deadline, "no checkpoint 6 within 600 s"
    time.sleep(0.5)
  for p in procs:
    p.send_signal(signal.SIGKILL)
  for p in procs:
    p.communicate(timeout=60)
  # Resumed with the evaluation on the rollout workers: process 0's pool runs it and process 1
  # receives the results (both report the same numbers).
  ckpt_dir = os.path.join(workdir, "checkpoints")
  last = max(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())  # 6, or later if it ran on
  errs = _run_two_processes(workdir, *ASYNC, f"--config.total_steps={last + 2}",
                            "--config.eval.backend=engines")
  assert all(f"resumed at step {last} (buffer 128 rollouts)" in e for e in errs), errs[0][-3000:]
  assert "follows trainer process 0" in errs[1]
  finals = [re.search(r"eval/pass@1 +\S+ -> ([0-9.]+)", e) for e in errs]  # the summary's table
  assert all(finals) and finals[0].group(1) == finals[1].group(1), errs[0][-3000:]
  delivered, added = _delivered(errs[0])
  assert added >= delivered  # the buffer's count continues over the resume, the pool's restarts
  steps = [r["step"] for r in read_rows(workdir)]
  assert steps == sorted(set(steps)) and steps[-1] == last + 2
