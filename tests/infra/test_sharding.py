"""Mesh construction, the regex sharding rules, and leaves a mesh axis does not divide (stored
zero-padded, trained as on one device), on 8 emulated CPU devices (see conftest.py)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxreplay.infra import sharding
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import losses
from jaxreplay.learner import optim
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import hf_io
from jaxreplay.models import layout
from jaxreplay.models import presets
from jaxreplay.models import transformer
from tests.helpers import tolerances


def _abstract_params(cfg):
  return jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))


def test_eight_devices():
  assert jax.device_count() == 8, "conftest must set --xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("shape,expected", [
    ((1, -1, 1), (1, 8, 1)), ((-1, 1, 1), (8, 1, 1)), ((2, 2, -1), (2, 2, 2)), ((2, 4, 1), (2, 4, 1))])
def test_make_mesh_resolves_minus_one(shape, expected):
  mesh = sharding.make_mesh(shape)
  assert tuple(mesh.shape.values()) == expected
  assert tuple(mesh.axis_names) == ("data", "fsdp", "tensor")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("shape,match", [
    ((3, -1, 1), "not divisible"), ((-1, -1, 1), "at most one -1"), ((2, 2, 1), "needs 4 devices"),
    ((1, 8), "entries"), ((0, 8, 1), "positive")])
def test_make_mesh_errors(shape, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(shape)


def test_make_mesh_on_a_device_subset():
  mesh = sharding.make_mesh((1, -1, 1), devices=jax.devices()[:2])
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}


def test_fit_spec_drops_axes_that_do_not_divide():
  mesh = sharding.make_mesh((2, 2, 2))
  assert sharding.fit_spec(P(None, "fsdp", "tensor"), (2, 64, 128), mesh) == P(None, "fsdp", "tensor")
  assert sharding.fit_spec(P(None, "fsdp", "tensor"), (2, 3, 128), mesh) == P(None, None, "tensor")
  assert sharding.fit_spec(P("tensor", "fsdp"), (5, 7), mesh) == P()
  # A tuple entry keeps its longest dividing prefix; an axis missing from the mesh is dropped.
  assert sharding.fit_spec(P(("data", "fsdp")), (6,), mesh) == P("data")
  assert sharding.fit_spec(P(("data", "fsdp")), (8,), mesh) == P(("data", "fsdp"))
  assert sharding.fit_spec(P("model"), (8,), mesh) == P()
  with pytest.raises(ValueError, match="more entries"):
    sharding.fit_spec(P("data", None, None), (4, 4), mesh)


def test_param_rules_give_expected_specs():
  cfg = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
  mesh = sharding.make_mesh((2, 2, 2))
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(_abstract_params(cfg), mesh))
  assert specs["embed_tokens"] == P("tensor", "fsdp")
  assert specs["lm_head"] == P("fsdp", "tensor")
  assert specs["norm"] == P()
  lay = specs["layers"]
  for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
    assert lay[name] == P(None, "fsdp", "tensor"), name
  for name in ("o_proj", "down_proj"):
    assert lay[name] == P(None, "tensor", "fsdp"), name
  for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
    assert lay[name] == P(), name


def test_qwen2_biases_and_unmatched_leaves():
  cfg = presets.tiny(model_type="qwen2", attention_bias=True, qk_norm=False, hidden_size=64)
  mesh = sharding.make_mesh((1, 4, 2))
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(_abstract_params(cfg), mesh))
  assert specs["layers"]["q_bias"] == P(None, "tensor")
  # Unknown paths fall back to replicated.
  extra = sharding.tree_shardings({"something_new": jnp.zeros((8, 8))}, mesh)
  assert extra["something_new"].spec == P()


def test_optimizer_state_follows_param_paths():
  cfg = presets.tiny(hidden_size=64, intermediate_size=128)
  mesh = sharding.make_mesh((1, 4, 2))
  params = _abstract_params(cfg)
  opt_state = jax.eval_shape(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init, params)
  shard = sharding.tree_shardings(opt_state, mesh)
  adam = shard[1][0]
  assert adam.mu["layers"]["q_proj"].spec == P(None, "fsdp", "tensor")
  assert adam.nu["layers"]["down_proj"].spec == P(None, "tensor", "fsdp")
  assert adam.count.spec == P()


def test_sharded_arrays_hold_the_right_shards():
  cfg = presets.tiny(hidden_size=64, intermediate_size=128)
  mesh = sharding.make_mesh((2, 2, 2))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), _abstract_params(cfg))
  placed = jax.device_put(params, sharding.param_shardings(params, mesh))
  q = placed["layers"]["q_proj"]  # [2, 64, 128] over (None, fsdp=2, tensor=2)
  assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 64)}
  np.testing.assert_array_equal(np.asarray(q), np.asarray(params["layers"]["q_proj"]))


def test_batch_shardings():
  mesh = sharding.make_mesh((2, 2, 2))
  b = batch_lib.zeros(8, 16)
  shard = sharding.batch_shardings(mesh, b)
  assert shard.tokens.spec == P(("data", "fsdp"), None)
  assert shard.advantages.spec == P(("data", "fsdp"))
  assert sharding.batch_size_multiple(mesh) == 4
  with pytest.raises(ValueError, match="multiple of data\\*fsdp = 4"):
    sharding.batch_shardings(mesh, batch_lib.zeros(6, 16))


def test_constrain_inside_jit():
  mesh = sharding.make_mesh((1, 8, 1))

  @jax.jit
  def f(x):
    return sharding.constrain(x * 2, mesh, sharding.batch_spec(2, mesh))
  y = f(jnp.ones((8, 4)))
  assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("fsdp")), 2)
  assert {s.data.shape for s in y.addressable_shards} == {(1, 4)}
  np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((8, 4)))


def test_path_str():
  tree = {"a": [1, {"b": 2}]}
  paths = [sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert paths == ["a/0", "a/1/b"]


# ---- meshes whose axes do not divide a parameter: the leaf is stored zero-padded and sharded,
# never replicated, and training on it equals training on one device (8 emulated CPU devices) ------

# hidden 100 and vocab 50: 3-way fsdp or tensor axes divide neither.
CFG = presets.tiny(vocab_size=50, hidden_size=100, intermediate_size=200, num_attention_heads=3,
                   num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
ROWS, T = 6, 24
LR, STEPS = 1e-2, 2
# Sharded (and padded) vs one device: the metrics and gradients sum over the batch's ROWS*T tokens
# and the V logits in another order.
STEP_N = ROWS * T * CFG.vocab_size


def metric_tol(want):
  return tolerances.close(np.float32, STEP_N, max(tolerances.tree_scale(want), 1e-3))


def param_tol():
  """Params after STEPS updates of size <= LR: the updates carry the reassociation error, p - update
  rounds once."""
  return {"atol": tolerances.close(np.float32, STEP_N, LR * STEPS)["atol"],
          "rtol": tolerances.close(np.float32)["rtol"]}


def _mesh(shape):
  return sharding.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])


def _batch(seed=0) -> batch_lib.Batch:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (ROWS, T)).astype(np.int32)
  lengths = rng.integers(T // 2, T + 1, ROWS)
  segment_ids = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
  mask = segment_ids.astype(np.float32)
  mask[:, :6] = 0.0  # the prompt
  rewards = np.array([1, 0, 1, 1, 0, 0], np.float32)
  adv = np.asarray(losses.grpo_advantages(rewards.reshape(2, 3))).reshape(-1)
  return batch_lib.Batch(
      tokens=tokens * segment_ids, positions=np.broadcast_to(np.arange(T), (ROWS, T)).astype(np.int32),
      segment_ids=segment_ids,
      targets=np.concatenate([tokens[:, 1:], np.zeros((ROWS, 1), np.int32)], 1) * segment_ids,
      completion_mask=mask, behaviour_logprobs=np.full((ROWS, T), -3.9, np.float32) * mask,
      advantages=adv.astype(np.float32), rewards=rewards, policy_version=np.zeros(ROWS, np.int32))


def _train(mesh, params, steps=STEPS):
  opt = optim.make_optimizer(LR, weight_decay=0.01, eps=1e-3)
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=params, mesh=mesh)
  step = trainer.make_train_step(CFG, opt, loss_fn_lib.make_loss_fn("grpo"), mesh,
                                 trainer.state_shardings(state, mesh), chunk_size=8,
                                 learning_rate_fn=optim.make_schedule(LR))
  rows = []
  for i in range(steps):
    state, metrics = step(state, _batch(i))
    rows.append(jax.tree.map(np.asarray, metrics))
  return state, rows


def test_storage_shapes_round_up_only_what_does_not_divide():
  mesh = _mesh((1, 3, 1))
  shapes = jax.eval_shape(lambda: transformer.init_params(CFG, jax.random.PRNGKey(0)))
  padded = sharding.padded_leaves(shapes, mesh)
  assert padded["layers/q_proj"] == ((2, 100, 96), (2, 102, 96))
  assert padded["layers/o_proj"] == ((2, 96, 100), (2, 96, 102))
  assert padded["embed_tokens"] == ((50, 100), (50, 102))
  assert "norm" not in padded and "layers/input_layernorm" not in padded  # replicated by rule
  assert sharding.padded_leaves(shapes, _mesh((1, 2, 1))) == {}  # 2 divides everything here
  tensor = sharding.padded_leaves(shapes, _mesh((1, 1, 3)))
  assert tensor["embed_tokens"] == ((50, 100), (51, 100))  # vocab over the tensor axis


def test_indivisible_leaf_is_an_error_unless_opted_in():
  mesh = _mesh((1, 3, 1))
  leaf = {"layers": {"q_proj": jax.ShapeDtypeStruct((2, 100, 96), np.float32)}}
  with pytest.raises(ValueError, match=r"layers/q_proj.*\(2, 102, 96\)"):
    sharding.tree_shardings(leaf, mesh)
  spec = sharding.tree_shardings(leaf, mesh, indivisible="replicate")["layers"]["q_proj"].spec
  assert "fsdp" not in jax.tree.leaves(tuple(spec))  # replicated over fsdp, as asked


@pytest.fixture(scope="module")
def reference():
  """Initial params and two steps of training them on one device."""
  params = jax.tree.map(np.asarray, transformer.init_params(CFG, jax.random.PRNGKey(0)))
  return params, _train(_mesh((1, 1, 1)), params)


# (1, 3, 1): fsdp pads hidden 100 -> 102; (1, 2, 3): tensor pads vocab 50 -> 51, kv width 32 -> 33.
@pytest.mark.parametrize("shape", [(1, 3, 1), (1, 2, 3)])
def test_padded_training_equals_one_device(shape, reference):
  params, (state1, rows1) = reference
  mesh = _mesh(shape)
  state, rows = _train(mesh, params)
  # Each device holds ~1/(fsdp * tensor) of the params: nothing was replicated.
  per_device = sharding.shard_bytes(state.params, jax.tree.map(lambda x: x.sharding, state.params))
  total = sum(x.size * 4 for x in jax.tree.leaves(params))
  norms = sum(x.size * 4 for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if "norm" in sharding.path_str(p))
  n = shape[1] * shape[2]
  assert per_device <= (total - norms) / n * 1.05 + norms
  for got, want in zip(rows, rows1):
    assert set(got) == set(want)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], **metric_tol(want[key]), err_msg=key)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, layout.unpad(CFG, state.params)),
                              jax.tree.map(np.asarray, state1.params), **param_tol())
  # The padding stays exactly zero, in the params and in Adam's moments.
  for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]:
    name = sharding.path_str(path)
    logical = [r.jax_shape(CFG) for r in layout.rules_for(CFG) if name.endswith("/".join(r.path))]
    if logical and tuple(leaf.shape) != logical[0]:
      x = np.asarray(leaf).copy()
      x[tuple(slice(0, d) for d in logical[0])] = 0.0
      assert not x.any(), name
  # The HF export of padded params is the logical model.
  chex.assert_trees_all_close(hf_io.to_hf_state_dict(CFG, state.params),
                              hf_io.to_hf_state_dict(CFG, state1.params), **param_tol())


def test_load_hf_into_padded_storage(tmp_path):
  params = jax.tree.map(np.asarray, transformer.init_params(CFG, jax.random.PRNGKey(3)))
  hf_io.save_hf(CFG, params, str(tmp_path))
  mesh = _mesh((1, 3, 1))
  shapes = jax.eval_shape(lambda: transformer.init_params(CFG, jax.random.PRNGKey(0)))
  storage = sharding.storage_shapes(shapes, mesh)
  _, loaded = hf_io.load_hf(str(tmp_path), shardings=sharding.param_shardings(storage, mesh))
  chex.assert_trees_all_equal_shapes(loaded, storage)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, layout.unpad(CFG, loaded)), params)
  q = np.asarray(loaded["layers"]["q_proj"])
  assert not q[:, 100:].any()
  state = trainer.init_train_state(CFG, optim.make_optimizer(1e-3), jax.random.PRNGKey(0),
                                   params=loaded, mesh=mesh, donate_params=True)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, layout.unpad(CFG, state.params)), params)
