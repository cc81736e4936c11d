"""Regime diagnostics of a training batch (device side): gradient noise and off-policyness.

`make_diagnostics_fn(...)(params, ref_params, batch) -> dict of float32 scalars`, jitted, params not
donated, nothing written back: it measures, at the current params and on the batch the next update
will use,

Gradient noise (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", arXiv
1812.06162, App. A). The batch's rows are split into k micro-batches (rows i, i + k, ..., as the
train step splits them); g_i is the gradient of micro-batch i's own loss and g = sum_i w_i g_i the
whole batch's, the train step's gradient (w_i: its micro-batch weights, `_micro_weight`). What each
is, per aggregation (L_s: rollout s's summed token loss, n_s its valid tokens; a rollout is a row,
or a (row, segment) pair of a packed batch; rollouts without valid tokens count for nothing):
  sequence_mean   g_i = mean over its b_i rollouts of y_s = grad(L_s / n_s)
  constant        g_i = mean over its b_i rollouts of y_s = grad(L_s / T) (the micro-batch divides
                  by b_i * T; g by the batch's B * T, rollouts with valid tokens; the train step
                  divides by rows * T unpacked, the same up to a constant factor when the batch
                  has rows without valid tokens: |G|^2 and tr(Sigma) scale by its square, B_simple
                  does not)
  token_mean      g_i = sum_s n_s y_s / sum_s n_s, y_s = grad(L_s / n_s): a token-weighted mean
The noise model, per aggregation: token_mean, each valid token's loss gradient an independent
draw with mean G_tok and covariance Sigma_tok (the score functions of sampled tokens are martingale
differences: a rollout's summed-gradient noise grows with its length), so Cov(g_i) = Sigma_tok / N_i,
N_i the micro-batch's valid tokens; sequence_mean and constant, the y_s independent draws with mean
G and covariance Sigma. Both read: g_i is an unbiased estimate of G with covariance Sigma / b_i,
  b_i = w_i B    (B: the batch's rollouts with valid tokens; w_i = N_i / N for token_mean, the
                  micro-batch's rollouts over B for sequence_mean and constant)
micro-batch i's effective rollouts, its share of the batch gradient times B; for token_mean its
tokens in units of the batch's mean rollout length N / B, and Sigma = Sigma_tok / (N / B) the
covariance of one mean-length rollout's gradient. So, for micro-batches of unequal sizes (packed
rows hold different numbers of rollouts; rollouts differ in length):
  E |g_i|^2 = |G|^2 + tr(Sigma) / b_i          E |g|^2 = |G|^2 + tr(Sigma) / B
  grad_sq_small = mean_i |g_i|^2, micro_rollouts = b = 1 / mean_i (1 / b_i) (the harmonic mean,
  the b with E grad_sq_small = |G|^2 + tr(Sigma) / b; B / k when all are equal),
  grad_sq_big = |g|^2, batch_rollouts = B;
  |G|^2     ~ (B grad_sq_big - b grad_sq_small) / (B - b)            (unbiased)
  tr(Sigma) ~ (grad_sq_small - grad_sq_big) / (1/b - 1/B)           (unbiased)
  B_simple  = tr(Sigma) / |G|^2: the batch size (in rollouts; token_mean's of mean length) at which the gradient noise
              equals the signal. B << B_simple: updates are noise-dominated (sample-limited);
              B >~ B_simple: more updates per sample help (update-limited), where replay can pay.
The means over i leave out micro-batches without valid tokens. Assumed throughout: a rollout's
gradient does not depend on which micro-batch holds it (packing groups rollouts by length).
The ratio of two noisy estimates is smoothed on the host (`run.regime.NoiseScale`: a ratio of
exponential moving averages, as the paper recommends).

Off-policyness of the batch, per valid completion token, r = pi_theta / pi_behaviour (behaviour =
the stored sampler log-probs):
  behaviour_kl_k3   mean of (r - 1) - log r: the k3 estimate of KL(pi_behaviour || pi_theta)
                    (Schulman 2020), >= 0 per token, unbiased with tokens drawn from pi_behaviour
  ratio_p05 / p50 / p95   quantiles of r over valid tokens
  ratio_outside_clip      fraction of valid tokens with r outside [1 - eps_low, 1 + eps_high]
                          (PPO/GRPO's clip range, whatever the loss)
  is_ess            normalised effective sample size of the sequence-level importance weights
                    w_s = exp(sum_t log r): (sum w)^2 / (n sum w^2) in (0, 1]; 1 = on-policy
Cost: one forward + backward over the batch (the micro-batches scanned, one gradient accumulator),
no update; run every `log.diagnostics_every` steps (`run.regime`).

`make_probe_fn(...)(params, probe_batch) -> log-softmax float32 [Bp, T, V]` and
`policy_kl(before, after, mask)`: the exact KL(pi_t || pi_t+1) over the vocabulary between the
policies before and after one update, averaged over the probe's completion tokens: how far one
update moves the policy. Memory: Bp x T x V floats (keep the probe small for large vocabularies).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxreplay.infra import sharding
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import losses
from jaxreplay.learner import trainer
from jaxreplay.learner.batch import Batch
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import transformer

DIAGNOSTIC_KEYS = ("grad_sq_small", "grad_sq_big", "micro_rollouts", "batch_rollouts",
                   "behaviour_kl_k3", "ratio_p05", "ratio_p50", "ratio_p95",
                   "ratio_outside_clip", "is_ess")


def noise_estimates(grad_sq_small, grad_sq_big, b_small, b_big) -> tuple[Any, Any]:
  """(|G|^2, tr(Sigma)) from the squared gradient norms at two batch sizes (McCandlish et al. 2018,
  App. A, eqs. A.2-A.3; the module docstring): both unbiased. Floats or arrays alike (broadcast).

  grad_sq_small: mean over the micro-batches of |g_i|^2; b_small: the harmonic mean of their
  effective rollouts b_i, 1 / mean_i (1 / b_i) (b_i itself when all are equal); grad_sq_big: |g|^2
  of the whole batch of b_big rollouts. Gradient norms^2 in the loss's units squared,
  sizes in rollouts; returns |G|^2 (loss units^2) and tr(Sigma) (loss units^2 x rollouts).
  """
  g2 = (b_big * grad_sq_big - b_small * grad_sq_small) / (b_big - b_small)
  trace = (grad_sq_small - grad_sq_big) / (1.0 / b_small - 1.0 / b_big)
  return g2, trace


def _global_sq(tree: Any) -> jax.Array:
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _micro_weight(aggregation: str, tok, rows, n_tok, n_rows):
  """Micro-batch i's weight w_i in g = sum_i w_i g_i (its own loss's gradient g_i, the module
  docstring): its share of the batch's valid tokens (token_mean) or of its rollouts (sequence_mean;
  constant, whose g_i divides by its own rollouts * T). w_i * B are its effective rollouts."""
  if aggregation == "token_mean":
    return tok / jnp.maximum(n_tok, 1.0)
  return rows / jnp.maximum(n_rows, 1.0)


def off_policy_stats(logprobs, behaviour_logprobs, mask, segment_ids=None, eps_low: float = 0.2,
                     eps_high: float = 0.2) -> dict[str, jax.Array]:
  """The off-policy statistics of the module docstring from per-token log-probs [B, T] (float),
  the stored behaviour log-probs [B, T] and the completion mask [B, T] (segment_ids [B, T] for
  packed rows: sequences are (row, segment) pairs). Returns float32 scalars."""
  m = (mask > 0)
  log_r = jnp.where(m, logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32), 0.0)
  r = jnp.exp(log_r)
  n = jnp.maximum(jnp.sum(m.astype(jnp.float32)), 1.0)
  k3 = jnp.sum(jnp.where(m, r - 1.0 - log_r, 0.0)) / n
  outside = jnp.sum(jnp.where(m & ((r < 1.0 - eps_low) | (r > 1.0 + eps_high)), 1.0, 0.0)) / n
  q = jnp.nanquantile(jnp.where(m, r, jnp.nan), jnp.array([0.05, 0.5, 0.95]))
  seq_log_w = losses.sequence_sums(log_r, segment_ids)           # [B, 1] or [B, T + 1]
  seq_valid = losses.sequence_sums(m.astype(jnp.float32), segment_ids) > 0
  shifted = jnp.where(seq_valid, seq_log_w - jnp.max(jnp.where(seq_valid, seq_log_w, -jnp.inf)),
                      -jnp.inf)
  w = jnp.exp(shifted)
  n_seq = jnp.maximum(jnp.sum(seq_valid.astype(jnp.float32)), 1.0)
  ess = jnp.square(jnp.sum(w)) / jnp.maximum(n_seq * jnp.sum(jnp.square(w)), 1e-30)
  return {"behaviour_kl_k3": k3, "ratio_p05": q[0], "ratio_p50": q[1], "ratio_p95": q[2],
          "ratio_outside_clip": outside, "is_ess": ess}


def make_diagnostics_fn(model_cfg, loss_fn: loss_fn_lib.LossFn, mesh: Mesh, param_shardings: Any,
                        splits: int = 4, chunk_size: int = 512, logprob_remat: str = "auto",
                        logprob_processing=None, lora=None):
  """Jitted `fn(params, ref_params, batch) -> {DIAGNOSTIC_KEYS: float32 scalar}` (module docstring).

  splits: k micro-batches (>= 2); the batch's rows must be a multiple of k * data * fsdp.
  ref_params: the KL reference (None unless loss_fn.needs_ref).
  logprob_processing: the train step's (`trainer.logprob_processing`): the same log-probs as the
    update, so the ratios are those the loss sees.
  lora: an `adapters.FrozenBase` (LoRA: `params` are its adapters, the gradients and the noise scale
    those of the adapters the optimizer updates; the KL reference is the base), or None.
  """
  if splits < 2:
    raise ValueError(f"splits={splits}: the noise scale needs >= 2 micro-batches")
  options = loss_fn.options
  eps_low = float(getattr(options, "eps_low", 0.2))
  eps_high = float(getattr(options, "eps_high", 0.2))
  k = int(splits)
  multiple = sharding.batch_size_multiple(mesh)

  def micro_loss(params, ref_params, mb: Batch, lfn, base):
    lp = logprobs_lib.token_logprobs(model_cfg, trainer._model_params(lora, params, base),  # pylint: disable=protected-access
                                     mb.tokens, mb.targets, mb.positions,
                                     mb.segment_ids, chunk_size=chunk_size, remat=logprob_remat,
                                     processing=logprob_processing,
                                     single_sequence_rows=not mb.packed)
    ref_lp = None
    if ref_params is not None:
      ref_lp = jax.lax.stop_gradient(logprobs_lib.token_logprobs(
          model_cfg, ref_params, mb.tokens, mb.targets, mb.positions, mb.segment_ids,
          chunk_size=chunk_size, processing=logprob_processing,
          single_sequence_rows=not mb.packed))
    loss, _ = lfn(lp, mb, ref_lp) if ref_params is not None else lfn(lp, mb)
    return loss, lp

  def fn(params, ref_params, batch: Batch, base=None):
    if lora is not None and needs_ref:  # the initial policy is the base itself
      ref_params = base
    b, t = batch.tokens.shape
    if b % (k * multiple):
      raise ValueError(f"diagnostics: batch of {b} rows must be a multiple of splits * data * fsdp "
                       f"= {k} * {multiple}; set log.diagnostics_splits accordingly")
    n_tok, n_rows = trainer._counts(batch)  # pylint: disable=protected-access
    mbs = trainer._split_microbatches(batch, k, mesh)  # pylint: disable=protected-access
    # The accumulator is sharded like the params (unconstrained, XLA:GPU kept a replicated f32
    # copy of the model: +30 GiB per device for Qwen3-8B at T=3, `run.gpu_compile` measured).
    zeros = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(
        jnp.zeros(p.shape, jnp.float32), s), params, param_shardings)

    def body(grad_sum, mb):
      tok, rows = trainer._counts(mb)  # pylint: disable=protected-access
      lfn = loss_fn
      if loss_fn.aggregation == "constant":  # the micro-batch's own mean, as an estimate of G
        lfn = dataclasses.replace(loss_fn, normalizer=jnp.maximum(rows, 1.0) * t)
      (_, lp), g = jax.value_and_grad(micro_loss, has_aux=True)(params, ref_params, mb, lfn,
                                                                 base)
      w = _micro_weight(loss_fn.aggregation, tok, rows, n_tok, n_rows)
      grad_sum = jax.tree.map(lambda a, x: a + w * x.astype(jnp.float32), grad_sum, g)
      return grad_sum, (lp, _global_sq(g), w * n_rows)

    grad_sum, (lp_k, sq_k, b_k) = jax.lax.scan(body, zeros, mbs)
    lp = lp_k.swapaxes(0, 1).reshape((b,) + lp_k.shape[2:])  # rows back in batch order
    stats = off_policy_stats(lp, batch.behaviour_logprobs, batch.completion_mask,
                             batch.segment_ids if batch.packed else None, eps_low, eps_high)
    used = b_k > 0  # micro-batches with valid tokens
    n_used = jnp.maximum(jnp.sum(used.astype(jnp.float32)), 1.0)
    inv_b = jnp.sum(jnp.where(used, 1.0 / jnp.where(used, b_k, 1.0), 0.0)) / n_used
    out = {"grad_sq_small": jnp.sum(jnp.where(used, sq_k, 0.0)) / n_used,
           "grad_sq_big": _global_sq(grad_sum),
           "micro_rollouts": jnp.where(inv_b > 0, 1.0 / jnp.where(inv_b > 0, inv_b, 1.0), 0.0),
           "batch_rollouts": n_rows,
           **stats}
    return {key: jnp.asarray(v, jnp.float32) for key, v in out.items()}

  batch_sh = NamedSharding(mesh, P(sharding.batch_axes(mesh)))
  needs_ref = loss_fn.needs_ref
  ref_sh = param_shardings if needs_ref and lora is None else None
  in_shardings = (param_shardings, ref_sh, batch_sh) + (() if lora is None else (lora.shardings,))
  jitted = jax.jit(sharding.under_mesh(fn, mesh), in_shardings=in_shardings,
                   out_shardings=sharding.replicated(mesh))

  def args(params, ref_params, batch):
    ref_params = ref_params if needs_ref and lora is None else None
    return (params, ref_params, batch) + (() if lora is None else (lora.params,))

  def call(params, ref_params, batch):
    if jax.process_count() > 1:
      batch = sharding.global_batch(batch, mesh)
    return jitted(*args(params, ref_params, batch))
  call.lower = lambda params, ref_params, batch: jitted.lower(*args(params, ref_params, batch))
  return call


def make_probe_fn(model_cfg, mesh: Mesh, param_shardings: Any, lora=None):
  """Jitted `fn(params, batch) -> log-softmax float32 [B, T, V]` of the next-token distributions
  (unpadded vocabulary) at every position of `batch` (a small, fixed probe); with `lora` (an
  `adapters.FrozenBase`) `params` are its adapters."""

  def fn(params, batch: Batch, base=None):
    logits = transformer.apply(model_cfg, trainer._model_params(lora, params, base),  # pylint: disable=protected-access
                               batch.tokens, batch.positions, batch.segment_ids)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

  in_shardings = (param_shardings, None) + (() if lora is None else (lora.shardings,))
  jitted = jax.jit(sharding.under_mesh(fn, mesh), in_shardings=in_shardings,
                   out_shardings=sharding.replicated(mesh))
  return jitted if lora is None else trainer._bind_base(jitted, lora)  # pylint: disable=protected-access


@jax.jit
def policy_kl(before: jax.Array, after: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean over valid positions of KL(p_before || p_after) = sum_v p_b (log p_b - log p_a):
  before, after log-softmax float32 [B, T, V]; mask [B, T]. float32 scalar (>= 0)."""
  per_pos = jnp.sum(jnp.exp(before) * (before - after), axis=-1)
  m = (mask > 0).astype(jnp.float32)
  return jnp.sum(per_pos * m) / jnp.maximum(jnp.sum(m), 1.0)
