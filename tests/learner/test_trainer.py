"""The jitted sharded train step, on 8 emulated CPU devices (see conftest.py); the optimizer:
tests/learner/test_optim.py.

Gradients are observed through `record_grads`, an optax stage placed first in the chain whose state
is the raw gradient (its paths mirror the params, so it is sharded by the same rules).
"""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxreplay.learner import algorithms
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import corrections
from jaxreplay.learner import losses
from jaxreplay.learner import optim
from jaxreplay.infra import sharding
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import transformer
from tests.helpers import tolerances
from tests.helpers.train_batches import (CFG, B, T, init_params, make_batch, record_grads,
                                         with_behaviour)

CHUNK = 16
LR = 1e-3
# Tolerances between two float32 computations of one step in different summation orders (meshes,
# micro-batches, packing, host vs jit): each gradient element and each metric sums over the batch's
# B*T tokens, and the log-probs normalise over the V logits.
STEP_N = B * T * CFG.vocab_size


def step_tol(want, floor=1e-3):
  """Metrics, grads, Adam moments: sums of STEP_N float32 terms, at the reference's size (at least
  `floor`: a metric near 0, e.g. advantage_mean, is a sum of terms of at least that size)."""
  return tolerances.close(np.float32, STEP_N, max(tolerances.tree_scale(want), floor))


def param_tol():
  """Params after steps at LR: the update (|update| <= LR) carries the grads' reassociation error,
  and p - update rounds once."""
  return {"atol": tolerances.close(np.float32, STEP_N, LR)["atol"],
          "rtol": tolerances.close(np.float32)["rtol"]}
# Jitted once (eager op-by-op dispatch of the model costs seconds of test time).
full_logits = jax.jit(transformer.apply, static_argnums=0)


def _optimizer(lr=LR, **kw):
  # A large eps keeps Adam's first update lr * g / (|g| + eps) from amplifying float32 summation-order
  # noise in tiny gradients (with eps=1e-8 a 1e-8 change of g ~ 1e-7 moves the update by ~lr / 2).
  return optax.chain(record_grads(), optim.make_optimizer(lr, eps=1e-3, weight_decay=0.01, **kw))


def _mesh(shape):
  return sharding.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])


def _host(x):
  return jax.tree.map(np.asarray, x)


def run_one_step(mesh, params, batch, loss_fn, k=1, compute_entropy=True):
  """(state before, state after, metrics) as numpy, for one step from `params` on `mesh`."""
  opt = _optimizer()
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=params, mesh=mesh)
  step = trainer.make_train_step(CFG, opt, loss_fn, mesh, trainer.state_shardings(state, mesh),
                                 num_microbatches=k, chunk_size=CHUNK, compute_entropy=compute_entropy,
                                 learning_rate_fn=optim.make_schedule(LR))
  before = _host(state)
  after, metrics = step(state, batch)
  return before, _host(after), _host(metrics)


@pytest.fixture(scope="module")
def data():
  """Initial params, a batch with realistic behaviour log-probs, and the single-device step."""
  params = _host(init_params(CFG, jax.random.PRNGKey(0)))
  mesh1 = _mesh((1, 1, 1))
  logprob_fn = trainer.make_logprob_fn(CFG, mesh1, sharding.param_shardings(params, mesh1), CHUNK)
  batch = make_batch()
  batch = with_behaviour(batch, np.asarray(logprob_fn(params, batch)))
  loss_fn = loss_fn_lib.make_loss_fn("grpo")
  opt = _optimizer()
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=params, mesh=mesh1)
  step = trainer.make_train_step(CFG, opt, loss_fn, mesh1, trainer.state_shardings(state, mesh1),
                                 chunk_size=CHUNK, learning_rate_fn=optim.make_schedule(LR))
  before = _host(state)
  after, metrics = step(state, batch)
  return dict(params=params, batch=batch, logprob_fn=logprob_fn, loss_fn=loss_fn, step=step,
              state0=state, before=before, after=after, after_host=_host(after),
              metrics=_host(metrics))


# ---- train state -------------------------------------------------------------------------------

