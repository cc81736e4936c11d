"""Regime diagnostics, host side (`run.regime`): the smoothed noise scale, the micro-batch splits,
the diag/* keys of a step and their host state (the device side: learner/test_diagnostics.py); on
multi-turn trajectories they, and the adaptive reuse controller's decision from them, read only
the policy's tokens."""
import jax
import numpy as np
import pytest

from jaxreplay.data import collate as collate_lib
from jaxreplay.data import reuse
from jaxreplay.learner import corrections
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner.batch import Rollout
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.run import regime
from tests.helpers import trajectories
from tests.helpers.train_batches import CFG, one_device_setup, with_behaviour


@pytest.fixture(scope="module")
def setup():
  return one_device_setup()


def test_noise_scale_is_a_bias_corrected_ratio_of_moving_averages():
  ns = regime.NoiseScale(decay=0.5)
  assert np.isnan(ns.value)
  assert ns.update(2.0, 10.0) == pytest.approx(5.0)   # one measurement: its own ratio
  ns.update(4.0, 4.0)
  # EMAs 0.5*(0.5*2)+0.5*4 = 2.5 and 0.5*5+2 = 4.5, both / (1 - 0.25): ratio 1.8
  assert ns.value == pytest.approx(4.5 / 2.5)
  state = ns.state_dict()
  other = regime.NoiseScale(decay=0.5)
  other.load_state_dict(state)
  assert other.value == ns.value
  neg = regime.NoiseScale()
  neg.update(-1.0, 3.0)
  assert np.isnan(neg.value)  # no signal measured yet: undefined, never negative
  before = ns.value
  assert ns.update(float("nan"), 1.0) == before and ns.count == 2  # left out, nothing poisoned
  with pytest.raises(ValueError, match="decay"):
    regime.NoiseScale(decay=1.0)


def test_who_pays_for_the_diagnostics():
  """log.charge_diagnostics: "auto" charges the designs that read them (the adaptive controller)
  and no other; "on" / "off" force it."""
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  c = defaults.base_config()
  assert not regime.charges_diagnostics(c)
  for control, charged in (("adaptive", True), ("fixed", False), ("gradient_gate", False)):
    c.buffer.reuse_control = control
    assert regime.charges_diagnostics(c) == charged, control
  c.log.charge_diagnostics = "off"
  assert not regime.charges_diagnostics(c)
  c.buffer.reuse_control, c.log.charge_diagnostics = "off", "on"
  assert regime.charges_diagnostics(c)


def test_splits_for():
  assert regime.splits_for(64, 1) == 4 and regime.splits_for(6, 1) == 3
  assert regime.splits_for(8, 2) == 4 and regime.splits_for(6, 2) == 3 and regime.splits_for(2, 2) == 0


