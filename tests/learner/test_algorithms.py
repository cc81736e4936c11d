"""`learner.algorithms`: the table is the one place an algorithm (and, in `corrections`, a correction)
is added. A toy algorithm and a toy correction, added to the tables and nowhere else, run through
the config validation, `loss_fn.make_loss_fn`, the advantages and one jitted train step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxreplay.config import defaults
from jaxreplay.config import validation
from jaxreplay.data import experience
from jaxreplay.infra import sharding
from jaxreplay.learner import algorithms
from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import corrections
from jaxreplay.learner import losses
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import presets
from jaxreplay.models import transformer

CFG = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
B, T, CHUNK = 4, 16, 16


# ---- what a contributor writes: a pure loss (losses.py), its options and a row (algorithms.py),
# ---- a correction's function and row (corrections.py)

def centred_advantages(rewards, shift=0.0):
  """Dr.GRPO-style: r - mean_group(r) - shift, no std. rewards [P, G] -> float32 [P, G]."""
  r = jnp.asarray(rewards, jnp.float32)
  return r - jnp.mean(r, axis=1, keepdims=True) - shift


def scaled_reinforce_loss(logprobs, behaviour_logprobs, advantages, mask, *, scale, aggregation,
                          normalizer, ref_logprobs, kl_coef, segment_ids, token_weights=None):
  """-scale * w * A * lp per token, aggregated; no KL term (kl_coef must be 0)."""
  del behaviour_logprobs, ref_logprobs, kl_coef
  m = jnp.asarray(mask, jnp.float32)
  w = 1.0 if token_weights is None else jax.lax.stop_gradient(token_weights)
  per_token = -scale * w * jnp.asarray(advantages, jnp.float32)[:, None] * logprobs
  loss = losses.aggregate(per_token, m, aggregation, normalizer, segment_ids)
  return loss, {"num_tokens": jnp.sum(m), "pg_loss": jax.lax.stop_gradient(loss)}


@dataclasses.dataclass(frozen=True)
class ToyOptions:
  """toy_shift: the advantages' shift; toy_scale > 0: the loss's scale (config.trainer keys)."""
  toy_shift: float = 0.0
  toy_scale: float = 1.0

  def __post_init__(self):
    if not self.toy_scale > 0:
      raise ValueError(f"trainer.toy_scale={self.toy_scale} must be > 0")

  def advantage_args(self):
    return {"shift": self.toy_shift}

  def loss_args(self):
    return {"scale": self.toy_scale}


def halve(lp, behaviour, mask, segment_ids, options):
  """Every valid token weighs 1/2 (weights [B, T], no proximal log-probs)."""
  del behaviour, segment_ids, options
  w = jnp.where(mask > 0, 0.5, 0.0) + 0.0 * lp
  return corrections.Correction(w, None, {"halve_weight_mean": losses._masked_mean(w, mask)})  # pylint: disable=protected-access


TOY = algorithms.Algorithm(centred_advantages, scaled_reinforce_loss, ToyOptions)
HALVE = corrections.Mode(halve, {"halve_weight_mean": "token_mean"})


# ---- a batch and a one-device train step -------------------------------------------------------

def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    mask[i, 3:rng.integers(6, T)] = 1.0
  rewards = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
  return batch_lib.Batch(
      tokens=tokens, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
      segment_ids=np.ones((B, T), np.int32),
      targets=np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], axis=1),
      completion_mask=mask, behaviour_logprobs=np.zeros((B, T), np.float32),
      advantages=np.zeros(B, np.float32), rewards=rewards.reshape(-1),
      policy_version=np.zeros(B, np.int32)), rewards


def test_a_toy_algorithm_and_correction_run_from_their_table_rows_alone():
  batch, rewards = make_batch()
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(algorithms.ALGORITHMS, "toy", TOY)
    mp.setitem(corrections.CORRECTIONS, "halve", HALVE)

    # The config validation reads both names (and the options) from the tables.
    c = defaults.base_config()
    c.trainer.loss, c.trainer.off_policy = "toy", "halve"
    validation.validate_config(c)
    assert loss_fn_lib.loss_fn_from_config(c.trainer) == loss_fn_lib.make_loss_fn(
        "toy", ToyOptions(), off_policy=corrections.OffPolicyOptions("halve"))
    # An option of the toy set under another loss is refused, naming it (and the reverse).
    with pytest.raises(ValueError, match="trainer.toy_scale=2.0 is an option of loss 'toy'"):
      algorithms.make_options("grpo", {"toy_scale": 2.0})
    with pytest.raises(ValueError, match="trainer.eps_low=0.1 is an option of loss 'grpo'"):
      algorithms.make_options("toy", {"eps_low": 0.1})
    with pytest.raises(ValueError, match="trainer.toy_scale=0"):
      algorithms.make_options("toy", {"toy_scale": 0})

    # Advantages at generation time (numpy in, numpy out).
    options = ToyOptions(toy_shift=0.25, toy_scale=3.0)
    adv = experience.make_advantage_fn("toy", options)(rewards)
    np.testing.assert_allclose(adv, [[0.25, -0.75], [-0.25, -0.25]], rtol=1e-6)
    batch = batch._replace(advantages=adv.reshape(-1).astype(np.float32))

    # make_loss_fn and one jitted, sharded train step with the toy loss and correction.
    loss_fn = loss_fn_lib.make_loss_fn("toy", options,
                                   off_policy=corrections.OffPolicyOptions("halve"))
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    params = jax.jit(transformer.init_params, static_argnums=0)(CFG, jax.random.PRNGKey(0))
    opt = optax.sgd(1.0)
    state = trainer.init_train_state(CFG, opt, jax.random.PRNGKey(1), params=params, mesh=mesh)
    step = trainer.make_train_step(CFG, opt, loss_fn, mesh, trainer.state_shardings(state, mesh),
                                   chunk_size=CHUNK)
    logprob_fn = trainer.make_logprob_fn(CFG, mesh, sharding.param_shardings(params, mesh), CHUNK)
    lp = np.asarray(logprob_fn(params, batch), np.float64)
    _, metrics = step(state, batch)
    metrics = jax.device_get(metrics)

    m = batch.completion_mask > 0
    want = -3.0 * 0.5 * np.sum(np.where(m, adv.reshape(-1)[:, None] * lp, 0.0)) / m.sum()
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["pg_loss"], want, rtol=1e-5, atol=1e-6)
    assert metrics["halve_weight_mean"] == 0.5 and metrics["num_tokens"] == m.sum()
    assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
  assert "toy" not in algorithms.ALGORITHMS and "halve" not in corrections.CORRECTIONS
  with pytest.raises(ValueError, match="loss 'toy' is unknown"):
    loss_fn_lib.make_loss_fn("toy")
  with pytest.raises(ValueError, match="trainer.off_policy='halve'"):
    corrections.OffPolicyOptions("halve")


def test_rows_of_the_table():
  assert set(algorithms.ALGORITHMS) == {"grpo", "asymre"}
  grpo, asymre = algorithms.ALGORITHMS["grpo"], algorithms.ALGORITHMS["asymre"]
  assert (grpo.loss, grpo.advantages) == (losses.grpo_loss, losses.grpo_advantages)
  assert (grpo.clips, grpo.min_group_size, asymre.clips, asymre.min_group_size) == (True, 2, False, 1)
  assert algorithms.option_names("grpo") == ("adv_eps", "adv_std_ddof", "eps_low", "eps_high",
                                             "dual_clip")
  assert algorithms.option_names("asymre") == ("tau",)
  c = defaults.base_config()
  for name in algorithms.ALGORITHMS:  # every option has its config key (its default there)
    for f in dataclasses.fields(algorithms.get(name).options):
      assert c.trainer[f.name] == f.default, (name, f.name)
  c.trainer.loss, c.rollout.group_size = "grpo", 1
  with pytest.raises(ValueError, match="rollout.group_size=1 gives trainer.loss='grpo' zero"):
    validation.validate_config(c)