def test_init_train_state_is_sharded_and_checks_params(data):
  mesh = _mesh((2, 2, 2))
  opt = _optimizer()
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=data["params"], mesh=mesh,
                                   with_ref_params=True)
  want = trainer.state_shardings(state, mesh)
  for got, exp in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
    assert got.sharding.is_equivalent_to(exp, got.ndim)
  assert state.params["layers"]["gate_proj"].sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp", "tensor")
  chex.assert_trees_all_equal(_host(state.params), data["params"])
  chex.assert_trees_all_equal(_host(state.ref_params), data["params"])
  assert state.step.dtype == jnp.int32 and int(state.step) == 0 and state.rng.dtype == jnp.uint32
  # The reference params get no optimizer state: the same opt_state as without them.
  plain = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=data["params"], mesh=mesh)
  assert jax.tree.structure(plain.opt_state) == jax.tree.structure(state.opt_state)
  # donate_params: the caller's device arrays become the state's params (no second copy).
  owned = jax.device_put(data["params"], want.params)
  donated = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=owned, mesh=mesh,
                                     donate_params=True)
  assert owned["layers"]["q_proj"].is_deleted()
  chex.assert_trees_all_equal(_host(donated.params), data["params"])
  bad = dict(data["params"], norm=np.ones((3,), np.float32))
  with pytest.raises(ValueError, match="params do not match model_cfg"):
    trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=bad, mesh=mesh)


def test_random_init_matches_transformer_init():
  mesh = _mesh((1, 8, 1))
  state = trainer.init_train_state(CFG, _optimizer(), jax.random.PRNGKey(3), mesh=mesh)
  init_rng, _ = jax.random.split(jax.random.PRNGKey(3))
  chex.assert_trees_all_close(_host(state.params), _host(init_params(CFG, init_rng)),
                              atol=1e-7)


# ---- the step ----------------------------------------------------------------------------------

def test_reference_step_metrics(data):
  """The single-device step against losses.grpo_loss on directly computed log-probs."""
  batch, m = data["batch"], data["metrics"]
  lp = data["logprob_fn"](data["params"], batch)
  want_loss, want_aux = losses.grpo_loss(lp, batch.behaviour_logprobs, batch.advantages,
                                         batch.completion_mask)
  np.testing.assert_allclose(m["loss"], float(want_loss), **step_tol(want_loss))
  for key in ("clip_fraction", "ratio_mean", "pg_loss", "num_tokens"):
    np.testing.assert_allclose(m[key], float(want_aux[key]), **step_tol(want_aux[key]),
                               err_msg=key)
  assert m["tokens"] == batch.completion_mask.sum()
  assert m["seq_tokens"] == (batch.segment_ids > 0).sum()
  assert 0.0 < m["clip_fraction"] < 1.0  # the noisy behaviour log-probs exercise both branches
  assert m["learning_rate"] == pytest.approx(LR)
  g = data["after_host"].opt_state[0]
  grad_norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(g)))
  np.testing.assert_allclose(m["grad_norm"], grad_norm, **step_tol(grad_norm))
  # Entropy: recomputed from full logits.
  logits = full_logits(CFG, data["params"], batch.tokens, batch.positions, batch.segment_ids)
  logp = jax.nn.log_softmax(logits)
  ent = -np.sum(np.exp(logp) * logp, axis=-1)
  mask = batch.completion_mask
  want_ent = np.sum(ent * mask) / mask.sum()
  np.testing.assert_allclose(m["entropy"], want_ent, **step_tol(want_ent))
  assert all(np.asarray(v).dtype == np.float32 and np.ndim(v) == 0 for v in m.values())


def test_step_donates_state_and_compiles_once(data):
  step = data["step"]
  shardings = jax.tree.map(lambda x: x.sharding, data["after"])
  state = jax.device_put(jax.tree.map(np.copy, data["after_host"]), shardings)
  other = with_behaviour(make_batch(seed=5), np.zeros((B, T), np.float32) - 4.0)
  new_state, metrics = step(state, other)
  # Donated: the old state's buffers are reused for the new state (no host view holds them).
  assert state.params["embed_tokens"].is_deleted() and state.opt_state[1][1][0].mu["norm"].is_deleted()
  assert int(new_state.step) == 2 and np.isfinite(float(metrics["loss"]))
  assert step._cache_size() == 1  # a new batch of the same shape reuses the compiled step


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_step_on_meshes_matches_one_device(data, mesh_shape):
  before, after, metrics = run_one_step(_mesh(mesh_shape), data["params"], data["batch"],
                                        data["loss_fn"])
  chex.assert_trees_all_equal(before.params, data["before"].params)
  for key, want in data["metrics"].items():
    np.testing.assert_allclose(metrics[key], want, **step_tol(want), err_msg=key)
  chex.assert_trees_all_close(after.opt_state[0], data["after_host"].opt_state[0],
                              **step_tol(data["after_host"].opt_state[0]))  # grads
  chex.assert_trees_all_close(after.params, data["after_host"].params, **param_tol())
  chex.assert_trees_all_close(after.opt_state[1], data["after_host"].opt_state[1],
                              **step_tol(data["after_host"].opt_state[1], floor=0.0))


