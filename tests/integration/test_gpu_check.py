"""Tests of the device check (bench/gpu_check.py): its arithmetic on hand-made metrics rows, and its
whole CPU path (--cpu_smoke: the real async pipeline with one vLLM worker, tiny shapes)."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.deps import require
from tests.helpers.paths import REPO


def load_gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench",
                                                                          "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def row(step, flops, step_s, wall, **extra):
  return {"step": step, "compute/training_flops": flops, "time/step_s": step_s,
          "time/wall_s": wall, "time/publish_s": 0.5, **extra}


def test_summary_numbers_from_rows():
  gc = load_gpu_check()
  rows = [{"step": 0, "policy_version": 0},  # the first row (no step timings): ignored
          row(1, 1e12, 9.0, 10.0, **{"mismatch/exp_abs_diff": 1.01, "mismatch/tokens": 40.0}),
          row(2, 3e12, 1.0, 12.0, **{"mismatch/exp_abs_diff": 1.01, "mismatch/tokens": 40.0}),
          row(3, 5e12, 2.0, 14.0, **{"mismatch/exp_abs_diff": 1.02, "mismatch/tokens": 30.0}),
          row(4, 7e12, 3.0, 16.0, **{"mismatch/exp_abs_diff": 1.02, "mismatch/tokens": 30.0,
                                     "pool/refreshes": 4.0, "pool/refresh_seconds": 2.0,
                                     "pool/tokens": 1000.0, "pool/generate_seconds": 4.0,
                                     "pool/tokens_per_second": 50.0, "pool/calls": 2.0,
                                     "pool/requests": 8.0})]
  out = gc.summarize(rows, peak_tflops=4.0)
  assert out["steps"] == 4
  assert out["step_s"] == 2.0              # median of steps 2..4 (step 1 compiles)
  assert out["step_tflop"] == 2.0          # median of the per-step FLOP increments
  assert math.isclose(out["mfu"], 2e12 / 2.0 / 4e12)
  assert out["step_wall_s"] == 2.0         # (16 - 10) / 3
  assert out["reload_s"] == 0.5 and out["refresh_s"] == 1.0
  assert out["vllm_tokens_per_s"] == 250.0 and out["vllm_tokens_per_wall_s"] == 50.0
  assert [m["step"] for m in out["mismatch_comparisons"]] == [1, 3]  # each new comparison once
  assert out["mismatch_exp_abs_diff"] == 1.02


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vllm", "jax"])
def test_cpu_smoke_runs_the_real_pipeline(tmp_path, backend):
  if backend == "vllm":
    require("vllm")
  gc = load_gpu_check()
  out = gc.main(["--cpu_smoke", "--out", str(tmp_path), "--steps", "4", "--backend", backend])
  saved = json.loads((tmp_path / "gpu_check.json").read_text())
  assert saved["steps"] == 4 and saved["cpu_smoke"] and saved["backend"] == "cpu"
  assert saved["rollout_backend"] == backend
  assert saved["step_s"] > 0 and 0 < saved["mfu"] < 1 and saved["peak_tflops"] > 0
  assert saved["vllm_tokens"] > 0 and saved["vllm_tokens_per_s"] > 0
  # One call takes every request the source has, up to max_num_seqs=16 sequences (2 requests of 8).
  assert saved["vllm_requests"] >= saved["vllm_calls"] >= 1
  assert saved["publish_s"] > 0
  # The first step trains on rollouts of the initial weights: the probe compares at equal weights
  # (float32 on CPU: the same numbers up to summation order).
  assert saved["mismatch_comparisons"] and saved["mismatch_comparisons"][0]["step"] == 1
  assert saved["mismatch_exp_abs_diff"] < 1.01
  if backend == "jax":  # the same forward in the same process: equal log-probs
    assert saved["mismatch_comparisons"][0]["logprob_abs_diff_max"] < 1e-4
  assert (tmp_path / "metrics.jsonl").exists()
  assert out["steps"] == saved["steps"]


def test_plan_only_fits_one_h200(tmp_path):
  """`--plan_only`: the check's config (B=64 x 640 tokens of Qwen3-0.6B shapes, bf16, remat) fits
  the trainer's 45% of one 141 GiB H200 by the memory plan; one micro-batch of 64 rows (the
  config before issue 28: 31 GiB by the plan calibrated against XLA:GPU in issue 36) does not fit
  45% of a 48 GiB card and exits 3."""
  gc = load_gpu_check()
  plan = gc.main(["--plan_only", "--out", str(tmp_path / "ok")])
  saved = json.loads((tmp_path / "ok" / "plan.json").read_text())
  assert saved["fits"] is True and plan["fits"] is True
  assert saved["model"]["params"] > 5e8 and saved["micro_batch"]["rows_per_device"] == 16
  assert saved["device_memory_bytes"] == int(141 * 0.45 * 2 ** 30)
  assert saved["per_device_bytes"]["total"] < saved["device_memory_bytes"]
  assert saved["time"]["publish_stall_s"] > 0  # the refresh stall against the step
  with pytest.raises(SystemExit) as e:
    gc.main(["--plan_only", "--out", str(tmp_path / "old"), "--num_microbatches", "1",
             "--logprob_chunk", "512", "--memory_gib", "48"])
  assert e.value.code == 3
  old = json.loads((tmp_path / "old" / "plan.json").read_text())
  assert old["fits"] is False and old["per_device_bytes"]["total"] > 48 * 0.45 * 2 ** 30
  assert old["per_device_bytes"]["total"] > 1.5 * saved["per_device_bytes"]["total"]


def _gpu_check_sh(*args, path=None):
  env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=REPO)
  if path is not None:
    env["PATH"] = path
  script = os.path.join(REPO, "launch", "gpu_check.sh")
  return subprocess.run([shutil.which("bash"), script, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)


def test_script_without_a_gpu_says_so_in_one_line(tmp_path):
  """launch/gpu_check.sh on a machine without nvidia-smi: one line naming the checks that need no
  GPU, exit 2, nothing created."""
  bare = tmp_path / "bin"  # a PATH with bash's tools and python, without nvidia-smi
  bare.mkdir()
  for tool in ("timeout", "tee", "mkdir", "dirname", "head", "python3"):
    found = shutil.which(tool)
    if found:
      (bare / tool).symlink_to(found)
  out = _gpu_check_sh(str(tmp_path / "gc"), "--steps", "3", path=str(bare))
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines() == [
      f"gpu_check: no NVIDIA GPU here (nvidia-smi not found); run it on a GPU machine, or without "
      f"one: launch/gpu_check.sh --plan_only --out {tmp_path / 'gc'} (the memory plan) or "
      "--cpu_smoke"], out.stderr
  assert not (tmp_path / "gc").exists()


@pytest.mark.parametrize("args", [["--plan_only", "--out", "{out}"], ["{out}", "--plan_only"],
                                  ["--out={out}", "--plan_only"]], ids=["flags_first", "out_first",
                                                                      "out_equals"])
def test_script_takes_its_flags_in_any_order(tmp_path, args):
  out = tmp_path / "plan"
  proc = _gpu_check_sh(*[a.format(out=out) for a in args])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads((out / "plan.json").read_text())["fits"] is True
  assert not (tmp_path / "--plan_only").exists() and not os.path.exists(
      os.path.join(REPO, "--plan_only"))
