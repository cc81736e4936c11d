"""The metrics row: one mu and one gamma per run, the compute axis per schedule, the log-prob probe."""
import math

import numpy as np
import pytest

from jaxreplay.run import accounting
from jaxreplay.run import metrics_row
from jaxreplay.data.buffer import ReplayBuffer
from jaxreplay.learner.batch import Rollout
from jaxreplay.config.defaults import base_config
from jaxreplay.rollout.base import Completion, Group
from jaxreplay.run.schedules import SimState


class Intake:
  def take_fresh_rewards(self):
    return np.array([1.0, 0.0], np.float32)


class Task:
  def reward_metrics(self):
    return {"reward/calls": 2}


def make(kind, **overrides):
  c = base_config()
  c.scheduler.kind = kind
  c.rollout.num_workers, c.trainer.num_devices, c.scheduler.mu = 5, 3, 5.28
  for k, v in overrides.items():
    section, key = k.split(".")
    c[section][key] = v
  acct = accounting.ComputeAccountant(5, 3)
  acct.add_generation(2.0, 100)
  acct.add_training(1.0, 400)
  sim = SimState(clock=3.0, generation_device_seconds=10.0, training_device_seconds=4.0,
                 reference_tokens=7.5)
  probe = metrics_row.MismatchProbe(lambda p, b: None, 0, (16,), 1)
  return metrics_row.RunMetrics.from_config(c, ReplayBuffer(8), acct, Task(), Intake(), sim, probe)


def test_simulated_row_reports_the_modelled_mu_and_gamma_and_the_measured_ones_apart():
  m = make("simulated")
  row = m.row(4, 4, {"loss": 0.5})
  assert row["compute/mu"] == row["sim/mu"] == 5.28
  assert row["compute/gamma"] == row["sim/gamma"] == pytest.approx(0.4246, abs=1e-4)  # Table 1
  assert row["compute/measured_mu"] == pytest.approx((2.0 / 100) / (1.0 / 400))
  assert row["compute/measured_gamma"] == pytest.approx((1 + 5 / 3) / (1 + 8.0))
  assert row["compute_seconds"] == 14.0 == m.compute_seconds()
  assert row["compute/measured_seconds"] == 3.0
  assert row["sim/reference_tokens"] == 7.5
  assert row["reward_mean"] == 0.5 and row["fresh_rollouts"] == 2.0 and row["reward/calls"] == 2.0


def test_simulated_on_policy_queue_pays_the_full_update():
  row = make("simulated", **{"buffer.on_policy": True}).row(4, 4, {})
  assert row["compute/gamma"] == row["sim/gamma"] == 1.0  # (1 + mu) C per update, whatever W/T


def test_a_held_batchs_later_updates_carry_no_sample_keys():
  """With several updates per fresh batch (`data.batch_reuse`) the buffer's last-sample keys are on
  the row of the batch's first update only (batch_reuse/index 1); without it on every row."""
  m = make("simulated")
  m.buffer.add([Rollout(prompt_tokens=np.array([1, 2], np.int32),
                        completion_tokens=np.array([3], np.int32),
                        logprobs=np.array([-0.1], np.float32), reward=float(i % 2),
                        advantage=0.0, policy_version=0, group_id=0) for i in range(4)])
  m.buffer.sample(2, current_version=1)
  for index, present in ((None, True), (1.0, True), (2.0, False)):
    metrics = {} if index is None else {"batch_reuse/index": index}
    row = m.row(1, 1, metrics)
    for key in ("buffer/batch_use_count_mean", "buffer/staleness_mean"):
      assert (key in row) == present, (index, key)
    assert "buffer/size" in row


def test_sync_gamma_is_the_cost_per_update_over_on_policy():
  m = make("sync", **{"buffer.batch_size": 60, "scheduler.rollouts_per_step": 20})
  row = m.row(1, 1, {})
  assert row["compute/gamma"] == pytest.approx((60 + 5.28 * 20) / (6.28 * 60))
  assert metrics_row.sync_gamma(60, 60, 5.28) == pytest.approx(1.0)  # N = B = R: on-policy


def test_async_row_uses_the_measured_compute():
  m = make("async")
  row = m.row(1, 1, {})
  assert not any(k.startswith("sim/") for k in row)
  assert row["compute/mu"] == row["compute/measured_mu"]
  assert row["compute_seconds"] == 3.0 == m.compute_seconds()
  assert math.isfinite(row["compute/gamma"])


def test_mismatch_probe_compares_trainer_and_sampler_logprobs():
  completions = [Completion(np.array([5, 6], np.int32), np.array([-1.0, -2.0], np.float32), "stop")]
  groups = [Group(np.array([1, 4], np.int32), completions, 0)]

  def trainer_logprobs(params, batch):
    return np.where(batch.completion_mask > 0, batch.behaviour_logprobs + params, 0.0)
  probe = metrics_row.MismatchProbe(trainer_logprobs, 0, (8,), every=2)
  assert probe.due(4) and not probe.due(3)
  probe.check_groups(0.1, groups)
  assert probe.latest["mismatch/tokens"] == 2.0
  assert probe.latest["mismatch/logprob_abs_diff"] == pytest.approx(0.1)
  assert probe.latest["mismatch/exp_abs_diff"] == pytest.approx(math.exp(0.1))
  assert probe.warnings == 0
  probe.check_groups(1.0, groups)  # exp(1) = 2.7 > 1.5: the sampler does not run these weights
  assert probe.warnings == 1


def test_counters_continue_across_a_resume():
  """reward/*, pool/* counts and time/wall_s go on from the checkpointed values after a resume;
  rates and gauges (pool/tokens_per_second, pool/live_threads) do not."""
  first = make("async")
  first.pool_metrics = lambda: {"pool/requests": 5.0, "pool/restarts": 1.0,
                                "pool/tokens_per_second": 9.0, "pool/live_threads": 2.0}
  first.mismatch.latest = {"mismatch/exp_abs_diff": 1.01}
  saved = first.counters()
  assert saved["cumulative"] == {"reward/calls": 2.0, "pool/requests": 5.0, "pool/restarts": 1.0}
  saved["wall_s"] = 100.0
  resumed = make("async")
  resumed.pool_metrics = lambda: {"pool/requests": 3.0, "pool/restarts": 0.0,
                                  "pool/tokens_per_second": 7.0, "pool/live_threads": 2.0}
  resumed.restore_counters(saved)
  row = resumed.row(5, 5, {})
  assert row["reward/calls"] == 4.0 and row["pool/requests"] == 8.0 and row["pool/restarts"] == 1.0
  assert row["pool/tokens_per_second"] == 7.0 and row["pool/live_threads"] == 2.0
  assert 100.0 <= row["time/wall_s"] < 160.0
  assert row["mismatch/exp_abs_diff"] == 1.01


def test_zero_variance_fraction():
  rewards = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0], np.float32)  # groups of 3: equal, mixed, equal
  assert metrics_row.zero_variance_fraction(rewards, 3) == pytest.approx(2 / 3)
  assert np.isnan(metrics_row.zero_variance_fraction(np.zeros(2, np.float32), 3))