def test_microbatches_token_mean_equal_the_big_batch(data):
  """k = 4 micro-batches of 2 rows on a 2-device FSDP mesh == one 8-row batch on one device."""
  _, after, metrics = run_one_step(_mesh((1, 2, 1)), data["params"], data["batch"], data["loss_fn"],
                                   k=4)
  for key, want in data["metrics"].items():
    np.testing.assert_allclose(metrics[key], want, **step_tol(want), err_msg=key)
  chex.assert_trees_all_close(after.opt_state[0], data["after_host"].opt_state[0],
                              **step_tol(data["after_host"].opt_state[0]))
  chex.assert_trees_all_close(after.params, data["after_host"].params, **param_tol())


@pytest.mark.parametrize("name,aggregation", [("grpo", "sequence_mean"), ("asymre", "constant")])
def test_microbatches_other_aggregations(data, name, aggregation):
  """k = 2 micro-batches against the loss and gradient of the whole batch, computed directly."""
  batch = data["batch"]
  loss_fn = loss_fn_lib.make_loss_fn(name, aggregation=aggregation)

  @jax.jit
  def direct(params):
    def f(p):
      lp = logprobs_lib.token_logprobs(CFG, p, batch.tokens, batch.targets, batch.positions,
                                       batch.segment_ids, chunk_size=CHUNK)
      return loss_fn(lp, batch)
    return jax.value_and_grad(f, has_aux=True)(params)

  (want_loss, want_aux), want_grads = _host(direct(data["params"]))
  _, after, metrics = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn, k=2,
                                   compute_entropy=False)
  np.testing.assert_allclose(metrics["loss"], want_loss, **step_tol(want_loss))
  for key, want in want_aux.items():
    np.testing.assert_allclose(metrics[key], want, **step_tol(want), err_msg=key)
  chex.assert_trees_all_close(after.opt_state[0], want_grads, **step_tol(want_grads))


def test_grpo_with_kl_learns_on_a_fixed_batch(data):
  """Eight GRPO steps on one batch: the loss falls, log-probs move with the advantage's sign, the KL
  to the frozen reference grows from 0, and the reference params never change."""
  mesh = _mesh((1, 1, 1))
  lr = 3e-3
  sched = optim.make_schedule(lr, warmup_steps=2)
  opt = optim.make_optimizer(sched)
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=data["params"], mesh=mesh,
                                   with_ref_params=True)
  step = trainer.make_train_step(CFG, opt, loss_fn_lib.make_loss_fn("grpo", kl_coef=0.01), mesh,
                                 trainer.state_shardings(state, mesh), chunk_size=CHUNK,
                                 learning_rate_fn=sched, compute_entropy=False)
  batch = data["batch"]
  history = []
  for _ in range(8):
    state, metrics = step(state, batch)
    history.append(_host(metrics))
  losses_ = [h["loss"] for h in history]
  assert losses_[-1] < losses_[0] - 0.05, losses_
  assert history[0]["kl"] == pytest.approx(0.0, abs=1e-7) and history[-1]["kl"] > 1e-5
  np.testing.assert_allclose([h["learning_rate"] for h in history], [float(sched(i)) for i in range(8)])
  assert "staleness_mean" not in history[0]  # the buffer reports a batch's staleness, once
  chex.assert_trees_all_equal(_host(state.ref_params), data["params"])
  lp0 = np.asarray(data["logprob_fn"](data["params"], batch))
  lp1 = np.asarray(data["logprob_fn"](state.params, batch))
  mask = batch.completion_mask > 0
  delta = np.where(mask, lp1 - lp0, 0.0).sum(1) / np.maximum(mask.sum(1), 1)
  adv = batch.advantages
  assert np.all(delta[adv > 0.1] > 0) and np.all(delta[adv < -0.1] < 0), (delta, adv)


def test_logprob_fn_matches_full_logits(data):
  batch = data["batch"]
  logits = full_logits(CFG, data["params"], batch.tokens, batch.positions, batch.segment_ids)
  logp = np.asarray(jax.nn.log_softmax(logits))
  want = np.take_along_axis(logp, batch.targets[..., None], -1)[..., 0]
  got = np.asarray(data["logprob_fn"](data["params"], batch))
  mask = batch.completion_mask > 0
  # Chunked log-probs vs one log_softmax over the full logits: sums over the V logits.
  np.testing.assert_allclose(got[mask], want[mask], **tolerances.close(
      np.float32, CFG.vocab_size, tolerances.tree_scale(want[mask])))
  assert np.all(got[~mask] == 0.0)


