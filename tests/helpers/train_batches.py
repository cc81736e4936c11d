"""A small policy and a fixed batch for train-step tests (tests/learner/test_trainer.py, the regime
diagnostics of tests/learner/test_diagnostics.py and tests/run/test_regime.py): rows of different
prompt / completion lengths, right-padded, with behaviour log-probs near the model's own;
`record_grads`, an optax stage placed first in a chain whose state is the raw gradient of the
step (its paths mirror the params, so it is sharded by the same rules)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxreplay.infra import sharding

from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner import losses
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets
from jaxreplay.models import transformer

CFG = presets.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
B, T = 8, 32
# Jitted once (eager op-by-op dispatch of the model costs seconds of test time).
init_params = jax.jit(transformer.init_params, static_argnums=0)


def record_grads() -> optax.GradientTransformation:
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda updates, state, params=None: (updates, updates))


def make_batch(seed: int = 0) -> batch_lib.Batch:
  """Rows of different prompt / completion lengths, right-padded; the last row is all padding."""
  rng = np.random.default_rng(seed)
  tokens = np.zeros((B, T), np.int32)
  positions = np.zeros((B, T), np.int32)
  segment_ids = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B - 1):
    prompt, completion = rng.integers(3, 9), rng.integers(4, 22)
    n = prompt + completion
    tokens[i, :n] = rng.integers(3, CFG.vocab_size, n)
    positions[i, :n] = np.arange(n)
    segment_ids[i, :n] = 1
    mask[i, prompt - 1:n - 1] = 1.0  # targets[t] = tokens[t + 1] is a completion token
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
  rewards = rng.integers(0, 2, (2, 4)).astype(np.float32)
  rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # no group has all-equal rewards
  adv = np.array(losses.grpo_advantages(rewards)).reshape(-1)
  adv[-1] = 0.0
  return batch_lib.Batch(
      tokens=tokens, positions=positions, segment_ids=segment_ids, targets=targets,
      completion_mask=mask, behaviour_logprobs=np.zeros((B, T), np.float32),
      advantages=adv.astype(np.float32), rewards=rewards.reshape(-1),
      policy_version=np.zeros(B, np.int32))


def with_behaviour(batch, logprobs, seed=0):
  """behaviour log-probs = the model's own plus noise, so that ratios vary and some clip."""
  noise = np.random.default_rng(seed).normal(0.0, 0.3, logprobs.shape).astype(np.float32)
  return batch._replace(behaviour_logprobs=np.where(
      batch.completion_mask > 0, logprobs + noise, 0.0).astype(np.float32))


def one_device_setup():
  """(mesh, params, shardings, batch) on one device: the batch's behaviour log-probs are the
  initial policy's plus noise (the regime diagnostics' inputs)."""
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  params = init_params(CFG, jax.random.PRNGKey(3))
  lp = logprobs_lib.token_logprobs(CFG, params, make_batch(0).tokens, make_batch(0).targets)
  batch = with_behaviour(make_batch(0), np.asarray(lp), seed=1)
  shardings = jax.tree.map(lambda x: sharding.replicated(mesh), params)
  return mesh, params, shardings, batch
