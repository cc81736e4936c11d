"""Regime diagnostics, device side (`learner.diagnostics`): the gradient-noise estimates against
direct gradients and Monte Carlo, the off-policy statistics and the update KL against numpy."""
import dataclasses

import chex
import jax
import numpy as np
import pytest

from jaxreplay.data import collate as collate_lib
from jaxreplay.learner import diagnostics
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.models import logprobs as logprobs_lib
from tests.helpers import tolerances
from tests.helpers import trajectories
from tests.helpers.train_batches import CFG, B, T, one_device_setup


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_noise_estimates_are_unbiased_for_unequal_micro_batches(aggregation):
  """Micro-batches of 1, 2 and 5 rollouts (a packed batch's rows) of unequal lengths n_s, under
  each aggregation's noise model (sequence_mean: each rollout's mean gradient G + noise of
  covariance diag(s^2); token_mean: each token's, the batch gradient their mean over all tokens):
  the estimates from the micro-batches' effective rollouts b_i = w_i B equal a float64 solve of the
  two moment equations and average to |G|^2 and tr(Sigma) over many batches, Sigma one mean-length
  rollout's covariance; the equal-size formula (b = B / k) does not."""
  rng = np.random.default_rng(0)
  dim, trials, sizes = 5, 20000, [1, 2, 5]
  big = sum(sizes)
  n = np.array([3.0, 30, 30, 5, 5, 5, 5, 5])  # each rollout's tokens: shares unlike the counts'
  g_true = rng.normal(size=dim)
  scales = rng.uniform(0.5, 2.0, size=dim)
  noise = rng.normal(size=(trials, big, dim)) * scales
  if aggregation == "token_mean":  # a rollout's summed gradient over n_s independent tokens
    summed, v = n[:, None] * g_true + np.sqrt(n)[:, None] * noise, n
    trace_true = np.sum(scales ** 2) / n.mean()  # per token / mean tokens per rollout
  else:  # the rollout's own mean gradient, equally weighted
    summed, v = g_true + noise, np.ones(big)
    trace_true = np.sum(scales ** 2)
  groups = np.split(np.arange(big), np.cumsum(sizes)[:-1])
  mean_of = lambda idx: summed[:, idx].sum(axis=1) / v[idx].sum()
  sq_small = np.mean([np.sum(mean_of(g) ** 2, axis=-1) for g in groups], axis=0)
  sq_big = np.sum(mean_of(np.arange(big)) ** 2, axis=-1)
  b_i = np.array([v[g].sum() / v.sum() * big for g in groups])  # w_i B
  # E mean_i |g_i|^2 = |G|^2 + tr / b_i averaged over i; E |g|^2 = |G|^2 + tr / B
  moments = np.array([[1.0, np.mean(1.0 / b_i)], [1.0, 1.0 / big]])
  want = np.linalg.solve(moments, np.stack([sq_small, sq_big]))
  g2, trace = diagnostics.noise_estimates(sq_small, sq_big, 1.0 / np.mean(1.0 / b_i), big)
  np.testing.assert_allclose(g2, want[0], rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(trace, want[1], rtol=1e-9, atol=1e-9)
  se_g2, se_tr = g2.std() / np.sqrt(trials), trace.std() / np.sqrt(trials)
  assert abs(g2.mean() - np.sum(g_true ** 2)) < 4 * se_g2
  assert abs(trace.mean() - trace_true) < 4 * se_tr
  old_g2, old_tr = diagnostics.noise_estimates(sq_small, sq_big, big / len(sizes), big)
  misses = (abs(old_g2.mean() - np.sum(g_true ** 2)) / (old_g2.std() / np.sqrt(trials)),
            abs(old_tr.mean() - trace_true) / (old_tr.std() / np.sqrt(trials)))
  assert min(misses) > 10, misses  # standard errors


@pytest.fixture(scope="module")
def setup():
  return one_device_setup()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_gradient_norms_equal_direct_gradients(setup, aggregation):
  """grad_sq_big is |grad of the whole batch's loss|^2 and grad_sq_small the mean of each
  micro-batch's own loss gradient norm^2, computed here with jax.grad directly."""
  mesh, params, shardings, batch = setup
  loss_fn = loss_fn_lib.make_loss_fn("grpo", aggregation=aggregation)
  k = 2
  fn = diagnostics.make_diagnostics_fn(CFG, loss_fn, mesh, shardings, splits=k, chunk_size=16)
  got = jax.device_get(fn(params, None, batch))

  def loss_of(p, b, normalizer=None):
    lfn = loss_fn if normalizer is None else dataclasses.replace(loss_fn, normalizer=normalizer)
    lp = logprobs_lib.token_logprobs(CFG, p, b.tokens, b.targets, b.positions, b.segment_ids)
    return lfn(lp, b)[0]

  sq = lambda g: float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(g)))
  lengths = np.asarray(batch.completion_mask).sum(axis=1)  # the last row has no valid tokens
  rows = float(np.sum(lengths > 0))
  norm_big = rows * T if aggregation == "constant" else None
  g_big = jax.grad(loss_of)(params, batch, norm_big)
  smalls, sizes = [], []
  for i in range(k):
    mb = jax.tree.map(lambda x: np.asarray(x)[i::k], batch)
    n = lengths[i::k][lengths[i::k] > 0]
    norm = float(len(n) * T) if aggregation == "constant" else None
    smalls.append(sq(jax.grad(loss_of)(params, mb, norm)))
    sizes.append(n.sum() / lengths.sum() * rows if aggregation == "token_mean" else len(n))
  assert len(set(sizes)) == k  # the micro-batches' sizes differ (4 and 3 rows with tokens)
  want_big, want_small = sq(g_big), float(np.mean(smalls))
  n = T * CFG.vocab_size  # each element sums over tokens and logits
  np.testing.assert_allclose(got["grad_sq_big"], want_big, **tolerances.close(np.float32, n))
  np.testing.assert_allclose(got["grad_sq_small"], want_small, **tolerances.close(np.float32, n))
  assert got["batch_rollouts"] == rows
  np.testing.assert_allclose(got["micro_rollouts"], 1.0 / np.mean(1.0 / np.array(sizes)),
                             rtol=1e-6)