# ---- errors ------------------------------------------------------------------------------------

def test_errors(data):
  mesh = _mesh((1, 1, 1))
  opt = _optimizer()
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=data["params"], mesh=mesh)
  shardings = trainer.state_shardings(state, mesh)
  step = trainer.make_train_step(CFG, opt, data["loss_fn"], mesh, shardings, num_microbatches=3)
  with pytest.raises(ValueError, match="multiple of num_microbatches"):
    step(state, data["batch"])
  step = trainer.make_train_step(CFG, opt, loss_fn_lib.make_loss_fn(kl_coef=0.1), mesh, shardings)
  with pytest.raises(ValueError, match="with_ref_params=True"):
    step(state, data["batch"])
  with pytest.raises(ValueError, match="num_microbatches"):
    trainer.make_train_step(CFG, opt, data["loss_fn"], mesh, shardings, num_microbatches=0)
  with pytest.raises(ValueError, match="unknown"):
    loss_fn_lib.make_loss_fn("ppo")
  with pytest.raises(ValueError, match="aggregation"):
    loss_fn_lib.make_loss_fn(aggregation="sum")
  with pytest.raises(TypeError, match="loss 'asymre' takes AsymreOptions, got GrpoOptions"):
    loss_fn_lib.make_loss_fn("asymre", algorithms.GrpoOptions(eps_high=0.3))
  with pytest.raises(ValueError, match="tis_cap=-1.0"):
    loss_fn_lib.make_loss_fn(off_policy=corrections.OffPolicyOptions(tis_cap=-1.0))
  with pytest.raises(ValueError, match="eps_low > 0 and eps_high > 0"):
    loss_fn_lib.make_loss_fn("grpo", algorithms.GrpoOptions(eps_high=0.0),
                         off_policy=corrections.OffPolicyOptions(tis_cap=2.0))
  with pytest.raises(ValueError, match="kl_clamp=-1.0"):
    loss_fn_lib.make_loss_fn(kl_clamp=-1.0)
  with pytest.raises(ValueError, match="normalizer"):
    loss_fn_lib.make_loss_fn(normalizer=10.0)
  with pytest.raises(TypeError, match="loss_fn.LossFn.*make_loss_fn.*function"):
    trainer.make_train_step(CFG, opt, losses.grpo_loss, mesh, shardings)
  with pytest.raises(TypeError, match="loss_fn.LossFn"):
    trainer.make_train_step(CFG, opt, lambda lp, batch, ref=None: data["loss_fn"](lp, batch, ref),
                            mesh, shardings)


def test_undeclared_aux_kind_raises(data, monkeypatch):
  """A statistic without a kind in losses.AUX_KINDS fails, naming it, with and without micro-batches."""
  with pytest.raises(ValueError, match="'new_stat' has no valid kind in jaxreplay.learner.losses.AUX_KINDS.*"
                                      "corrections.CORRECTIONS"):
    trainer._combine_aux({"new_stat": jnp.ones(2)}, jnp.ones(2), jnp.ones(2), jnp.ones(2))
  monkeypatch.setitem(losses.AUX_KINDS, "num_tokens", "mean")
  with pytest.raises(ValueError, match="'num_tokens'.*got 'mean'.*token_mean"):
    trainer._combine_aux({"num_tokens": jnp.ones(2)}, jnp.ones(2), jnp.ones(2), jnp.ones(2))
  monkeypatch.delitem(losses.AUX_KINDS, "clip_fraction")
  mesh = _mesh((1, 1, 1))
  for k in (1, 2):
    with pytest.raises(ValueError, match="'clip_fraction'.*AUX_KINDS"):
      run_one_step(mesh, data["params"], data["batch"], data["loss_fn"], k=k, compute_entropy=False)


def test_combine_aux_by_kind():
  aux = {"num_tokens": jnp.array([3.0, 5.0]), "ratio_max": jnp.array([1.5, 1.2]),
         "advantage_mean": jnp.array([1.0, 2.0]), "pg_loss": jnp.array([4.0, 8.0]),
         "kl": jnp.array([0.1, 0.3])}
  tok_w, row_w, loss_w = jnp.array([0.25, 0.75]), jnp.array([0.5, 0.5]), jnp.array([1.0, 1.0])
  got = _host(trainer._combine_aux(aux, tok_w, row_w, loss_w))
  np.testing.assert_allclose([got[k] for k in aux], [8.0, 1.5, 1.5, 12.0, 0.25], rtol=1e-6)


