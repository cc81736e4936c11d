"""Whole tiny runs of the issue-37 designs: multi-epoch PPO-style reuse (trainer.ppo_epochs /
ppo_minibatches) and its compute on the simulated clock, Dynamic Gradient Gating
(buffer.reuse_control="gradient_gate"), and the regime diagnostics charged to the design that reads
them (log.charge_diagnostics)."""
import math
import os
import shutil

import pytest

from tests.helpers import tiny_runs

pytestmark = pytest.mark.slow  # whole runs

ON_POLICY = ("--config.buffer.on_policy=True", "--config.checkpoint.keep=5")
B, TRAIN_SECONDS = 32, 1.0  # tiny_runs.SHORT's batch; defaults.py's scheduler.train_seconds_per_step


def train_rows(workdir):
  return [r for r in tiny_runs.read_rows(workdir) if r["step"] > 0]


def resume_from(workdir, step, tmp_path, *args):
  """A copy of the finished run `workdir` cut back to its checkpoint `step` (the later ones
  deleted), rerun with the same command: it resumes there and must end with the same rows."""
  copy = str(tmp_path / f"resumed_from_{step}")
  shutil.copytree(workdir, copy)
  ckpts = os.path.join(copy, "checkpoints")
  assert str(step) in os.listdir(ckpts)
  for name in os.listdir(ckpts):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(ckpts, name))
  out = tiny_runs.run_launch(copy, *args)
  assert f"resumed at step {step}" in out.stderr
  want = [tiny_runs.comparable(r) for r in tiny_runs.read_rows(workdir)]
  assert [tiny_runs.comparable(r) for r in tiny_runs.read_rows(copy)] == want


def test_ppo_epochs_updates_minibatches_and_compute(tmp_path):
  """k = 2 epochs of m = 2 minibatches: 4 updates per fresh batch of 16 rollouts each, the batch's
  end logged every 4th step; each update costs half a train step on the simulated clock, so after
  6 updates training is 6 * 1.0 / 2 = 3.0 device-seconds; gamma is the measured compute per update
  over (1 + mu) train steps."""
  workdir = str(tmp_path / "ppo")
  args = ON_POLICY + ("--config.trainer.ppo_epochs=2", "--config.trainer.ppo_minibatches=2")
  tiny_runs.run_launch(workdir, *args)
  rows = train_rows(workdir)
  assert [r["batch_reuse/index"] for r in rows] == [1, 2, 3, 4, 1, 2]
  assert [r["batch_reuse/epoch"] for r in rows] == [0, 0, 1, 1, 0, 0]
  assert rows[3]["batch_reuse/updates"] == 4 and rows[3]["batch_reuse/epochs"] == 2
  assert "batch_reuse/updates" not in rows[4]
  # the buffer's sample keys on a batch's first update only (the later ones sample nothing)
  assert [("buffer/staleness_mean" in r) for r in rows] == [True, False, False, False, True, False]
  for i, r in enumerate(rows, start=1):
    assert r["sim/training_device_seconds"] == pytest.approx(i * TRAIN_SECONDS / 2)
    want = (r["sim/generation_device_seconds"] + r["sim/training_device_seconds"]) / (
        (1 + r["sim/mu"]) * TRAIN_SECONDS * i)
    assert r["sim/gamma"] == pytest.approx(want)
  # the on-policy queue gave one fresh batch per 4 updates: 2 batches of B
  assert rows[-1]["buffer/consumed"] == 2 * B
  resume_from(workdir, 2, tmp_path, *args)  # mid-batch: the held batch and its epoch order resume


def test_gradient_gate_run(tmp_path):
  """The gate over the on-policy queue: up to 4 updates per batch, every update logs its LM-head
  gradient energy and bound; a fired update ends its batch (the next update is a fresh batch's
  first) and applies nothing; with a window of 2 increments the gate is armed from the second
  batch on; every update is charged a full train step."""
  workdir = str(tmp_path / "gate")
  args = ON_POLICY + ("--config.buffer.reuse_control=gradient_gate",
                      "--config.buffer.gate_window=2", "--config.total_steps=10")
  tiny_runs.run_launch(workdir, *args)
  rows = train_rows(workdir)
  assert len(rows) == 10
  index = [r["batch_reuse/index"] for r in rows]
  assert index[:4] == [1, 2, 3, 4]  # the window fills during the first batch: nothing fires
  for prev, r in zip(rows, rows[1:]):
    want_first = prev["gate/fired"] == 1 or prev["batch_reuse/index"] == 4
    assert (r["batch_reuse/index"] == 1) == want_first
  for r in rows:
    assert math.isfinite(r["gate/lm_head_grad_energy"]) and r["gate/fired"] in (0.0, 1.0)
    if r["gate/fired"]:
      assert r["gate/lm_head_grad_energy"] > r["gate/bound"] and r["gate/zscore"] > 0.5
      assert r["batch_reuse/updates"] == r["batch_reuse/index"] - 1
  assert rows[-1]["sim/training_device_seconds"] == pytest.approx(10 * TRAIN_SECONDS)
  resume_from(workdir, 6, tmp_path, *args)  # the gate's window and the held batch resume


def test_charged_diagnostics_add_their_passes_to_compute(tmp_path):
  """The adaptive controller reads the regime diagnostics, so by default (charge "auto") it pays
  for them: the same run charged and uncharged has the same rows except compute_seconds, which
  differs by (B + 2 P) / B * train_seconds_per_step per measurement (P = 8 probe rollouts), counted
  in compute/diagnostics_device_seconds; sim/* are the same (the charge is not on the clock)."""
  args = ("--config.buffer.reuse_control=adaptive", "--config.log.diagnostics_every=2")
  runs = {}
  for mode in ("auto", "off"):
    workdir = str(tmp_path / mode)
    tiny_runs.run_launch(workdir, *args, f"--config.log.charge_diagnostics={mode}")
    runs[mode] = train_rows(workdir)
  charged, free = runs["auto"], runs["off"]
  assert [tiny_runs.comparable(r) for r in charged] == [tiny_runs.comparable(r) for r in free]
  per = (B + 2 * 8) / B * TRAIN_SECONDS
  measured = 0
  for c, f in zip(charged, free):
    measured += "diag/noise_scale" in c
    assert c["compute/diagnostics_device_seconds"] == pytest.approx(measured * per)
    assert c["compute_seconds"] == pytest.approx(f["compute_seconds"] + measured * per)
    assert c["compute_seconds"] == pytest.approx(c["sim/compute_seconds"] + measured * per)
    assert "compute/diagnostics_device_seconds" not in f
  assert measured == 3  # steps 0, 2, 4 of 6 measured
