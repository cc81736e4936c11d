"""Mesh construction and the regex sharding rules, on 8 emulated CPU devices (see conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxreplay.learner import batch as batch_lib
from jaxreplay.infra import sharding
from jaxreplay.models import presets
from jaxreplay.models import transformer


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