# ---- truncated importance sampling ---------------------------------------------------------------

TIS_CAP = 1.2  # small enough that the noisy behaviour log-probs of `data` truncate some tokens


def test_tis_step_matches_the_formula(data):
  """tis_cap = C: loss = token mean of -min(pi_theta / pi_sampler, C) A, with its gradient."""
  batch = data["batch"]
  loss_fn = loss_fn_lib.make_loss_fn("grpo", off_policy=corrections.OffPolicyOptions(tis_cap=TIS_CAP))

  @jax.jit
  def direct_grads(params):
    def f(p):
      lp = logprobs_lib.token_logprobs(CFG, p, batch.tokens, batch.targets, batch.positions,
                                       batch.segment_ids, chunk_size=CHUNK)
      w = jnp.minimum(jnp.exp(jax.lax.stop_gradient(lp) - batch.behaviour_logprobs), TIS_CAP)
      mask = batch.completion_mask
      return -jnp.sum(jnp.where(mask > 0, w * batch.advantages[:, None] * lp, 0.0)) / mask.sum()
    return jax.grad(f)(params)

  _, after, metrics = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn)
  lp = np.asarray(data["logprob_fn"](data["params"], batch), np.float64)
  mask = batch.completion_mask > 0
  ratio = np.exp(lp - batch.behaviour_logprobs)[mask]
  w = np.minimum(ratio, TIS_CAP)
  adv = np.broadcast_to(batch.advantages[:, None], mask.shape)[mask]
  want_loss = -np.sum(w * adv) / mask.sum()
  np.testing.assert_allclose(metrics["loss"], want_loss, **step_tol(want_loss))
  np.testing.assert_allclose(metrics["tis_weight_mean"], w.mean(), **step_tol(w.mean()))
  np.testing.assert_allclose(metrics["tis_truncated_fraction"], np.mean(ratio >= TIS_CAP), rtol=1e-5)
  assert 0.0 < metrics["tis_truncated_fraction"] < 1.0
  assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == 1.0
  want_grads = _host(direct_grads(data["params"]))
  chex.assert_trees_all_close(after.opt_state[0], want_grads, **step_tol(want_grads))


def test_tis_microbatches_equal_the_whole_batch(data):
  """With TIS on, k = 3 micro-batches of 2 rows == one 6-row batch (one row is all padding)."""
  rows = np.array([0, 1, 2, 3, 4, B - 1])
  batch = jax.tree.map(lambda x: x[rows], data["batch"])
  loss_fn = loss_fn_lib.make_loss_fn("grpo", off_policy=corrections.OffPolicyOptions(tis_cap=TIS_CAP))
  _, whole, want = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn)
  _, micro, got = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn, k=3)
  assert {"tis_weight_mean", "tis_truncated_fraction"} <= set(got)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], **step_tol(want[key]), err_msg=key)
  chex.assert_trees_all_close(micro.opt_state[0], whole.opt_state[0], **step_tol(whole.opt_state[0]))
  chex.assert_trees_all_close(micro.params, whole.params, **param_tol())


@pytest.mark.parametrize("mode,key,cap", [("mis_token", "mis_masked_fraction", 1.3),
                                          ("mis_sequence", "mis_masked_sequence_fraction", 3.0),
                                          ("decoupled", "decoupled_masked_fraction", 1.3),
                                          ("m2po", "m2po_second_moment", 2.0)])
def test_corrections_in_the_step_and_microbatches(data, mode, key, cap):
  """Per-token and per-sequence corrections are exact under gradient accumulation (a micro-batch
  holds whole rows); m2po thresholds each micro-batch (its statistics still combine exactly)."""
  rows = np.array([0, 1, 2, 3, 4, B - 1])
  batch = jax.tree.map(lambda x: x[rows], data["batch"])
  loss_fn = loss_fn_lib.make_loss_fn("grpo", off_policy=corrections.OffPolicyOptions(
      mode, off_policy_cap=cap, m2po_threshold=0.02))
  _, whole, want = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn)
  _, micro, got = run_one_step(_mesh((1, 1, 1)), data["params"], batch, loss_fn, k=3)
  assert key in want and set(got) == set(want)
  assert 0.0 < want[key] < 1.0
  if mode == "m2po":
    np.testing.assert_allclose(got[key], want[key], **step_tol(want[key]))
    return
  for k in want:
    np.testing.assert_allclose(got[k], want[k], **step_tol(want[k]), err_msg=k)
  chex.assert_trees_all_close(micro.opt_state[0], whole.opt_state[0], **step_tol(whole.opt_state[0]))


