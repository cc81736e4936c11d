"""Tests of compute accounting (`run.accounting`): gamma, measured mu, cumulative seconds and model
FLOPs (Theorem 4.5's design: tests/science/test_design.py)."""
import math
import threading

import pytest

from jaxreplay.run import accounting
from jaxreplay.models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def test_gamma_paper_example():
  # PAPER.md: mu = 5.28 (Qwen2.5-7B), (W, T) = (5, 3) -> gamma = 0.43, i.e. 57% cheaper per update.
  g = accounting.gamma(5, 3, 5.28)
  assert g == pytest.approx((1 + 5 / 3) / 6.28)
  assert g == pytest.approx(0.4246, abs=1e-4)
  assert g == pytest.approx(0.43, abs=0.01)  # the paper's rounded figure (0.4246 exactly)
  assert accounting.gamma(4, 4, 1.0) == 1.0  # W/T = mu: no saving
  with pytest.raises(ValueError, match="num_trainer_devices"):
    accounting.gamma(1, 0, 1.0)


def test_measured_mu_seconds_and_flops():
  acct = accounting.ComputeAccountant(num_workers=5, num_trainer_devices=3, model_cfg=CFG, seq_len=32)
  m0 = acct.metrics()
  assert math.isnan(m0["compute/measured_mu"]) and math.isnan(m0["compute/measured_gamma"])
  assert m0["compute_seconds"] == 0.0 and m0["compute/w_over_t"] == pytest.approx(5 / 3)
  # Generation: 12 device-s for 6000 tokens (2 ms/token); training: 2 updates, 1.5 device-s for
  # 4000 tokens (0.375 ms/token) -> mu = 2 / 0.375.
  acct.add_generation(8.0, 4000)
  acct.add_generation(4.0, 2000)
  acct.add_training(0.5, 2000)
  acct.add_training(1.0, 2000, seq_len=64)
  m = acct.metrics()
  mu = (12.0 / 6000) / (1.5 / 4000)
  assert m["compute/measured_mu"] == pytest.approx(mu)
  assert m["compute/measured_gamma"] == pytest.approx((1 + 5 / 3) / (1 + mu))
  assert m["compute_seconds"] == pytest.approx(13.5)
  assert m["compute/generation_seconds"] == 12.0 and m["compute/training_seconds"] == 1.5
  assert m["compute/updates"] == 2 and m["compute/training_seconds_per_update"] == 0.75
  gen_flops = CFG.flops_per_token(32) * 6000
  train_flops = 3 * (CFG.flops_per_token(32) * 2000 + CFG.flops_per_token(64) * 2000)
  assert m["compute/generation_flops"] == pytest.approx(gen_flops)
  assert m["compute/training_flops"] == pytest.approx(train_flops)
  assert m["compute/flops"] == pytest.approx(gen_flops + train_flops)
  # Forward FLOPs/token ~ 2 x non-embedding params + the lm_head matmul + attention.
  assert CFG.flops_per_token(0) == pytest.approx(2 * (CFG.num_params() - 64 * 16 - 2 * 2 * 16 - 16
                                                      - 2 * 2 * 8) + 2 * 16 * 64)


def test_accountant_threads_state_and_errors():
  acct = accounting.ComputeAccountant(num_workers=2, num_trainer_devices=1)
  threads = [threading.Thread(target=lambda: [acct.add_generation(0.001, 1) for _ in range(500)])
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  acct.add_training(0.5, 100)
  m = acct.metrics()
  assert m["compute/generation_tokens"] == 2000
  assert m["compute/generation_seconds"] == pytest.approx(2.0)
  assert m["compute/flops"] == 0.0  # no model config: FLOPs are not counted
  resumed = accounting.ComputeAccountant(num_workers=2, num_trainer_devices=1)
  resumed.load_state_dict(acct.state_dict())
  assert resumed.metrics() == m
  with pytest.raises(ValueError, match="lacks"):
    resumed.load_state_dict({"updates": 1})
  with pytest.raises(ValueError, match="negative"):
    acct.add_training(-1.0, 10)
  with pytest.raises(ValueError, match="num_trainer_devices > 0"):
    accounting.ComputeAccountant(1, 0)


def test_charged_diagnostics_price_and_measured_seconds():
  """Virtual price of the regime diagnostics' passes (B rollouts forward + backward, 2 P probe
  forwards) like a train step's share: (512 + 16) / 512 * 16 = 16.5 device-seconds; measured
  charges go into compute_seconds and compute/diagnostics_device_seconds; an older checkpoint
  without the counter loads with none charged."""
  assert accounting.diagnostics_device_seconds(512 + 2 * 8, 512, 16.0) == pytest.approx(16.5)
  assert accounting.diagnostics_device_seconds(0, 512, 16.0) == 0.0
  with pytest.raises(ValueError):
    accounting.diagnostics_device_seconds(-1, 512, 16.0)
  acct = accounting.ComputeAccountant(num_workers=2, num_trainer_devices=1)
  acct.add_generation(3.0, 10)
  acct.add_training(1.0, 10)
  assert "compute/diagnostics_device_seconds" not in acct.metrics()
  assert acct.metrics()["compute_seconds"] == 4.0
  acct.add_diagnostics(0.75)
  m = acct.metrics()
  assert m["compute_seconds"] == 4.75 and m["compute/diagnostics_device_seconds"] == 0.75
  old = {k: v for k, v in acct.state_dict().items() if k != "diagnostics_seconds"}
  resumed = accounting.ComputeAccountant(num_workers=2, num_trainer_devices=1)
  resumed.load_state_dict(old)
  assert resumed.metrics()["compute_seconds"] == 4.0
  with pytest.raises(ValueError, match="negative"):
    acct.add_diagnostics(-1.0)


# Theorem 4.5 (PAPER.md, "Theory (Section 4, Appendix 9)"): the optimal synchronous design.
