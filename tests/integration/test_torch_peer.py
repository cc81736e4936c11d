"""The PyTorch peer of `bench/bench_train_step.py` computes what jaxreplay's train step computes:
from one HF dir and one batch, the GRPO loss at the initial weights and after one and two AdamW
updates (with gradient clipping) agree, so the bench compares equal work."""

import jax
import numpy as np

from tests.helpers.deps import require
from tests.helpers.paths import bench_module


def test_peer_and_jaxreplay_take_the_same_steps(tmp_path):
  require("torch")
  require("transformers")
  bts = bench_module("bench_train_step")
  assert bts.torch_peer is not None
  from jaxreplay.models import hf_io, presets, transformer  # pylint: disable=g-import-not-at-top
  cfg = presets.tiny(num_hidden_layers=2)
  tcfg = bts.defaults.base_config().trainer
  hf_dir = str(tmp_path / "hf")
  hf_io.save_hf(cfg, transformer.init_params(cfg, jax.random.PRNGKey(1)), hf_dir)
  batch = bts.synthetic_batch(cfg, 8, 32, 8)
  lr = 1e-3  # larger than the bench's, so that a different update shows in the next loss
  settings = bts.torch_peer.PeerSettings(learning_rate=lr, b1=tcfg.b1, b2=tcfg.b2,
                                         weight_decay=tcfg.weight_decay,
                                         max_grad_norm=tcfg.max_grad_norm)
  pt = bts.torch_peer.TorchGrpoStep(hf_dir, batch, settings)
  bench_lr, bts.LEARNING_RATE = bts.LEARNING_RATE, lr
  try:
    jx = bts.JaxStep(cfg, hf_dir, batch, tcfg)
  finally:
    bts.LEARNING_RATE = bench_lr
  jx_losses, pt_losses = [], []
  for _ in range(3):
    jx_losses.append(float(jx.step()["loss"]))
    pt_losses.append(pt.step())
  assert np.min(np.abs(np.diff(jx_losses))) > 1e-3  # each update moved the loss well past rtol
  np.testing.assert_allclose(jx_losses, pt_losses, rtol=2e-4, atol=2e-6)