def _rollout_model_logprobs(params, rollouts, seed):
  """The rollouts with behaviour log-probs = the model's own plus noise (policy tokens only)."""
  rng = np.random.default_rng(seed)
  out = []
  for r in rollouts:
    b = collate_lib.collate([r], buckets=(64,))
    lp = np.asarray(logprobs_lib.token_logprobs(CFG, params, b.tokens, b.targets))[0]
    start = len(r.prompt_tokens) - 1
    lp = lp[start:start + len(r.completion_tokens)] + rng.normal(0, 0.3, len(r.completion_tokens))
    mask = np.ones(len(lp)) if r.completion_mask is None else r.completion_mask
    out.append(dataclasses.replace(r, logprobs=(lp * mask).astype(np.float32)))
  return out


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_packed_micro_batches_against_per_rollout_gradients(setup, aggregation):
  """A packed batch (8 rollouts in 3 rows: micro-batches of unequal rollout counts): its gradient
  norms, effective rollouts and noise estimates equal a float64 computation from each rollout's
  gradient in an unpacked batch of its own, grouped as the packed micro-batches hold them."""
  mesh, params, shardings, _ = setup
  rollouts = _rollout_model_logprobs(params, trajectories.mixed_rollouts(seed=5, n=8), seed=1)
  packed = collate_lib.collate(rollouts, buckets=(64,), pack=True, batch_size=8)
  rows, t = packed.tokens.shape
  k = rows
  loss_fn = loss_fn_lib.make_loss_fn("grpo", aggregation=aggregation)
  got = jax.device_get(diagnostics.make_diagnostics_fn(CFG, loss_fn, mesh, shardings, splits=k,
                                                       chunk_size=16)(params, None, packed))
  sum_loss = loss_fn_lib.make_loss_fn("grpo", aggregation="constant", normalizer=1.0)

  def summed_loss(p, b):  # L_s: the rollout's summed token loss
    lp = logprobs_lib.token_logprobs(CFG, p, b.tokens, b.targets, b.positions, b.segment_ids)
    return sum_loss(lp, b)[0]

  flat = lambda g: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g)])
  grads, lengths = [], []
  for r in rollouts:
    b = collate_lib.collate([r], buckets=(64,))
    grads.append(flat(jax.grad(summed_loss)(params, b)))
    lengths.append(float(np.asarray(b.completion_mask).sum()))
  grads, lengths = np.stack(grads), np.array(lengths)
  # which rollouts each packed row holds (a segment's tokens are its prompt + completion)
  seg, tok = np.asarray(packed.segment_ids), np.asarray(packed.tokens)
  full = [np.concatenate([r.prompt_tokens, r.completion_tokens]) for r in rollouts]
  held = [[next(j for j, f in enumerate(full) if np.array_equal(tok[row][seg[row] == s], f))
           for s in sorted(set(seg[row].tolist()) - {0})] for row in range(rows)]
  assert sorted(sum(held, [])) == list(range(8)) and len({len(h) for h in held}) > 1
  y = {"token_mean": grads / lengths[:, None], "sequence_mean": grads / lengths[:, None],
       "constant": grads / t}[aggregation]
  v = lengths if aggregation == "token_mean" else np.ones(8)
  mean_of = lambda idx: v[idx] @ y[idx] / v[idx].sum()
  micro = [sum((held[row] for row in range(i, rows, k)), []) for i in range(k)]
  want = {"grad_sq_small": np.mean([np.sum(mean_of(m) ** 2) for m in micro]),
          "grad_sq_big": np.sum(mean_of(np.arange(8)) ** 2),
          "micro_rollouts": 1.0 / np.mean([v.sum() / (8 * v[m].sum()) for m in micro]),
          "batch_rollouts": 8.0}
  n = t * CFG.vocab_size
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, err_msg=key, **tolerances.close(
        np.float32, n, value))
  g2, trace = diagnostics.noise_estimates(got["grad_sq_small"], got["grad_sq_big"],
                                          got["micro_rollouts"], got["batch_rollouts"])
  want_g2, want_tr = np.linalg.solve(
      [[1.0, 1.0 / want["micro_rollouts"]], [1.0, 1.0 / want["batch_rollouts"]]],
      [want["grad_sq_small"], want["grad_sq_big"]])
  scale = abs(want_tr) / want["batch_rollouts"]  # the terms g2 is the difference of
  np.testing.assert_allclose(g2, want_g2, **tolerances.close(np.float32, n, scale))
  np.testing.assert_allclose(trace, want_tr, **tolerances.close(np.float32, n, abs(want_tr)))


