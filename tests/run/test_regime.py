"""Regime diagnostics, host side (`run.regime`): the smoothed noise scale, the micro-batch splits,
the diag/* keys of a step and their host state (the device side: learner/test_diagnostics.py)."""
import jax
import numpy as np
import pytest

from jaxreplay.data import collate as collate_lib
from jaxreplay.learner import trainer
from jaxreplay.learner.batch import Rollout
from jaxreplay.run import regime
from tests.helpers.train_batches import CFG, one_device_setup


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
      CFG, trainer.make_loss_fn(), mesh, shardings, every=2, splits=4, probe_rollouts=2,
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