def test_nonfinite_update_is_skipped_and_counted(data):
  """A NaN advantage makes the loss and gradient NaN: the step keeps the old params and optimizer
  state (step and rng still advance) and reports nonfinite_skipped=1; a finite batch reports 0."""
  assert data["metrics"]["nonfinite_skipped"] == 0.0
  step, before = data["step"], data["after_host"]
  shardings = jax.tree.map(lambda x: x.sharding, data["after"])
  state = jax.device_put(jax.tree.map(np.copy, before), shardings)
  bad = data["batch"]._replace(advantages=np.full(B, np.nan, np.float32))
  new_state, metrics = step(state, bad)
  metrics = _host(metrics)
  assert metrics["nonfinite_skipped"] == 1.0 and not np.isfinite(metrics["loss"])
  after = _host(new_state)
  chex.assert_trees_all_equal(after.params, before.params)
  chex.assert_trees_all_equal(after.opt_state, before.opt_state)
  assert int(after.step) == int(before.step) + 1
  assert trainer.all_finite(new_state.params)
  assert not trainer.all_finite({"w": jnp.array([1.0, jnp.inf]), "i": jnp.array([1, 2])})

  # nonfinite_check="updated" (the select after the update): the same update on the finite batch,
  # the same skip on the NaN one.
  mesh1 = _mesh((1, 1, 1))
  checked = trainer.make_train_step(CFG, _optimizer(), data["loss_fn"], mesh1, shardings,
                                    chunk_size=CHUNK, learning_rate_fn=optim.make_schedule(LR),
                                    nonfinite_check="updated")
  fresh = lambda: jax.device_put(jax.tree.map(np.copy, data["before"]), shardings)
  got, got_metrics = checked(fresh(), data["batch"])
  chex.assert_trees_all_close(_host(got).params, data["after_host"].params, **param_tol())
  assert _host(got_metrics)["nonfinite_skipped"] == 0.0
  got, got_metrics = checked(fresh(), bad)
  assert _host(got_metrics)["nonfinite_skipped"] == 1.0
  chex.assert_trees_all_equal(_host(got).params, data["before"].params)
  with pytest.raises(ValueError, match="nonfinite_check"):
    trainer.make_train_step(CFG, _optimizer(), data["loss_fn"], mesh1, shardings,
                            nonfinite_check="never")
  assert trainer.all_finite({"i": jnp.array([1, 2])})  # integer leaves are always finite


def test_gradient_gate_intercepts_above_its_bound(data):
  """Dynamic Gradient Gating in the step (`gate_leaf`): the LM head's gradient energy (squared norm
  of the unclipped gradient; the tied embedding matrix here) is reported; above the bound the
  update is intercepted before the optimizer (params and Adam state kept, step + 1, not counted as
  non-finite); at or below it the step is the ungated one."""
  leaf = trainer.gate_leaf(CFG)
  assert CFG.tie_word_embeddings and leaf == "embed_tokens"
  assert trainer.gate_leaf(dataclasses.replace(CFG, tie_word_embeddings=False)) == "lm_head"
  shardings = jax.tree.map(lambda x: x.sharding, data["after"])
  mesh1 = _mesh((1, 1, 1))
  gated = trainer.make_train_step(CFG, _optimizer(), data["loss_fn"], mesh1, shardings,
                                  chunk_size=CHUNK, learning_rate_fn=optim.make_schedule(LR),
                                  gate_leaf=leaf)
  fresh = lambda: jax.device_put(jax.tree.map(np.copy, data["before"]), shardings)
  got, metrics = gated(fresh(), data["batch"], np.float32(np.inf))
  got, metrics = _host(got), _host(metrics)
  grads = data["after_host"].opt_state[0]  # record_grads: the raw gradient of the ungated step
  energy = float(np.sum(np.square(np.asarray(grads[leaf], np.float64))))
  np.testing.assert_allclose(metrics["gate/lm_head_grad_energy"], energy, rtol=1e-4)
  assert metrics["gate/fired"] == 0.0 and metrics["nonfinite_skipped"] == 0.0
  chex.assert_trees_all_close(got.params, data["after_host"].params, **param_tol())
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(metrics[key], data["metrics"][key], **step_tol(data["metrics"][key]))
  e = float(metrics["gate/lm_head_grad_energy"])
  got, metrics = gated(fresh(), data["batch"], np.float32(e * 0.999))  # just below: fires
  got, metrics = _host(got), _host(metrics)
  assert metrics["gate/fired"] == 1.0 and metrics["nonfinite_skipped"] == 0.0
  chex.assert_trees_all_equal(got.params, data["before"].params)
  chex.assert_trees_all_equal(got.opt_state, data["before"].opt_state)
  assert int(got.step) == int(data["before"].step) + 1
  _, metrics = gated(fresh(), data["batch"], np.float32(e * 1.001))  # just above: kept
  assert _host(metrics)["gate/fired"] == 0.0
  with pytest.raises(ValueError, match="LoRA freezes"):
    trainer.make_train_step(CFG, _optimizer(), data["loss_fn"], mesh1, shardings,
                            lora=object(), gate_leaf=leaf)