def _np_off_policy(lp, blp, mask, eps=0.2):
  m = mask > 0
  log_r = (lp - blp)[m].astype(np.float64)
  r = np.exp(log_r)
  seq = np.array([np.sum((lp - blp)[i][m[i]]) for i in range(lp.shape[0]) if m[i].any()])
  w = np.exp(seq - seq.max())
  return {"behaviour_kl_k3": np.mean(r - 1 - log_r),
          "ratio_p05": np.quantile(r, 0.05), "ratio_p50": np.quantile(r, 0.5),
          "ratio_p95": np.quantile(r, 0.95),
          "ratio_outside_clip": np.mean((r < 1 - eps) | (r > 1 + eps)),
          "is_ess": w.sum() ** 2 / (len(w) * np.sum(w ** 2))}


class OffPolicyStatsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_against_numpy(self):
    rng = np.random.default_rng(5)
    lp = rng.normal(-2, 1, size=(6, 10)).astype(np.float32)
    blp = (lp + rng.normal(0, 0.3, size=lp.shape)).astype(np.float32)
    mask = (rng.random(lp.shape) < 0.7).astype(np.float32)
    mask[-1] = 0.0  # a row without completion tokens counts for nothing
    got = self.variant(diagnostics.off_policy_stats)(lp, blp, mask)
    want = _np_off_policy(lp, blp, mask)
    for key, value in want.items():
      np.testing.assert_allclose(got[key], value, **tolerances.close(
          np.float32, mask.size, max(abs(value), 1e-3)), err_msg=key)

  @chex.variants(with_jit=True, without_jit=True)
  def test_on_policy_batch(self):
    lp = np.full((3, 4), -1.5, np.float32)
    got = self.variant(diagnostics.off_policy_stats)(lp, lp, np.ones((3, 4), np.float32))
    chex.assert_trees_all_close(got, {"behaviour_kl_k3": 0.0, "ratio_p05": 1.0, "ratio_p50": 1.0,
                                      "ratio_p95": 1.0, "ratio_outside_clip": 0.0, "is_ess": 1.0})


def test_policy_kl_against_numpy():
  rng = np.random.default_rng(2)
  a = jax.nn.log_softmax(rng.normal(size=(2, 3, 7)), axis=-1)
  b = jax.nn.log_softmax(rng.normal(size=(2, 3, 7)), axis=-1)
  mask = np.array([[1, 1, 0], [0, 1, 1]], np.float32)
  pa, pb = np.exp(np.asarray(a, np.float64)), np.exp(np.asarray(b, np.float64))
  per_pos = np.sum(pa * (np.log(pa) - np.log(pb)), axis=-1)
  want = np.sum(per_pos * mask) / mask.sum()
  np.testing.assert_allclose(diagnostics.policy_kl(a, b, mask), want, **tolerances.close(
      np.float32, a.size, want))  # float32 sums over every position's 7 log-probs vs float64
  assert float(diagnostics.policy_kl(a, a, mask)) == pytest.approx(0.0, abs=1e-7)
