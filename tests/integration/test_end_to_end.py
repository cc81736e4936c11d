"""End to end: `python -m jaxreplay.launch` on a shortened tiny config.

Checks metrics are written, the buffer is reused (replay ratio > 1 when N > R), staleness > 0 with
asynchronous workers, weights were refreshed, a kill -9 mid-run followed by the same command resumes
from the checkpoint, the HF export loads in transformers, and the simulated schedule is deterministic.
"""
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxreplay.run import eval_problems
from jaxreplay.run.evaluation import pass_at_k_per_problem
from tests.helpers import tolerances
from tests.helpers.deps import require
from tests.helpers.tiny_runs import ENV, REPO, comparable, launch_cmd, read_rows, run_launch

pytestmark = pytest.mark.slow  # end to end: `pytest -m 'not slow'` skips them


def check_common(rows, total=6):
  steps = [r["step"] for r in rows]
  assert steps == list(range(total + 1)), steps
  last = rows[-1]
  for key in ("policy_version", "compute_seconds", "reward_mean", "eval/pass@1",
              "buffer/staleness_mean", "buffer/replay_ratio", "buffer/size", "loss", "clip_fraction",
              "compute/mu", "compute/gamma", "compute/w_over_t", "time/step_s"):
    assert key in last, key
  assert last["policy_version"] == total
  assert last["published_version"] == total  # weights were refreshed every step
  compute = [r["compute_seconds"] for r in rows]
  assert all(b >= a for a, b in zip(compute, compute[1:])) and compute[-1] > 0


def check_problem_rows(workdir, rows, same_compute=True):
  """eval_problems.jsonl: one row per evaluation of the metrics rows (none twice), whose per-problem
  counts give back the row's eval/pass@1 and eval/pass@k (and, on a virtual clock, its compute)."""
  problem_rows = eval_problems.read_rows(workdir)
  evaluated = [r for r in rows if "eval/pass@1" in r]
  assert [p["step"] for p in problem_rows] == [r["step"] for r in evaluated]
  assert len(eval_problems.problem_prompts(problem_rows)) == 16  # SHORT: 16 held-out problems
  assert "problems" in problem_rows[0] and all("problems" not in p for p in problem_rows[1:])
  for p, r in zip(problem_rows, evaluated):
    assert p["compute_seconds"] == pytest.approx(r["compute_seconds"]) or not same_compute
    assert np.mean(p["pass1_correct"]) / p["n_pass1"] == pytest.approx(r["eval/pass@1"])
    matrix = eval_problems.correct_matrix(p["passk_correct"], p["n_samples"])
    for k in (2, 4):
      assert pass_at_k_per_problem(matrix, k).mean() == pytest.approx(r[f"eval/pass@{k}"])
  return problem_rows


