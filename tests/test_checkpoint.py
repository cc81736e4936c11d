"""Checkpointer: async atomic save of (state, host state), keep-last-K, resume, restore on a new mesh."""
import os

import chex
import jax
import numpy as np
import pytest

from jaxreplay import batch as batch_lib
from jaxreplay import checkpoint
from jaxreplay import optim
from jaxreplay import sharding
from jaxreplay import trainer
from jaxreplay.models import presets

CFG = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
B, T = 8, 32


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  mask[:, 8:] = 1.0
  return batch_lib.Batch(
      tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
      segment_ids=np.ones((B, T), np.int32), targets=np.roll(tokens, -1, axis=1),
      completion_mask=mask, behaviour_logprobs=np.where(mask > 0, -4.1, 0.0).astype(np.float32),
      advantages=rng.normal(size=B).astype(np.float32), rewards=np.zeros(B, np.float32),
      policy_version=np.zeros(B, np.int32))


def _host(x):
  return jax.tree.map(np.asarray, x)


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh((1, 4, 2))
  opt = optim.make_optimizer(1e-3, warmup_steps=2, weight_decay=0.01)
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(0), mesh=mesh)
  shardings = trainer.state_shardings(state, mesh)
  step = trainer.make_train_step(CFG, opt, trainer.make_loss_fn("grpo"), mesh, shardings,
                                 chunk_size=16, compute_entropy=False)
  return mesh, opt, state, shardings, step


def test_host_state_round_trip():
  host = {"buffer": {"tokens": [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64)],
                     "rewards": np.array([0.5, 1.0], np.float32), "empty": [], "meta": {}},
          "cursor": 17, "name": "run", "ratio": 0.25, "flag": True, "none": None,
          "seed_state": (np.uint64(12345), np.array([[1, 2], [3, 4]], np.uint32)),
          "raw": b"\x00\x01", "np_int": np.int64(-3), "bf": np.array([1.5], np.float16)}
  back = checkpoint.decode_host_state(checkpoint.encode_host_state(host))
  assert back["cursor"] == 17 and back["name"] == "run" and back["flag"] is True
  assert back["none"] is None and back["raw"] == b"\x00\x01" and back["buffer"]["empty"] == []
  assert isinstance(back["seed_state"], tuple) and back["seed_state"][0] == np.uint64(12345)
  assert back["seed_state"][0].dtype == np.uint64 and back["np_int"].dtype == np.int64
  for got, want in zip(back["buffer"]["tokens"], host["buffer"]["tokens"]):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(back["seed_state"][1], host["seed_state"][1])
  assert back["bf"].dtype == np.float16


@pytest.mark.parametrize("bad,match", [({1: 2}, "keys must be str"), ({"x": object()}, "cannot hold"),
                                       ({"__tuple__": 1}, "reserved"),
                                       ({"x": np.array([None])}, "object arrays")])
def test_host_state_rejects_unsupported(bad, match):
  with pytest.raises(ValueError, match=match):
    checkpoint.encode_host_state(bad)


def test_save_restore_continue_is_exact(setup, tmp_path):
  mesh, opt, state, shardings, step = setup
  batch = _batch()
  state = jax.tree.map(lambda x: x.copy(), state)  # the module fixture's state must not be donated
  state, _ = step(state, batch)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  host = {"cursor": np.int64(3), "buffer": {"x": np.arange(4)}}
  ckpt.save(1, state, host_state=host)
  host["cursor"] = np.int64(99)  # mutated after save: the checkpoint holds the value at save time
  # Never stopping: the next step runs at once (it donates `state` while the save may be in flight).
  state2, metrics2 = step(state, _batch(1))
  expected = _host(state2)
  ckpt.wait()
  restored = ckpt.restore(abstract_state=jax.eval_shape(lambda: state2), shardings=shardings)
  assert restored is not None
  rstate, rhost = restored
  assert isinstance(rstate, trainer.TrainState) and int(rstate.step) == 1
  assert int(rhost["cursor"]) == 3
  np.testing.assert_array_equal(rhost["buffer"]["x"], np.arange(4))
  rstate2, rmetrics2 = step(rstate, _batch(1))
  chex.assert_trees_all_equal(_host(rstate2), expected)
  chex.assert_trees_all_equal(_host(rmetrics2), _host(metrics2))
  ckpt.close()


def test_keep_last_k_and_latest(setup, tmp_path):
  _, _, state, _, _ = setup
  with checkpoint.Checkpointer(str(tmp_path / "c"), max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.restore(abstract_state=state) is None  # nothing to resume from
    for s in (10, 20, 30):
      ckpt.save(s, state, {"s": s})
    ckpt.wait()
    assert ckpt.all_steps() == [20, 30] and ckpt.latest_step() == 30
    _, host = ckpt.restore(abstract_state=state)
    assert host == {"s": 30}
    _, host = ckpt.restore(20, abstract_state=state)
    assert host == {"s": 20}
    with pytest.raises(FileNotFoundError, match=r"step 10 .* available steps: \[20, 30\]"):
      ckpt.restore(10, abstract_state=state)
    with pytest.raises(ValueError, match="already exists"):
      ckpt.save(30, state)


def test_incomplete_checkpoint_is_ignored(setup, tmp_path):
  _, _, state, _, _ = setup
  d = tmp_path / "c"
  with checkpoint.Checkpointer(str(d)) as ckpt:
    ckpt.save(5, state)
  # A crash mid-save leaves orbax's temporary directory; resuming must skip it.
  os.makedirs(d / "7.orbax-checkpoint-tmp-1234" / "state")
  with checkpoint.Checkpointer(str(d)) as ckpt:
    assert ckpt.all_steps() == [5]
    _, host = ckpt.restore(abstract_state=state)
    assert host is None


def test_restore_onto_a_different_mesh(setup, tmp_path):
  _, opt, state, _, _ = setup
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    ckpt.save(1, state)
  other = sharding.make_mesh((2, 2, 2))
  abstract = jax.eval_shape(lambda: state)
  new_shardings = trainer.state_shardings(abstract, other)
  with checkpoint.Checkpointer(str(tmp_path / "c"), create=False) as ckpt:
    rstate, _ = ckpt.restore(abstract_state=abstract, shardings=new_shardings)
  chex.assert_trees_all_equal(_host(rstate), _host(state))
  q = rstate.params["layers"]["q_proj"]
  assert q.sharding.mesh.shape == other.shape
  assert q.sharding.is_equivalent_to(new_shardings.params["layers"]["q_proj"], q.ndim)
  mu = rstate.opt_state[1][0].mu["layers"]["down_proj"]
  assert mu.sharding.is_equivalent_to(new_shardings.opt_state[1][0].mu["layers"]["down_proj"], 3)
  # And onto a single device.
  single = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with checkpoint.Checkpointer(str(tmp_path / "c")) as ckpt:
    rstate, _ = ckpt.restore(abstract_state=abstract,
                             shardings=trainer.state_shardings(abstract, single))
  chex.assert_trees_all_equal(_host(rstate), _host(state))
  assert len(rstate.params["embed_tokens"].sharding.device_set) == 1


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.Checkpointer(str(tmp_path / "missing"), create=False)
  (tmp_path / "afile").write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    checkpoint.Checkpointer(str(tmp_path / "afile"))
  with pytest.raises(ValueError, match="max_to_keep"):
    checkpoint.Checkpointer(str(tmp_path / "c"), max_to_keep=0)