def test_regime_diagnostics_measure_and_restore(setup):
  """before/after an update: the diag/* keys, the update KL > 0 after a real update and 0 without
  one; the host state restores the moving averages and the probe."""
  mesh, params, shardings, batch = setup
  rollouts = [Rollout(np.array([1, 2, 3]), np.array([4, 5]), np.array([-1.0, -2.0]), 1.0, 0.5, 0, 0)
              for _ in range(3)]
  make = lambda: regime.RegimeDiagnostics(
      CFG, loss_fn_lib.make_loss_fn(), mesh, shardings, every=2, splits=4, probe_rollouts=2,
      chunk_size=16, collate=lambda rs: collate_lib.collate(rs, buckets=(8,)))
  diag = make()
  assert diag.due(0) and not diag.due(1)
  out = diag.before_update(params, None, batch, rollouts)
  assert {"diag/noise_scale", "diag/batch_over_noise_scale", "diag/behaviour_kl_k3",
          "diag/ratio_outside_clip", "diag/is_ess"} <= set(out)
  moved = jax.tree.map(lambda x: x * 1.01, params)
  kl = diag.after_update(moved)["diag/update_kl"]
  assert kl > 0
  diag.before_update(params, None, batch, rollouts)
  assert diag.after_update(params)["diag/update_kl"] == pytest.approx(0.0, abs=1e-7)
  restored = make()
  restored.load_state_dict(diag.state_dict())
  assert restored.noise.value == diag.noise.value and len(restored.probe) == 2
  np.testing.assert_array_equal(restored.probe[0].completion_tokens, rollouts[0].completion_tokens)


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_reuse_controller_reads_only_the_policys_tokens(setup, pack):
  """buffer.reuse_control="adaptive" on a batch mixing single- and multi-turn rows (issue 38):
  every statistic the controller reads (the noise scale's gradient norms, the behaviour KL, the
  ratios, the IS ESS, the update KL on a probe of the same trajectories) and its decision are
  bit-identical when the environment's target tokens and their behaviour log-probs (meaningless at
  mask-0 positions) change; with the mask dropped (every completion token the policy's) the same
  change moves them."""
  mesh, params, shardings, _ = setup
  rollouts = trajectories.mixed_rollouts(seed=5, vocab=CFG.vocab_size, n=8)
  kw = dict(buckets=(64,), pack=pack, batch_size=8)
  env = trajectories.env_positions(rollouts, **kw)
  updated = jax.tree.map(lambda x: x * 1.01, params)  # the policy after "an update"
  loss_fn = loss_fn_lib.make_loss_fn("grpo", kl_coef=0.05,
                                 off_policy=corrections.OffPolicyOptions(off_policy="tis"))

  def batch_of(rs):
    batch = collate_lib.collate(rs, **kw)
    lp = logprobs_lib.token_logprobs(CFG, params, batch.tokens, batch.targets, batch.positions,
                                     batch.segment_ids, single_sequence_rows=not batch.packed)
    return with_behaviour(batch, np.asarray(lp), seed=6)

  def measure(rs, move):
    """The diag/* keys of one measured update and the controller's decision from them."""
    change = ((lambda b: trajectories.moved_env_targets(b, env, CFG.vocab_size)) if move
              else (lambda b: b))
    diag = regime.RegimeDiagnostics(CFG, loss_fn, mesh, shardings, every=1, splits=4,
                                    probe_rollouts=8, chunk_size=16,
                                    collate=lambda probe: change(batch_of(probe)))
    out = diag.before_update(params, params, change(batch_of(rs)), rs)
    out.update(diag.after_update(updated))
    controller = reuse.ReuseController(
        reuse.ReuseSettings(control="adaptive", target=2.0, reuse_min=1.0, reuse_max=4.0,
                            kl_max=0.02, ess_min=0.8, update_kl_max=1.0), 8, 8)
    return out, controller.decide(out, step=0)

  out, decision = measure(rollouts, move=False)
  out2, decision2 = measure(rollouts, move=True)
  assert "diag/update_kl" in out and out["diag/update_kl"] > 0
  # A signal, not the NaN fallback, unpacked. Packed, the 3 rows (3 micro-batches of 3, 4 and 1
  # rollouts) measure |G|^2 < 0: here an honest draw, the advantages' random signs make the true
  # |G|^2 ~ 0 (the estimator for unequal micro-batches: 5 of mixed_rollouts' seeds 0-7 < 0 packed,
  # 1 unpacked; the equal-size one had 8 and 2).
  if not pack:
    assert np.isfinite(out["diag/batch_over_noise_scale"])
  assert set(out2) == set(out)
  for key in out:
    np.testing.assert_array_equal(out2[key], out[key], err_msg=key)
  np.testing.assert_equal(decision2, decision)  # NaN == NaN: the same signal, the same rho
  assert "batch/noise scale" in decision["controller/reason"]
  # Control: the mask dropped, the same change moves what the controller reads.
  full = trajectories.without_masks(rollouts)
  moved, _ = measure(full, move=True)
  still, _ = measure(full, move=False)
  for key in ("diag/behaviour_kl_k3", "diag/grad_sq", "diag/is_ess"):
    assert moved[key] != still[key], key
  assert still["diag/update_kl"] != out["diag/update_kl"]  # the environment's positions counted