def test_simulated_jax_replays_and_is_deterministic(tmp_path, tiny_reference_run):
  a, b = tiny_reference_run, str(tmp_path / "b")
  run_launch(b, "--config.export_hf_every=4", "--config.checkpoint.every=0")  # hf/ at 4 and 6
  rows_a, rows_b = read_rows(a), read_rows(b)
  check_common(rows_a)
  last = rows_a[-1]
  # N=128 > R: every rollout is sampled more than once on average.
  assert last["buffer/replay_ratio"] > 1.0
  # (W, T) = (2, 1) with mu = 6.84: a request spans several steps, so batches are stale.
  assert max(r.get("buffer/staleness_mean", 0) for r in rows_a) > 0
  assert np.isfinite(last["mismatch/exp_abs_diff"]) and last["mismatch/exp_abs_diff"] <= 1.05
  assert all(r.get("nonfinite_skipped", 0.0) == 0.0 for r in rows_a)
  # Same seed, same results, bit for bit (timings aside).
  assert [comparable(r) for r in rows_a] == [comparable(r) for r in rows_b]
  problems_a = check_problem_rows(a, rows_a)
  assert [p["step"] for p in problems_a] == [0, 3, 6]
  assert ([{k: v for k, v in p.items() if k != "compute_seconds"} for p in problems_a] ==
          [{k: v for k, v in p.items() if k != "compute_seconds"}
           for p in check_problem_rows(b, rows_b)])
  # The HF export loads in transformers and gives our logits.
  transformers = require("transformers")
  torch = require("torch")
  from jaxreplay.models import hf_io
  from jaxreplay.models import transformer
  assert os.listdir(os.path.join(b, "checkpoints")) == ["6"]  # checkpoint.every=0: the end only
  assert os.path.isfile(os.path.join(b, "hf", "model.safetensors"))  # export_hf_every=4
  hf = os.path.join(a, "hf")
  model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
  cfg, params = hf_io.load_hf(hf)
  tokens = np.array([[1, 5, 6, 7, 8, 9]], np.int32)
  ours = np.asarray(transformer.apply(cfg, params, tokens))
  theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.detach().numpy()
  # JAX vs torch: each logit sums hidden_size-wide products in every layer, in another order.
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=tolerances.close(
      np.float32, cfg.hidden_size * cfg.num_hidden_layers, max(1.0, np.abs(theirs).max()))["atol"])


def test_async_jax_staleness_and_kill_resume(tmp_path):
  workdir = str(tmp_path / "async")
  env = dict(ENV)
  extra = ("--config.scheduler.kind=async", "--config.total_steps=8")
  proc = subprocess.Popen(launch_cmd(workdir, *extra), cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt = os.path.join(workdir, "checkpoints", "2")
  deadline = time.time() + 300
  while not os.path.isdir(ckpt) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.2)
  assert os.path.isdir(ckpt), "no checkpoint was written before the deadline"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_rows = read_rows(workdir)
  assert killed_rows[-1]["step"] < 8
  out = run_launch(workdir, *extra)
  assert "resumed at step" in out.stderr
  rows = read_rows(workdir)
  check_common(rows, total=8)
  # the evaluations after the resumed checkpoint are not listed twice (async: measured compute
  # moves on between the evaluation and the row)
  check_problem_rows(workdir, rows, same_compute=False)
  # Real worker threads sample while the trainer steps: batches hold older policy versions. (Here the
  # in-process JAX workers outpace the trainer, so R > B and the replay ratio is not asserted.)
  assert max(r.get("buffer/staleness_mean", 0) for r in rows) > 0


def test_on_policy_baseline_uses_each_rollout_once(tmp_path):
  workdir = str(tmp_path / "onpolicy")
  run_launch(workdir, "--config.buffer.on_policy=True", "--config.buffer.size=32")
  rows = read_rows(workdir)
  check_common(rows)
  assert rows[-1]["buffer/replay_ratio"] <= 1.0