def test_select_skip_equals_the_cond_skip(data):
  """skip_mode "select" (what GPUs get: no conditional copying the state) takes the same update on
  a finite batch and the same skip on a NaN one as the CPU's "cond"; "auto" resolves by the
  platform of the mesh's devices."""
  mesh1 = _mesh((1, 1, 1))
  shardings = jax.tree.map(lambda x: x.sharding, data["after"])
  select = trainer.make_train_step(CFG, _optimizer(), data["loss_fn"], mesh1, shardings,
                                   chunk_size=CHUNK, learning_rate_fn=optim.make_schedule(LR),
                                   skip_mode="select")
  fresh = lambda: jax.device_put(jax.tree.map(np.copy, data["before"]), shardings)
  got, metrics = select(fresh(), data["batch"])
  assert _host(metrics)["nonfinite_skipped"] == 0.0
  chex.assert_trees_all_close(_host(got).params, data["after_host"].params, **param_tol())
  chex.assert_trees_all_close(_host(got).opt_state, data["after_host"].opt_state, **param_tol())
  bad = data["batch"]._replace(advantages=np.full(B, np.nan, np.float32))
  got, metrics = select(fresh(), bad)
  assert _host(metrics)["nonfinite_skipped"] == 1.0
  chex.assert_trees_all_equal(_host(got).params, data["before"].params)
  chex.assert_trees_all_equal(_host(got).opt_state, data["before"].opt_state)
  assert trainer.resolve_skip_mode("auto", mesh1) == "cond"  # CPU devices
  assert trainer.resolve_skip_mode("select", mesh1) == "select"
  with pytest.raises(ValueError, match="skip_mode"):
    trainer.resolve_skip_mode("maybe", mesh1)


# ---- sequence packing ----------------------------------------------------------------------------

