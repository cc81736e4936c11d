"""Multi-turn rollouts (`learner.batch.Rollout`'s completion_mask / turn_starts) and what the
learner does with them: on a batch mixing single- and multi-turn rows the environment's tokens get
exactly zero gradient and enter no loss, KL, entropy or correction statistic, for every algorithm
and correction, unpacked and packed, nor the gradient gate's LM-head energy (the LoRA path:
tests/learner/test_adapters.py; the reuse controller's statistics: tests/run/test_regime.py)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxreplay.data import batch_reuse
from jaxreplay.data import collate as collate_lib
from jaxreplay.infra import sharding
from jaxreplay.learner import algorithms
from jaxreplay.learner import corrections
from jaxreplay.learner import optim
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.learner.batch import Rollout
from tests.helpers import trajectories
from tests.helpers.train_batches import CFG, init_params

BUCKETS = (64,)


def test_rollout_checks_its_turns():
  good = dict(prompt_tokens=[5, 6], completion_tokens=[7, 8, 9, 10], logprobs=[-1, 0, 0, -1],
              reward=1.0, advantage=0.5, policy_version=0, group_id=0)
  r = Rollout(**good, completion_mask=[1, 0, 0, 1], turn_starts=[0, 3])
  assert r.num_turns == 2 and r.policy_tokens == 2
  assert r.completion_mask.dtype == np.float32 and r.turn_starts.dtype == np.int32
  plain = Rollout(**{**good, "logprobs": [-1, -1, -1, -1]})
  assert plain.num_turns == 1 and plain.policy_tokens == 4 and plain.completion_mask is None
  for kwargs, match in [
      (dict(completion_mask=[1, 0, 1]), r"\{0, 1\} \[4\]"),
      (dict(completion_mask=[1, 0.5, 0, 1]), r"\{0, 1\} \[4\]"),
      (dict(completion_mask=[0, 1, 1, 1]), "starts with a policy turn"),
      (dict(completion_mask=[1, 1, 1, 0]), "logprobs must be 0 on environment tokens"),
      (dict(completion_mask=[1, 0, 0, 1], turn_starts=[0, 2]), "each on a policy token"),
      (dict(completion_mask=[1, 0, 0, 1], turn_starts=[1, 3]), "starting at 0"),
      (dict(completion_mask=[1, 0, 0, 1], turn_starts=[0, 3, 3]), "increasing"),
      (dict(completion_mask=[1, 0, 0, 1], turn_starts=[0, 4]), r"\[0, 4\)"),
  ]:
    with pytest.raises(ValueError, match=match):
      Rollout(**good, **kwargs)


def _losses():
  """Every algorithm x every correction it takes, with a KL term."""
  out = []
  for name in algorithms.ALGORITHMS:
    for mode in corrections.CORRECTIONS:
      off = corrections.OffPolicyOptions(off_policy=mode)
      out.append(pytest.param(name, off, id=f"{name}-{mode}"))
  return out


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name,off_policy", _losses())
def test_env_tokens_get_zero_gradient_and_enter_no_statistic(name, off_policy, pack):
  rollouts = trajectories.mixed_rollouts(seed=1)
  kw = dict(buckets=BUCKETS, pack=pack)
  batch = collate_lib.collate(rollouts, **kw)
  env = trajectories.env_positions(rollouts, **kw)
  policy = batch.completion_mask > 0
  assert env.sum() > 10 and policy.sum() > 20  # both kinds of token are there
  loss_fn = loss_fn_lib.make_loss_fn(name, kl_coef=0.1, off_policy=off_policy)
  rng = np.random.default_rng(0)
  # Current log-probs near the behaviour ones (ratios on both sides of the clip), a reference.
  lp = np.where(policy, batch.behaviour_logprobs + rng.normal(0, 0.4, env.shape),
                -rng.uniform(0.1, 3, env.shape)).astype(np.float32)
  ref = (lp + rng.normal(0, 0.3, env.shape)).astype(np.float32)

  def loss(lp_, batch_, ref_):
    return loss_fn(lp_, batch_, ref_)

  (value, aux), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(lp), batch, ref)
  grad = np.asarray(grad)
  np.testing.assert_array_equal(grad[env], 0.0)  # exactly zero, not small
  assert np.abs(grad[policy]).max() > 0
  # Anything at the environment's positions (current, reference and behaviour log-probs) changes
  # neither the loss nor any statistic, bit for bit.
  other = -rng.uniform(0.1, 8, env.shape).astype(np.float32)
  moved = batch._replace(behaviour_logprobs=np.where(env, other[::-1], batch.behaviour_logprobs)
                         .astype(np.float32))
  value2, aux2 = loss(jnp.asarray(np.where(env, other, lp)), moved,
                      jnp.asarray(np.where(env, other * 0.5, ref)))
  assert float(value2) == float(value)
  assert set(aux2) == set(aux)
  for key in aux:
    assert float(aux2[key]) == float(aux[key]), key
  # The control: with the mask dropped (TRL #6804's replay bug) the same move changes the loss.
  full = collate_lib.collate(trajectories.without_masks(rollouts), **kw)
  a = loss(jnp.asarray(lp), full, ref)[0]
  b = loss(jnp.asarray(np.where(env, other, lp)), full, jnp.asarray(np.where(env, other * 0.5, ref)))[0]
  assert float(a) != float(b)


@pytest.fixture(scope="module")
def step_setup():
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = jax.tree.map(np.asarray, init_params(CFG, jax.random.PRNGKey(0)))
  opt = optim.make_optimizer(optim.make_schedule(1e-3))
  state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=params, mesh=mesh,
                                   with_ref_params=True)
  loss_fn = loss_fn_lib.make_loss_fn("grpo", kl_coef=0.05,
                                 off_policy=corrections.OffPolicyOptions(off_policy="tis"))
  step = trainer.make_train_step(CFG, opt, loss_fn, mesh, trainer.state_shardings(state, mesh),
                                 chunk_size=32, donate=False)
  return state, step, functools.partial(
      trainer.make_train_step, CFG, opt, loss_fn, mesh, trainer.state_shardings(state, mesh),
      chunk_size=32, donate=False)


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_train_step_ignores_what_the_environment_said_next(step_setup, pack):
  """Through the model: changing the environment's target tokens (what the policy would be
  trained to predict there) and their behaviour log-probs changes neither the gradients (the
  updated params are bit-identical) nor the loss, entropy, token count or any statistic."""
  state, step, _ = step_setup
  rollouts = trajectories.mixed_rollouts(seed=2, vocab=CFG.vocab_size, n=8)
  batch = collate_lib.collate(rollouts, buckets=BUCKETS, pack=pack, batch_size=8)
  env = trajectories.env_positions(rollouts, buckets=BUCKETS, pack=pack, batch_size=8)
  moved = trajectories.moved_env_targets(batch, env, CFG.vocab_size)
  after, metrics = step(state, batch)
  after2, metrics2 = step(state, moved)
  chex.assert_trees_all_equal(jax.device_get(after.params), jax.device_get(after2.params))
  metrics, metrics2 = jax.device_get(metrics), jax.device_get(metrics2)
  assert metrics["tokens"] == float(sum(r.policy_tokens for r in rollouts))
  for key in metrics:
    assert float(metrics2[key]) == float(metrics[key]), key
  # Control: the same change on a policy token moves the update.
  after3, _ = step(state, trajectories.poked_policy_target(batch, CFG.vocab_size))
  assert not np.array_equal(jax.device_get(after3.params["embed_tokens"]),
                            jax.device_get(after.params["embed_tokens"]))


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_gradient_gate_reads_no_environment_token(step_setup, pack):
  """buffer.reuse_control="gradient_gate" (Dynamic Gradient Gating) on trajectories: over four
  gated updates of one batch (`data.batch_reuse.BatchReuse`, armed at the fourth), the LM head's
  gradient energy the step measures, the bounds, z-scores, interceptions and params are
  bit-identical when the environment's targets and behaviour log-probs change; the same change at
  one policy token moves the energy."""
  state, _, make_step = step_setup
  gated = make_step(gate_leaf=trainer.gate_leaf(CFG))
  rollouts = trajectories.mixed_rollouts(seed=4, vocab=CFG.vocab_size, n=8)
  kw = dict(buckets=BUCKETS, pack=pack, batch_size=8)
  batch = collate_lib.collate(rollouts, **kw)
  env = trajectories.env_positions(rollouts, **kw)

  def reuse_one_batch(b):
    plan = batch_reuse.BatchReuse(8, gate=batch_reuse.GateSettings(max_reuse=4, threshold=0.0,
                                                                   window=2))
    plan.begin(rollouts)
    s, rows = state, []
    for i in range(4):
      plan.next_rollouts()
      s, metrics = gated(s, b, np.float32(plan.bound()))
      metrics = {key: float(v) for key, v in jax.device_get(metrics).items()}
      rows.append({**metrics, **plan.record(metrics, step=i)})
    return jax.device_get(s.params), rows

  params, rows = reuse_one_batch(batch)
  params2, rows2 = reuse_one_batch(trajectories.moved_env_targets(batch, env, CFG.vocab_size))
  assert "gate/zscore" in rows[3] and np.isfinite(rows[3]["gate/bound"])  # the gate was armed
  assert rows2 == rows
  chex.assert_trees_all_equal(params2, params)
  _, poked = gated(state, trajectories.poked_policy_target(batch, CFG.vocab_size),
                   np.float32(np.inf))
  assert float(poked["gate/lm_head_grad_energy"]) != rows[0]["gate/lm_head_grad_energy"]