def test_sync_on_policy_runs_to_a_compute_budget_with_evals_on_a_grid(tmp_path):
  """The theory's synchronous loop with N = B = R (on-policy, LIFO queue): every rollout is used
  once; the run stops at the first step whose compute reaches the budget; evals land on the first
  steps past each compute-grid point."""
  workdir = str(tmp_path / "sync")
  run_launch(workdir, "--config.scheduler.kind=sync", "--config.scheduler.rollouts_per_step=32",
             "--config.buffer.size=32", "--config.buffer.on_policy=True",
             "--config.total_steps=50", "--config.compute_budget=30",
             "--config.eval.compute_grid=(0,10,20)", "--config.trainer.schedule=constant",
             "--config.eval.passk_grid=(0,20)")
  rows = read_rows(workdir)
  # pass@k samples only at the eval.passk_grid points (0 and 20) and the final evaluation.
  passk = [r["step"] for r in rows if "eval/pass@2" in r]
  assert passk == [0, next(r["step"] for r in rows if r["compute_seconds"] >= 20), rows[-1]["step"]]
  compute = [r["compute_seconds"] for r in rows]
  assert compute[-1] >= 30 > compute[-2] and rows[-1]["step"] < 50
  evals = [r["step"] for r in rows if "eval/pass@1" in r]
  expected = [0] + [next(r["step"] for r in rows if r["compute_seconds"] >= x) for x in (10, 20)]
  assert evals == expected + [rows[-1]["step"]]
  last = rows[-1]
  assert last["buffer/replay_ratio"] == 1.0 and last["buffer/staleness_max"] == 0
  assert last["compute/gamma"] == last["sim/gamma"] == 1.0 and last["compute/mu"] == 6.84
  # Rerunning a finished budget run does nothing.
  out = run_launch(workdir, "--config.scheduler.kind=sync", "--config.scheduler.rollouts_per_step=32",
                   "--config.buffer.size=32", "--config.buffer.on_policy=True",
                   "--config.total_steps=50", "--config.compute_budget=30",
                   "--config.eval.compute_grid=(0,10,20)", "--config.trainer.schedule=constant",
                   "--config.eval.passk_grid=(0,20)")
  assert "nothing to do" in out.stderr and len(read_rows(workdir)) == len(rows)


def test_refined_eval_grid_adds_evaluations_and_changes_no_update(tmp_path, tiny_reference_run):
  """eval.refine_levels: a level every pass@1 is within reach of (1.0, band 1) splits each grid
  interval ahead of an evaluation in 3; the run evaluates at the first steps past the added points
  too (pass@1 only), and every other key of every row is that of the reference run, which
  evaluated every 3 steps instead (evaluation draws its own noise: it changes no update)."""
  grid = (25.0, 40.0)
  refined = str(tmp_path / "refined")
  run_launch(refined, f"--config.eval.compute_grid={grid}", "--config.eval.passk_grid=(25,)",
             "--config.eval.refine_levels=(1.0,)", "--config.eval.refine_band=1.0",
             "--config.eval.refine_splits=3")
  rows_p, rows_r = read_rows(tiny_reference_run), read_rows(refined)
  assert [r["compute_seconds"] for r in rows_r] == [r["compute_seconds"] for r in rows_p]

  def first_step_past(x):
    return next(r["step"] for r in rows_p if r["compute_seconds"] >= x)

  # 25 -> 40 is split (it follows the evaluation at 25); nothing follows 40 on the grid.
  added = [25.0 * (40.0 / 25.0) ** (j / 3) for j in (1, 2)]
  last = rows_p[-1]["step"]
  evals_r = [r["step"] for r in rows_r if "eval/pass@1" in r]
  assert evals_r == sorted({0, last, *map(first_step_past, grid + tuple(added))})
  assert len(set(map(first_step_past, grid + tuple(added)))) > len(grid)  # the split adds some
  passk = [r["step"] for r in rows_r if "eval/pass@2" in r]
  assert passk == sorted({first_step_past(25.0), last})  # none at the added points

  def training(row):  # reward/calls counts the evaluations' reward calls too
    return {k: v for k, v in comparable(row).items()
            if not k.startswith("eval/") and k != "reward/calls"}

  assert [training(r) for r in rows_r] == [training(r) for r in rows_p]
  assert rows_r[0]["eval/pass@1"] == rows_p[0]["eval/pass@1"]  # the same first evaluation


def test_vllm_backend_end_to_end(tmp_path):
  require("vllm")
  workdir = str(tmp_path / "vllm")
  run_launch(workdir, "--config.rollout.backend=vllm", "--config.total_steps=4",
             "--config.eval.every=0")
  rows = read_rows(workdir)
  check_common(rows, total=4)
  assert rows[-1]["mismatch/exp_abs_diff"] <= 1.05


