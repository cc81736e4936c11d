"""The gradient-noise probe (`science.noise_probe`): its helpers, and `bench/probe_sigma.py --quick`
end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxreplay.science import noise_probe
from tests.helpers.paths import REPO


def test_layout_order():
  groups = noise_probe.layout_order(4, 3, "groups")
  np.testing.assert_array_equal(groups, np.arange(12))
  spread = noise_probe.layout_order(4, 3, "spread")
  assert sorted(spread) == list(range(12))
  for start in range(0, 12, 4):  # a minibatch of B = 4 <= P = 4 rollouts: 4 different prompts
    assert len({int(r) // 3 for r in spread[start:start + 4]}) == 4
  with pytest.raises(ValueError):
    noise_probe.layout_order(4, 3, "other")


def test_resolve_minibatch():
  assert noise_probe.resolve_minibatch(0, 64, 8) == 64
  assert noise_probe.resolve_minibatch(-2, 64, 8) == 16
  assert noise_probe.resolve_minibatch(20, 64, 8) == 16
  assert noise_probe.resolve_minibatch(3, 64, 8) == 8


@pytest.mark.slow
def test_quick_probe_end_to_end(tmp_path):
  cmd = [sys.executable, os.path.join(REPO, "bench", "probe_sigma.py"),
         f"--config={REPO}/configs/tiny.py", f"--out={tmp_path}", "--quick"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device: the probe's
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "probe_sigma.json") as f:
    result = json.load(f)
  assert (tmp_path / "probe_sigma.png").stat().st_size > 0
  for key in ("config", "settings", "units", "training", "grad_check", "rows", "fit", "fit_spread",
              "fit_shifted", "monotone", "design", "design_spread", "wall_seconds"):
    assert key in result, key
  assert result["settings"]["staleness"] == [0, 1, 2, 4]
  assert result["grad_check"]["rel_diff"] < 1e-4  # the probe's loss is the train step's
  for row in result["rows"]:
    for key in ("staleness", "sigma2", "sigma2_ci", "var_minibatch", "bias", "bias_ci",
                "sigma2_ratio_to_s0", "sigma2_spread", "reward_mean"):
      assert key in row, key
    assert row["sigma2"] > 0
  assert result["rows"][0]["bias"] == 0.0
  for key in ("alpha", "tau", "r2", "alpha_ci"):
    assert key in result["fit"]
  assert {d["rho"] for d in result["design"]} == {0.1, 1.0}
  for d in result["design"]:
    assert {"power_law", "measured_max", "measured_mean"} <= set(d)