def _rollouts(n=8, seed=3, max_prompt=8, max_completion=22):
  """n rollouts of varied lengths (4..max_prompt + max_completion tokens) with behaviour log-probs
  that make ratios clip."""
  from jaxreplay.data import buffer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    lp, lc = int(rng.integers(2, max_prompt + 1)), int(rng.integers(2, max_completion + 1))
    out.append(buffer.Rollout(
        rng.integers(3, CFG.vocab_size, lp), rng.integers(3, CFG.vocab_size, lc),
        rng.uniform(-5.5, -3.0, lc).astype(np.float32), reward=float(i % 2),
        advantage=float(rng.normal()), policy_version=i, group_id=i // 4))
  return out


def _loss_and_grads(params, batch, loss_fn):
  def f(p):
    lp = logprobs_lib.token_logprobs(CFG, p, batch.tokens, batch.targets, batch.positions,
                                     batch.segment_ids, chunk_size=CHUNK)
    lfn = loss_fn
    if loss_fn.aggregation == "constant":  # the trainer's default for both: rollouts * T
      lfn = dataclasses.replace(loss_fn, normalizer=float(len(ROLLOUTS) * batch.tokens.shape[1]))
    return lfn(lp, batch)
  return _host(jax.jit(jax.value_and_grad(f, has_aux=True))(params))


ROLLOUTS = _rollouts()


# Every aggregation once, each algorithm at least once (each case compiles two gradients: ~35 s).
@pytest.mark.parametrize("name,aggregation", [("grpo", "token_mean"), ("asymre", "sequence_mean"),
                                              ("grpo", "constant"), ("asymre", "token_mean")])
def test_packed_batch_same_loss_aux_and_grads(data, name, aggregation):
  from jaxreplay.data import collate  # pylint: disable=g-import-not-at-top
  unpacked = collate.collate(ROLLOUTS, buckets=(T,), batch_size=len(ROLLOUTS))
  packed = collate.collate(ROLLOUTS, buckets=(T,), batch_size=len(ROLLOUTS), pack=True)
  assert packed.packed and not unpacked.packed
  assert packed.tokens.shape[0] < unpacked.tokens.shape[0], "the test must pack something"
  assert np.max(packed.segment_ids) >= 2
  loss_fn = loss_fn_lib.make_loss_fn(name, aggregation=aggregation)
  (loss_u, aux_u), grads_u = _loss_and_grads(data["params"], unpacked, loss_fn)
  (loss_p, aux_p), grads_p = _loss_and_grads(data["params"], packed, loss_fn)
  assert set(aux_u) == set(aux_p)
  for k in aux_u:
    np.testing.assert_allclose(aux_p[k], aux_u[k], **step_tol(aux_u[k]), err_msg=k)
  np.testing.assert_allclose(loss_p, loss_u, **step_tol(loss_u))
  chex.assert_trees_all_close(grads_p, grads_u, **step_tol(grads_u))
  assert float(np.abs(loss_u)) > 1e-3 and aux_u["advantage_mean"] != 0.0
  if name == "grpo":
    assert 0.0 < aux_u["clip_fraction"] < 1.0  # both branches of the clip are exercised


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_packed_train_step_with_microbatches_equals_unpacked(data, aggregation):
  """The jitted step (k = 2 micro-batches, 2-device FSDP mesh) on the packed batch == the unpacked
  batch on one device: loss, every metric, gradients and the updated params."""
  from jaxreplay.data import collate  # pylint: disable=g-import-not-at-top
  mesh = _mesh((1, 2, 1))
  multiple = sharding.batch_size_multiple(mesh) * 2
  rollouts = _rollouts(16, seed=4, max_prompt=5, max_completion=9)  # rows come in 4s
  unpacked = collate.collate(rollouts, buckets=(T,), batch_size=len(rollouts))
  packed = collate.collate(rollouts, buckets=(T,), batch_size=len(rollouts), pack=True,
                           row_multiple=multiple)
  assert packed.tokens.shape[0] % multiple == 0 and packed.tokens.shape[0] < len(rollouts)
  loss_fn = loss_fn_lib.make_loss_fn("grpo", aggregation=aggregation)
  _, after_u, metrics_u = run_one_step(_mesh((1, 1, 1)), data["params"], unpacked, loss_fn)
  _, after_p, metrics_p = run_one_step(mesh, data["params"], packed, loss_fn, k=2)
  assert set(metrics_p) == set(metrics_u)
  for key, want in metrics_u.items():
    np.testing.assert_allclose(metrics_p[key], want, **step_tol(want), err_msg=key)
  chex.assert_trees_all_close(after_p.opt_state[0], after_u.opt_state[0],
                              **step_tol(after_u.opt_state[0]))
  chex.assert_trees_all_close(after_p.params, after_u.params, **param_tol())


@pytest.mark.slow
def test_tiny_launch_with_packing_and_offline_wandb(tmp_path):
  """The tiny default end to end (6 steps) with trainer.pack=True and W&B offline: the packed
  batches go through the pipeline (collate, mismatch probe, train step) with finite updates, and
  build's W&B settings reach an offline run."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from tests.helpers import tiny_runs  # pylint: disable=g-import-not-at-top
  from tests.helpers.deps import require  # pylint: disable=g-import-not-at-top
  require("wandb")
  workdir = tmp_path / "run"
  os.environ.setdefault("WANDB_SILENT", "true")
  for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    tiny_runs.ENV[var] = str(tmp_path / "wandb_home")
  tiny_runs.run_launch(str(workdir), "--config.trainer.pack=True",
                       "--config.log.wandb_project=jaxreplay-test",
                       "--config.log.wandb_mode=offline", timeout=900)
  rows = tiny_runs.read_rows(str(workdir))
  steps = [r for r in rows if "loss" in r]
  assert len(steps) == 6 and all(np.isfinite(r["loss"]) and r["nonfinite_skipped"] == 0
                                 for r in steps)
  assert all(r["tokens"] > 0 and r["seq_tokens"] > r["tokens"] for r in steps)
  config = json.load(open(workdir / "run_config.json"))
  assert config["trainer"]["pack"] is True
  assert len(list((workdir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