def _vllm_children(pid: int) -> list[int]:
  """pids of the vLLM worker processes of `pid`: `jaxreplay.infra.child_process` children started with
  the engine's environment (VLLM_CPU_KVCACHE_SPACE)."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read()
      with open(f"/proc/{entry}/environ", "rb") as f:
        environ = f.read()
    except (OSError, ValueError, IndexError):
      continue
    if ppid == pid and b"jaxreplay.infra.child_process" in cmd and b"VLLM_CPU_KVCACHE_SPACE=" in environ:
      out.append(int(entry))
  return sorted(out)


def test_vllm_async_worker_processes(tmp_path):
  """W=2 vLLM engine processes next to the trainer: stale batches, refreshed weights, agreement;
  one engine process killed with SIGKILL mid-run is replaced and the run finishes."""
  require("vllm")
  workdir = str(tmp_path / "vllm_async")
  # Steps enough for the killed engine's replacement to start (vLLM start-up ~20 s on CPU) before
  # the run ends: with 12, a warm-cache trainer finished first once and no restart was counted.
  total = 24
  env = dict(ENV)
  proc = subprocess.Popen(
      launch_cmd(workdir, "--config.rollout.backend=vllm", "--config.scheduler.kind=async",
                 "--config.rollout.num_workers=2", "--config.eval.every=0",
                 f"--config.total_steps={total}", f"--config.checkpoint.every={total}"),
      cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline, killed = time.time() + 400, None
    metrics = os.path.join(workdir, "metrics.jsonl")
    while time.time() < deadline and proc.poll() is None and killed is None:
      time.sleep(0.5)
      if os.path.exists(metrics) and len(read_rows(workdir)) >= 3:
        children = _vllm_children(proc.pid)
        if len(children) >= 2:
          killed = children[0]
          os.kill(killed, signal.SIGKILL)
    assert killed is not None, "the run ended or stalled before two vLLM workers were seen"
    _, stderr = proc.communicate(timeout=400)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, stderr[-4000:]
  assert f"vLLM worker pid {killed} died" in stderr
  rows = read_rows(workdir)
  check_common(rows, total=total)
  assert rows[-1]["pool/restarts"] >= 1
  assert max(r.get("buffer/staleness_mean", 0) for r in rows) > 0
  assert rows[-1]["mismatch/exp_abs_diff"] <= 1.05


def test_bad_config_fails_fast_with_a_fix(tmp_path):
  env = dict(ENV)
  proc = subprocess.run(launch_cmd(str(tmp_path / "bad"), "--config.buffer.batch_size=512"),
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
  assert proc.returncode != 0
  assert "buffer.batch_size (B=512) > buffer.size (N=128)" in proc.stderr
  proc = subprocess.run(launch_cmd(str(tmp_path / "bad2"), "--config.buffer.sizee=3"),
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
  assert proc.returncode != 0 and "sizee" in proc.stderr
  proc = subprocess.run(launch_cmd(str(tmp_path / "bad3"), "--config.total_steps=3",
                                   "--config.trainer.warmup_steps=5"),
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
  assert proc.returncode != 0
  assert "needs total_steps=3 > trainer.warmup_steps=5; lower warmup_steps" in proc.stderr


def test_a_rejected_rerun_changes_nothing(tmp_path, tiny_reference_run):
  """Resuming a finished cosine run with a longer horizon would make the learning rate jump: it is
  refused, and neither run_config.json nor the rows change; an invalid config leaves them too."""
  workdir = str(tmp_path / "rerun")
  shutil.copytree(tiny_reference_run, workdir)
  before = {name: open(os.path.join(workdir, name)).read()
            for name in ("run_config.json", "metrics.jsonl")}
  out = run_launch(workdir, "--config.total_steps=12", expect_rc=2)
  assert "changed cosine schedule (total_steps 6 -> 12)" in out.stderr
  out = run_launch(workdir, "--config.buffer.batch_size=512", expect_rc=2)
  assert "buffer.batch_size (B=512)" in out.stderr
  for name, text in before.items():
    assert open(os.path.join(workdir, name)).read() == text, name
