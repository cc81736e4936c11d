"""`configs/multiturn.py` end to end (`python -m jaxreplay.launch`, shortened): the calculator task
on the JAX sampler and on vLLM (and under the async and sync schedules) writes the env/* metrics,
and a run whose environment plug-in raises or hangs at every step goes on, counting env/errors or
env/timeouts; with LoRA and with the adaptive reuse controller trajectories train, and such a run
resumed from a checkpoint ends as the uninterrupted one."""
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import tiny_runs
from tests.helpers.deps import require
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

CONFIG = os.path.join(REPO, "configs", "multiturn.py")
SHORT = ("--config.total_steps=3", "--config.eval.every=3", "--config.eval.num_problems=16",
         "--config.eval.n_samples=2", "--config.eval.ks=(1,2)", "--config.checkpoint.every=3",
         "--config.buffer.size=32", "--config.buffer.batch_size=16",
         "--config.rollout.group_size=4", "--config.rollout.num_workers=2",
         "--config.trainer.num_devices=1", "--config.log.every_s=1")
ENV_KEYS = ("env/turns_mean", "env/errors", "env/timeouts", "env/tool_calls", "env/episodes",
            "env/tool_correct", "env/budget_cuts")


def launch_process(workdir, *extra, timeout=600):
  proc = subprocess.run([sys.executable, "-m", "jaxreplay.launch", f"--config={CONFIG}",
                         f"--workdir={workdir}", *SHORT, *extra], cwd=REPO, env=tiny_runs.ENV,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def launch(workdir, *extra, timeout=600):
  launch_process(workdir, *extra, timeout=timeout)
  return tiny_runs.read_rows(workdir)


def check_env_rows(rows):
  train = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train] == [1, 2, 3]
  for row in train:
    for key in ENV_KEYS:
      assert key in row, (key, sorted(k for k in row if k.startswith("env")))
  last = train[-1]
  assert last["env/episodes"] >= 16  # a batch of B = 16 distinct trajectories was drawn
  assert math.isfinite(last["loss"]) and last["nonfinite_skipped"] == 0.0
  return last


@pytest.mark.parametrize("backend", ["jax", "vllm"])
def test_calculator_runs_on_both_backends(tmp_path, backend):
  if backend == "vllm":
    require("vllm")
  rows = launch(str(tmp_path / backend), f"--config.rollout.backend={backend}")
  last = check_env_rows(rows)
  assert last["env/errors"] == last["env/timeouts"] == 0
  # The warm start calls the calculator: the turns and calls are there.
  assert last["env/tool_calls"] > 0
  assert any(r.get("env/turns_mean", 0) > 1.0 for r in rows)
  evals = [r for r in rows if "eval/pass@1" in r]
  assert evals and "eval/env/tool_correct" in evals[-1]


@pytest.mark.parametrize("plugin,counter", [("raising_step", "env/errors"),
                                            ("hanging_step", "env/timeouts")])
def test_broken_environment_never_stops_the_run(tmp_path, plugin, counter):
  rows = launch(str(tmp_path / plugin), "--config.task.name=scratchpad",
                f"--config.task.env_fn=tests.helpers.env_plugins:{plugin}",
                "--config.task.env_step_timeout_s=0.3", "--config.eval.every=0")
  last = check_env_rows(rows)
  assert last[counter] == last["env/episodes"] > 0
  rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]  # NaN: none new
  assert rewards and set(rewards) == {0.0}


@pytest.mark.parametrize("kind,extra", [("async", ()),
                                        ("sync", ("--config.scheduler.rollouts_per_step=16",))])
def test_calculator_runs_under_the_other_schedules(tmp_path, kind, extra):
  """configs/multiturn.py is simulated; trajectories also flow through the async pool and the
  sync loop."""
  rows = launch(str(tmp_path / kind), f"--config.scheduler.kind={kind}", "--config.eval.every=0",
                *extra)
  last = check_env_rows(rows)
  assert last["env/errors"] == last["env/timeouts"] == 0 and last["env/tool_calls"] > 0


CONTROLLER_KEYS = ("controller/reuse_target", "controller/signal", "controller/guards_fired",
                   "controller/reason")
# Countdown (two turns, "=" between them, reward 1 when the second starts with the answer's first
# digit): the calculator warm start's 1-4% success gives a 3-step run no advantage to train on.
COUNTDOWN = ("--config.task.name=scratchpad",
             "--config.task.env_fn=tests.helpers.env_plugins:countdown")


@pytest.mark.parametrize("design,extra,keys", [
    ("lora", ("--config.model.lora_rank=4", "--config.trainer.learning_rate=1e-3"), ()),
    ("adaptive", ("--config.buffer.reuse_control=adaptive", "--config.log.diagnostics_every=1"),
     CONTROLLER_KEYS)])
def test_trajectories_train_with_lora_and_the_adaptive_controller_and_resume(tmp_path, design,
                                                                             extra, keys):
  """Multi-turn trajectories through LoRA (adapters trained, the base frozen) and through the
  adaptive reuse controller (a decision from the diagnostics of every batch): the run trains
  (a nonzero gradient), writes the env/* keys and the controller's, and a copy resumed from its
  step-2 checkpoint ends as the uninterrupted run, row for row."""
  workdir, resumed = str(tmp_path / design), str(tmp_path / f"{design}_resumed")
  flags = (*COUNTDOWN, "--config.eval.every=0", "--config.checkpoint.every=2", *extra)
  rows = launch(workdir, *flags)
  last = check_env_rows(rows)
  assert last["env/errors"] == last["env/timeouts"] == 0 and last["env/tool_calls"] > 0
  train = [r for r in rows if "loss" in r]
  assert any(r["env/turns_mean"] == 2.0 for r in train)
  assert any(r["grad_norm"] > 0 for r in train)
  for key in keys:
    assert all(key in r for r in train), key
  if design == "adaptive":
    assert all("batch/noise scale" in r["controller/reason"] for r in train)
  else:
    assert os.path.isdir(os.path.join(workdir, "hf_adapter"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "3"]
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "3"))
  out = launch_process(resumed, *flags)
  assert "resumed at step 2" in out.stderr
  assert ([tiny_runs.comparable(r) for r in tiny_runs.read_rows(resumed)] ==
          [tiny_runs.comparable(r) for r in rows])
