"""Several updates per fresh batch (`data.batch_reuse`): the gradient gate's rule on a hand-computed
energy sequence, ppo_epochs' updates and minibatch contents, checkpoints, the config checks."""
import math

import numpy as np
import pytest

from jaxreplay.config import defaults
from jaxreplay.config import validation
from jaxreplay.data import batch_reuse
from jaxreplay.learner.batch import Rollout


def rollouts(n, first=0):
  return [Rollout(prompt_tokens=np.array([1, 2], np.int32),
                  completion_tokens=np.array([3, i + 4], np.int32),
                  logprobs=np.array([-0.1, -0.2 * i], np.float32), reward=float(i % 2),
                  advantage=0.5 - i % 2, policy_version=first, group_id=i // 4, uid=first + i)
          for i in range(n)]


def device_rule(energy, bound):
  """What the train step decides (`learner.trainer`, gate_leaf): intercepted when above."""
  return {"gate/lm_head_grad_energy": energy, "gate/fired": float(energy > bound)}


def gated_updates(plan, energies):
  """Runs `energies` through the plan as the trainer would; returns each update's row keys."""
  out = []
  for e in energies:
    if plan.wants_fresh():
      plan.begin(rollouts(plan.batch_size, first=100 * plan.batches))
    assert len(plan.next_rollouts()) == plan.batch_size
    bound = plan.bound()
    out.append((bound, plan.record(device_rule(e, bound), step=len(out))))
  return out


def test_gradient_gate_on_a_hand_computed_sequence():
  """K = 4, tau = 0.5, a window of W = 3 increments.

  Batch 1: energies 1.0, 1.2, 1.1, 1.4 -> increments 0.2, -0.1, 0.3 fill the window; never gated
  (not armed before its third increment), 4 updates (K).
  Batch 2: update 1 (2.0) is never gated. Update 2: window [0.2, -0.1, 0.3], mean 0.13333, std
  sqrt(((0.06667)^2 + (0.23333)^2 + (0.16667)^2) / 3) = sqrt(0.086667 / 3) = 0.169967; bound =
  2.0 + 0.13333 + 0.5 * 0.169967 = 2.218317; energy 2.2 (increment 0.2, z = (0.2 - 0.13333) /
  0.169967 = 0.39223) is kept. Update 3: window [-0.1, 0.3, 0.2], same mean and std; bound =
  2.2 + 0.13333 + 0.084984 = 2.418317; energy 2.5 (increment 0.3, z = 0.98058 > 0.5) fires: the
  batch ends with 2 applied updates. Batch 3 starts on the next update (never gated), whose
  successor has the window [0.3, 0.2, 0.3] (mean 0.26667, std 0.047140): bound = 3.0 + 0.26667 +
  0.02357 = 3.29024; energy 3.25 is kept (z = (0.25 - 0.26667) / 0.04714 = -0.35355).
  """
  plan = batch_reuse.BatchReuse(4, gate=batch_reuse.GateSettings(max_reuse=4, threshold=0.5,
                                                                 window=3))
  got = gated_updates(plan, [1.0, 1.2, 1.1, 1.4, 2.0, 2.2, 2.5, 3.0, 3.25])
  bounds = [b for b, _ in got]
  assert bounds[:5] == [math.inf] * 5 and bounds[7] == math.inf
  np.testing.assert_allclose(bounds[5], 2.218317, atol=1e-6)
  np.testing.assert_allclose(bounds[6], 2.418317, atol=1e-6)
  np.testing.assert_allclose(bounds[8], 3.29024, atol=1e-5)
  rows = [row for _, row in got]
  assert [r["batch_reuse/index"] for r in rows] == [1, 2, 3, 4, 1, 2, 3, 1, 2]
  assert rows[3]["batch_reuse/updates"] == 4 and rows[3]["batch_reuse/epochs"] == 4
  assert "gate/zscore" not in rows[1] and "gate/zscore" not in rows[4]
  np.testing.assert_allclose(rows[5]["gate/zscore"], 0.39223, atol=1e-5)
  np.testing.assert_allclose(rows[6]["gate/zscore"], 0.98058, atol=1e-5)
  assert rows[6]["batch_reuse/updates"] == 2  # the fired update is not applied
  np.testing.assert_allclose(rows[8]["gate/zscore"], -0.35355, atol=1e-5)
  assert "batch_reuse/updates" not in rows[8] and plan.batches == 3 and not plan.wants_fresh()
  # Uses per rollout so far: batch 1's 4 updates, batch 2's 2 applied (the fired one is not), the
  # 2 of batch 3: 4 / 1, ..., 6 / 2 after the gate, 8 / 3 at the end.
  ratios = [r["batch_reuse/replay_ratio"] for r in rows]
  np.testing.assert_allclose(ratios, [1, 2, 3, 4, 5 / 2, 6 / 2, 6 / 2, 7 / 3, 8 / 3])


def test_gate_pure_functions():
  w = [0.2, -0.1, 0.3]
  assert batch_reuse.gate_bound(2.0, w, 0.5) == pytest.approx(2.218317, abs=1e-6)
  assert batch_reuse.zscore(0.3, [0.2, -0.1, 0.2]) == pytest.approx(0.2 / 0.141421356, rel=1e-6)
  assert batch_reuse.zscore(0.5, [0.1, 0.1]) == math.inf   # std 0: any rise above the mean fires
  assert batch_reuse.zscore(0.1, [0.1, 0.1]) == 0.0
  assert batch_reuse.gate_bound(1.0, [0.1, 0.1], 0.5) == pytest.approx(1.1)


def test_ppo_epochs_updates_and_minibatch_contents():
  """k = 2 epochs of m = 2 minibatches over B = 8: 4 updates of 4 rollouts; epoch e of batch b
  takes default_rng([seed, b, e]).permutation(8) cut in two (seed 3: epoch 0 [6, 7, 2, 1 | 4, 5,
  3, 0], epoch 1 [4, 3, 1, 6 | 0, 2, 5, 7]); each epoch covers the batch once; the batch ends
  after 4 updates (batch_reuse/updates 4, epochs 2) and the next one is fresh."""
  plan = batch_reuse.BatchReuse(8, epochs=2, minibatches=2, seed=3)
  assert plan.active and plan.max_updates == 4 and plan.share == 0.5 and plan.bound() == math.inf
  batch = rollouts(8)
  plan.begin(batch)
  taken, rows = [], []
  for step in range(4):
    assert not plan.wants_fresh() or step == 0
    taken.append([r.uid for r in plan.next_rollouts()])
    rows.append(plan.record({}, step))
  assert taken == [[6, 7, 2, 1], [4, 5, 3, 0], [4, 3, 1, 6], [0, 2, 5, 7]]
  assert sorted(taken[0] + taken[1]) == sorted(taken[2] + taken[3]) == list(range(8))
  assert [r["batch_reuse/epoch"] for r in rows] == [0, 0, 1, 1]
  assert [r["batch_reuse/index"] for r in rows] == [1, 2, 3, 4]
  assert rows[3]["batch_reuse/updates"] == 4 and rows[3]["batch_reuse/epochs"] == 2
  assert all("batch_reuse/updates" not in r for r in rows[:3])
  # Each update trains on B / m = 4 of the 8: 0.5, 1, 1.5, 2 uses per rollout (k = 2 epochs).
  assert [r["batch_reuse/replay_ratio"] for r in rows] == [0.5, 1.0, 1.5, 2.0]
  assert plan.wants_fresh()
  plan.begin(rollouts(8, first=100))  # batch 1: its own permutations
  assert [r.uid - 100 for r in plan.next_rollouts()] == [2, 1, 4, 0]
  assert not batch_reuse.BatchReuse(8).active  # k = m = 1: one update per batch, not used


def test_checkpoint_round_trip_mid_batch():
  """A resumed plan continues inside its held batch: same next minibatches, same gate window."""
  for make in (lambda: batch_reuse.BatchReuse(8, epochs=2, minibatches=2, seed=5),
               lambda: batch_reuse.BatchReuse(8, gate=batch_reuse.GateSettings(window=2))):
    a = make()
    a.begin(rollouts(8))
    for step in range(2):
      a.next_rollouts()
      a.record(device_rule(1.0 + step, a.bound()) if a.gate else {}, step)
    b = make()
    b.load_state_dict(a.state_dict())
    assert (b.index, b.batches, b.applied, b.total_applied) == (
        a.index, a.batches, a.applied, a.total_applied)
    assert [r.uid for r in b.next_rollouts()] == [r.uid for r in a.next_rollouts()]
    np.testing.assert_array_equal(b.next_rollouts()[0].completion_tokens,
                                  a.next_rollouts()[0].completion_tokens)
    assert b.bound() == a.bound()
    if a.gate:
      assert list(b.gate.window) == list(a.gate.window) and b.gate.previous == a.gate.previous


def test_a_checkpoint_without_the_run_total_leaves_the_ratio_out():
  plan = batch_reuse.BatchReuse(8, epochs=2, minibatches=2, seed=5)
  plan.begin(rollouts(8))
  plan.next_rollouts()
  state = plan.state_dict()
  del state["total_applied"]  # as written before the key existed
  old = batch_reuse.BatchReuse(8, epochs=2, minibatches=2, seed=5)
  old.load_state_dict(state)
  old.next_rollouts()
  row = old.record({}, 1)
  assert "batch_reuse/replay_ratio" not in row and row["batch_reuse/index"] == 1


def test_config_checks():
  c = defaults.base_config()
  c.trainer.ppo_epochs = 2
  with pytest.raises(ValueError, match="on-policy queue: set buffer.on_policy=True"):
    validation.validate_config(c)
  c.buffer.on_policy = True
  c.buffer.batch_size, c.buffer.size = 60, 120
  c.trainer.ppo_minibatches = 7
  with pytest.raises(ValueError, match="ppo_minibatches=7 must divide"):
    validation.validate_config(c)
  c.trainer.ppo_minibatches = 2
  validation.validate_config(c)
  c.buffer.reuse_control = "gradient_gate"
  with pytest.raises(ValueError, match="leave trainer.ppo_epochs"):
    validation.validate_config(c)
  c.trainer.ppo_epochs, c.trainer.ppo_minibatches = 1, 1
  validation.validate_config(c)
  c.buffer.gate_max_reuse = 1
  with pytest.raises(ValueError, match="gate_max_reuse=1"):
    validation.validate_config(c)
  c.buffer.gate_max_reuse, c.scheduler.kind = 4, "sync"
  with pytest.raises(ValueError, match="sync schedule"):
    validation.validate_config(c)
  c.scheduler.kind, c.buffer.on_policy = "simulated", False
  with pytest.raises(ValueError, match="gradient_gate' reuses each fresh batch"):
    validation.validate_config(c)
