"""GRPO and AsymRE advantages and losses, and the KL (k3) penalty.

Pure functions of arrays and scalars, in the style of optax / rlax: small blocks (`aggregate`,
`k3_kl`, `clipped_surrogate`, `dual_clip_bound`) composed into the two losses. Every computation
runs in float32, whatever the input dtype (bfloat16 log-probs give a float32 loss). Importance
weights and masks of stale or mismatched rollouts (truncated IS included) are off-policy
corrections (`jaxreplay.learner.corrections`): a loss takes them as `token_weights` (and, when it
clips a ratio, `proximal_logprobs`), its one importance-weight path.

Every loss takes the same keyword arguments, which `algorithms.loss` passes: logprobs,
behaviour_logprobs, advantages, mask, aggregation, normalizer, ref_logprobs, kl_coef, segment_ids,
token_weights (when a correction weights tokens), proximal_logprobs (to a loss that clips a ratio,
when the correction has them), kl_clamp (when set), and its own options (`algorithms`' options
dataclass, `loss_args()`).

Shapes: B rows (one rollout each), T tokens, P prompts, G responses per prompt.
  logprobs, behaviour_logprobs, ref_logprobs  float [B, T]  nats, aligned with targets
  proximal_logprobs, token_weights            float [B, T]  no gradient (a correction's)
  mask                                        {0, 1} [B, T] 1 on completion tokens
  advantages                                  float [B], or [B, T] per token
  segment_ids                                 int [B, T] or None (see below)
  rewards                                     float or int [P, G]
Padding positions (mask 0) may hold any finite or non-finite value: they are replaced by 0 before
any arithmetic, so they contribute nothing to the loss, its gradient or the statistics.
Sequences: with segment_ids None each row is one sequence (rollout); with segment_ids (packed rows,
`jaxreplay.learner.batch`) each (row, nonzero segment id) pair is one. Per-sequence statistics
("sequence_mean", advantage_mean, the "row_mean" kind) count sequences with >= 1 valid token.

References:
  GRPO: Shao et al., "DeepSeekMath", arXiv 2402.03300, eq. (3) and section 4.1.2.
  Clip-higher (eps_low != eps_high): Yu et al., "DAPO", arXiv 2503.14476, section 3.1.
  Constant normaliser: Liu et al., "Understanding R1-Zero-Like Training" (Dr. GRPO), arXiv 2503.20783.
  AsymRE: Arnal et al., "Asymmetric REINFORCE for off-Policy RL", arXiv 2506.20520.
  k3 KL estimator: J. Schulman, "Approximating KL Divergence" (2020); used by GRPO, arXiv 2402.03300 eq. (4).
  Dual clip: Ye et al., "Mastering Complex Control in MOBA Games with Deep RL", arXiv 1912.09729
    (dual-clip PPO), as verl's `compute_policy_loss` (clip_ratio_c = 3).
Conventions checked against TRL's and verl's formulas (tests/learner/test_losses.py,
`ConventionsTest`): TRL and verl standardise group rewards with the sample std (ddof 1),
jaxreplay with the population std by default (ddof 0, `trainer.adv_std_ddof`); verl clamps k3 at
10 (`trainer.kl_clamp`) and bounds negative-advantage tokens by its dual clip (`trainer.dual_clip`).
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Optional, Union

import chex
import jax
import jax.numpy as jnp

Array = chex.Array
Scalar = Union[float, int, Array]

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
KL_LOG_RATIO_CLIP = 20.0  # verl's low_var_kl clips ref - lp to [-20, 20] before its k3 clamp

# How each statistic in a loss's aux combines over the micro-batches of one train step (gradient
# accumulation in `trainer.make_train_step`) into the value of the whole batch:
#   "sum"         summed (counts)
#   "max"         the maximum
#   "token_mean"  weighted by valid tokens (means over valid tokens)
#   "row_mean"    weighted by sequences (rows, or packed segments) with at least one valid token
#   "loss"        weighted like the loss, per its aggregation (see `aggregate`)
# Every key a loss returns must be declared here: the train step refuses an undeclared one rather
# than guess.
AUX_KIND_NAMES = ("sum", "max", "token_mean", "row_mean", "loss")
AUX_KINDS: dict[str, str] = {
    "num_tokens": "sum",
    "advantage_mean": "row_mean",
    "entropy_proxy": "token_mean",
    "pg_loss": "loss",
    "clip_fraction": "token_mean",
    "ratio_mean": "token_mean",
    "ratio_max": "max",
    "kl": "token_mean",
    "dual_clip_fraction": "token_mean",
}
# (The off-policy corrections declare their statistics' kinds in their rows of
# `corrections.CORRECTIONS`.)


class LossInputError(ValueError, AssertionError):
  """A loss input has the wrong rank, shape or dtype.

  Subclasses ValueError (the project's convention for bad input) and AssertionError (what chex's
  assertions raise), so either `except` clause catches it.
  """


@contextlib.contextmanager
def _checking(fn_name: str):
  try:
    yield
  except AssertionError as e:
    raise LossInputError(f"{fn_name}: {e}") from e


def _is_python_number(x) -> bool:
  return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _assert_numeric(x: Array, name: str):
  dtype = jnp.asarray(x).dtype
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
          or dtype == jnp.bool_):
    raise AssertionError(f"{name} has dtype {dtype}; expected a float, int or bool array")


def _f32(x: Array) -> Array:
  return jnp.asarray(x).astype(jnp.float32)


def _masked_mean(x: Array, mask: Array) -> Array:
  """sum(x * mask) / max(sum(mask), 1): the mean over valid entries, 0 when there are none."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sequence_sums(x: Array, segment_ids: Optional[Array] = None) -> Array:
  """Per-sequence sums of x [B, T]: float32 [B, 1] (segment_ids None: a row is a sequence) or
  [B, T + 1] (entry s of row b sums the tokens of segment s; ids outside [0, T] are clipped)."""
  x = _f32(x)
  if segment_ids is None:
    return jnp.sum(x, axis=1, keepdims=True)
  t = x.shape[1]
  seg = jnp.clip(jnp.asarray(segment_ids).astype(jnp.int32), 0, t)
  return jax.vmap(lambda xr, sr: jax.ops.segment_sum(xr, sr, num_segments=t + 1))(x, seg)


def sequence_means(x: Array, mask: Array, segment_ids: Optional[Array] = None):
  """(means, valid): each sequence's mean of x over its valid tokens (0 without any) and whether it
  has one, both float32 [B, 1] or [B, T + 1] (see `sequence_sums`); masked x is zeroed first."""
  m = _f32(mask)
  counts = sequence_sums(m, segment_ids)
  sums = sequence_sums(jnp.where(m > 0, _f32(x), 0.0) * m, segment_ids)
  return sums / jnp.maximum(counts, 1.0), (counts > 0).astype(jnp.float32)


def num_sequences(mask: Array, segment_ids: Optional[Array] = None) -> Array:
  """float32 scalar: sequences (rows, or (row, segment) pairs) with >= 1 valid token in mask."""
  return jnp.sum((sequence_sums((_f32(mask) > 0).astype(jnp.float32), segment_ids) > 0)
                 .astype(jnp.float32))


# ------------------------------------------------------------------------------------- advantages


def grpo_advantages(rewards: Array, eps: float = 1e-6, ddof: int = 0) -> Array:
  """Group-normalised advantages of GRPO (arXiv 2402.03300, section 4.1.2).

    A_{p,i} = (r_{p,i} - mean_i r_{p,:}) / (std_i r_{p,:} + eps),
    std^2   = sum_i (r_{p,i} - mean)^2 / (G - ddof).

  ddof 0 (the population std) is jaxreplay's default; TRL's GRPOTrainer and verl's GRPO
  advantage use the sample std (torch.std: ddof 1), which scales every advantage by
  sqrt(G / (G - 1)) (x1.069 at G = 8) up to eps.
  A group whose rewards are all equal (including a group of size 1) gets A = 0 exactly: it carries
  no learning signal, and the float rounding of mean/std cannot turn it into noise or NaN.

  Args:
    rewards: float or int [P, G], one row per prompt, one column per response.
    eps: added to the standard deviation.
    ddof: 0 or 1, the std's delta degrees of freedom (a Python int).

  Returns:
    float32 [P, G].
  """
  with _checking("grpo_advantages"):
    chex.assert_rank(rewards, 2)
    _assert_numeric(rewards, "rewards")
  if ddof not in (0, 1):
    raise ValueError(f"ddof={ddof}: expected 0 (population std) or 1 (sample std, TRL / verl)")
  r = _f32(rewards)
  mean = jnp.mean(r, axis=1, keepdims=True)
  std = jnp.std(r, axis=1, keepdims=True, ddof=ddof)
  all_equal = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
  return jnp.where(all_equal, 0.0, (r - mean) / (std + eps))


def asymre_advantages(rewards: Array, tau: Scalar = -0.1) -> Array:
  """Advantages of Asymmetric REINFORCE (arXiv 2506.20520): A = r - V with V = mean_group(r) + tau.

    A_{p,i} = r_{p,i} - (mean_i r_{p,:} + tau)     for G > 1,
    A_{p,1} = r_{p,1} - tau                         for G = 1 (no group: the baseline is tau alone).

  tau < 0 keeps the baseline V below the behaviour policy's value, which is what guarantees
  improvement off-policy; tau >= 0 risks support collapse (arXiv 2506.20520, section 3).

  Args:
    rewards: float or int [P, G].
    tau: the baseline shift.

  Returns:
    float32 [P, G].
  """
  with _checking("asymre_advantages"):
    chex.assert_rank(rewards, 2)
    _assert_numeric(rewards, "rewards")
  r = _f32(rewards)
  tau = jnp.asarray(tau, jnp.float32)
  if r.shape[1] == 1:
    return r - tau
  return r - (jnp.mean(r, axis=1, keepdims=True) + tau)


# ---------------------------------------------------------------------------------- building blocks


def aggregate(per_token: Array, mask: Array, aggregation: str,
              normalizer: Optional[Scalar] = None,
              segment_ids: Optional[Array] = None) -> Array:
  """Reduces a per-token quantity x [B, T] to a float32 scalar over the valid tokens (mask > 0).

    "token_mean":    sum_{b,t} m x / sum_{b,t} m                   (every valid token weighs the same)
    "sequence_mean": mean over sequences with sum m > 0 of (their sum m x / sum m)
                     (every sequence the same; a sequence is a row, or a packed segment)
    "constant":      sum_{b,t} m x / normalizer, normalizer = B * T by default
                     (length-unbiased, as in Dr. GRPO, arXiv 2503.20783).

  Rows without valid tokens contribute nothing and are not counted by "sequence_mean". An all-zero
  mask gives 0. Masked positions are zeroed before the sum, so NaN or inf there does not leak.

  Args:
    per_token: float [B, T].
    mask: {0, 1} [B, T] (float, int or bool).
    aggregation: one of AGGREGATIONS.
    normalizer: only with "constant": the divisor, instead of B * T (e.g. B * max_tokens).
    segment_ids: int [B, T] of packed rows, or None (each row one sequence); "sequence_mean" only.

  Returns:
    float32 scalar.
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {aggregation!r}; valid choices: {AGGREGATIONS}")
  if normalizer is not None and aggregation != "constant":
    raise ValueError(f"normalizer is only used with aggregation='constant', got {aggregation!r}")
  if _is_python_number(normalizer) and not normalizer > 0:
    raise ValueError(f"normalizer must be > 0, got {normalizer}")
  with _checking("aggregate"):
    chex.assert_rank([per_token, mask], 2)
    chex.assert_equal_shape([per_token, mask])
    chex.assert_type(per_token, float)
    _assert_numeric(mask, "mask")
  m = _f32(mask)
  x = jnp.where(m > 0, _f32(per_token), 0.0) * m
  if aggregation == "token_mean":
    return jnp.sum(x) / jnp.maximum(jnp.sum(m), 1.0)
  if aggregation == "sequence_mean" and segment_ids is not None:
    means, valid = sequence_means(per_token, m, segment_ids)
    return jnp.sum(means * valid) / jnp.maximum(jnp.sum(valid), 1.0)
  if aggregation == "sequence_mean":
    row_count = jnp.sum(m, axis=1)
    row_mean = jnp.sum(x, axis=1) / jnp.maximum(row_count, 1.0)
    row_valid = (row_count > 0).astype(jnp.float32)
    return jnp.sum(row_mean * row_valid) / jnp.maximum(jnp.sum(row_valid), 1.0)
  if normalizer is None:
    normalizer = x.shape[0] * x.shape[1]
  return jnp.sum(x) / jnp.asarray(normalizer, jnp.float32)


def k3_kl(logprobs: Array, ref_logprobs: Array, clamp: Scalar = 0.0) -> Array:
  """Per-token k3 estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    k3 = exp(ref - lp) - (ref - lp) - 1  >= 0,
  unbiased for the KL when tokens come from pi_theta, with low variance (Schulman 2020; GRPO,
  arXiv 2402.03300 eq. 4). Gradients flow through `logprobs`: d k3 / d lp = 1 - exp(ref - lp).

  clamp = K > 0 is verl's `low_var_kl`: the log-ratio ref - lp clipped to [-20, 20] before the
  exp, then k3 clipped to [-K, K] (k3 >= 0, so at most K; verl's K = 10). Where a clip binds the
  token's k3 has no gradient. 0 (default): no clamp, the formula above exactly.

  Args:
    logprobs: float [B, T], log pi_theta of the sampled tokens.
    ref_logprobs: float [B, T], log pi_ref of the same tokens.
    clamp: K >= 0 (a Python number), 0 = off.

  Returns:
    float32 [B, T].
  """
  if _is_python_number(clamp) and not clamp >= 0:
    raise ValueError(f"kl_clamp must be >= 0 (0 is off, verl clamps k3 at 10), got {clamp}")
  with _checking("k3_kl"):
    chex.assert_rank([logprobs, ref_logprobs], 2)
    chex.assert_equal_shape([logprobs, ref_logprobs])
    chex.assert_type([logprobs, ref_logprobs], float)
  d = _f32(ref_logprobs) - _f32(logprobs)
  if not clamp:
    return jnp.exp(d) - d - 1.0
  d = jnp.clip(d, -KL_LOG_RATIO_CLIP, KL_LOG_RATIO_CLIP)
  return jnp.clip(jnp.exp(d) - d - 1.0, -clamp, clamp)


def clipped_surrogate(ratio: Array, advantages: Array, eps_low: Scalar = 0.2,
                      eps_high: Scalar = 0.2) -> tuple[Array, Array]:
  """The clipped PPO / GRPO surrogate per token (arXiv 2402.03300 eq. 3; clip-higher, arXiv 2503.14476).

    objective = min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A).

  Its gradient wrt rho is A where the unclipped term is the active minimum and 0 where the clipped
  term is (then rho lies outside the clip range on the side that would increase the objective).

  Args:
    ratio: float [B, T], rho = pi_theta / pi_old per token.
    advantages: float [B] (one per row) or [B, T].
    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high].

  Returns:
    (objective float32 [B, T], clipped bool [B, T]): clipped is True where the clipped term is
    strictly smaller, i.e. where clipping changed the objective.
  """
  with _checking("clipped_surrogate"):
    chex.assert_rank(ratio, 2)
    chex.assert_rank(advantages, {1, 2})
    chex.assert_type([ratio, advantages], float)
    if jnp.ndim(advantages) == 1:
      chex.assert_shape(advantages, (ratio.shape[0],))
    else:
      chex.assert_equal_shape([ratio, advantages])
  rho = _f32(ratio)
  adv = _f32(advantages)
  if adv.ndim == 1:
    adv = adv[:, None]
  unclipped = rho * adv
  clipped = jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high) * adv
  return jnp.minimum(unclipped, clipped), clipped < unclipped


def dual_clip_bound(objective: Array, advantages: Array, dual_clip: Scalar) -> tuple[Array, Array]:
  """Dual-clip PPO (arXiv 1912.09729; verl's `compute_policy_loss`, clip_ratio_c): on tokens with a
  negative advantage the clipped objective is bounded below by c * A,

    objective' = max(objective, c * A)   where A < 0,   objective elsewhere,

  so a ratio far above 1 on a bad token cannot make the loss (and its gradient) unbounded: where
  the bound binds, the token has no gradient.

  Args:
    objective: float [B, T], `clipped_surrogate`'s objective.
    advantages: float [B] or [B, T], as for `clipped_surrogate`.
    dual_clip: c > 1 (verl's default 3).

  Returns:
    (objective' float32 [B, T], bound bool [B, T]: True where c * A is the larger, with A < 0).
  """
  if _is_python_number(dual_clip) and not dual_clip > 1:
    raise ValueError(f"dual_clip must be > 1 (verl: 3), got {dual_clip}")
  adv = _f32(advantages)
  if adv.ndim == 1:
    adv = adv[:, None]
  bound = jnp.asarray(dual_clip, jnp.float32) * adv
  binds = (adv < 0) & (bound > objective)
  return jnp.where(adv < 0, jnp.maximum(objective, bound), objective), binds


# ------------------------------------------------------------------------------------------ losses


def _check_token_inputs(fn_name, advantages, token_arrays):
  """Checks each [B, T] array (a dict name -> array or None, "logprobs" first), advantages [B] or
  [B, T] (packed rows: per token) and segment_ids (int [B, T] or None)."""
  shape = jnp.shape(token_arrays["logprobs"])
  for name, a in token_arrays.items():
    if a is None:
      continue
    with _checking(f"{fn_name}, argument {name!r}"):
      chex.assert_rank(a, 2)
      chex.assert_shape(a, shape)
      if name == "mask":
        _assert_numeric(a, name)
      elif name == "segment_ids":
        chex.assert_type(a, int)
      else:
        chex.assert_type(a, float)
  with _checking(f"{fn_name}, argument 'advantages' (one per row, or per token [B, T])"):
    chex.assert_rank(advantages, {1, 2})
    chex.assert_shape(advantages, shape[:jnp.ndim(advantages)])
    chex.assert_type(advantages, float)


def _check_kl_args(ref_logprobs, kl_coef):
  if ref_logprobs is None and not (_is_python_number(kl_coef) and kl_coef == 0):
    raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference policy's log-probs [B, T])")


def _common_aux(lp, adv, m, pg_per_token, aggregation, normalizer, segment_ids=None):
  if adv.ndim == 1 and segment_ids is None:
    row_valid = (jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    advantage_mean = jnp.sum(adv * row_valid) / jnp.maximum(jnp.sum(row_valid), 1.0)
  else:  # per-token advantages / packed rows: each sequence's advantage, averaged over sequences
    adv_tokens = jnp.broadcast_to(adv[:, None], m.shape) if adv.ndim == 1 else adv
    means, valid = sequence_means(adv_tokens, m, segment_ids)
    advantage_mean = jnp.sum(means * valid) / jnp.maximum(jnp.sum(valid), 1.0)
  return {
      "num_tokens": jnp.sum(m),
      "advantage_mean": advantage_mean,
      "entropy_proxy": _masked_mean(-lp, m),
      "pg_loss": aggregate(pg_per_token, m, aggregation, normalizer, segment_ids),
  }


def _ratio_aux(ratio, m):
  return {"ratio_mean": _masked_mean(ratio, m),
          "ratio_max": jnp.max(jnp.where(m > 0, ratio, 0.0))}


def _kl_term(lp, ref_logprobs, kl_coef, kl_clamp, m, aux):
  """Adds the k3 statistic to aux and returns kl_coef * k3 per token (k3 clamped by kl_clamp)."""
  kl = k3_kl(lp, jnp.where(m > 0, _f32(ref_logprobs), 0.0), kl_clamp)
  aux["kl"] = _masked_mean(kl, m)
  return jnp.asarray(kl_coef, jnp.float32) * kl


def _token_weights(token_weights, valid):
  """A correction's weights, no gradient, 0 on padding; None stays None (weight 1)."""
  if token_weights is None:
    return None
  return jnp.where(valid, jax.lax.stop_gradient(_f32(token_weights)), 0.0)


def grpo_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array,
              eps_low: Scalar = 0.2, eps_high: Scalar = 0.2, aggregation: str = "token_mean", *,
              normalizer: Optional[Scalar] = None, ref_logprobs: Optional[Array] = None,
              kl_coef: Scalar = 0.0, kl_clamp: Scalar = 0.0, dual_clip: Optional[Scalar] = 0.0,
              proximal_logprobs: Optional[Array] = None, token_weights: Optional[Array] = None,
              segment_ids: Optional[Array] = None) -> tuple[Array, dict[str, Array]]:
  """The GRPO loss (arXiv 2402.03300 eq. 3) with clip-higher (arXiv 2503.14476), optional KL,
  optional dual clip and an off-policy correction's weights.

    rho_{b,t}  = exp(lp_{b,t} - old_{b,t}),  old = proximal_logprobs if given, else behaviour_logprobs
    obj_{b,t}  = w_{b,t} * min(rho A_b, clip(rho, 1 - eps_low, 1 + eps_high) A_b)
    loss_{b,t} = -obj_{b,t} + kl_coef * k3(lp_{b,t}, ref_{b,t})
    loss       = aggregate(loss_{b,t}, mask, aggregation, normalizer)
  with w = token_weights (1 when None): the one importance-weight path. An off-policy correction
  (`jaxreplay.learner.corrections`) computes w and pi_old: truncated IS ("tis") passes
  w = min(pi_theta / pi_sampler, C) and old = stop_gradient(lp), so the clip acts on the trainer's
  own ratio (1 in value) and the gradient is -w A grad log pi_theta; the masks pass w in {0, 1}.
  With dual_clip = c > 1 the min(...) of a token with A < 0 is further bounded below by c * A
  (`dual_clip_bound`, before w multiplies it).

  Args:
    logprobs: float [B, T], log pi_theta(target_t) under the parameters being trained (gradients flow).
    behaviour_logprobs: float [B, T], the sampler's log-probs of the same tokens, stored with the
      rollout (Batch.behaviour_logprobs).
    advantages: float [B], one per row (e.g. grpo_advantages flattened), or [B, T] per token
      (packed rows: each token carries its rollout's advantage).
    mask: {0, 1} [B, T], 1 on completion tokens.
    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (paper: 0.2 and 0.2).
    aggregation: "token_mean" | "sequence_mean" | "constant" (see `aggregate`).
    normalizer: the divisor for "constant" (default B * T).
    ref_logprobs: float [B, T], log-probs of the reference policy, for the KL penalty and the "kl"
      statistic; None for neither.
    kl_coef: weight of the k3 KL penalty (needs ref_logprobs when nonzero).
    kl_clamp: K > 0 clamps k3 as verl does (`k3_kl`); 0 is off.
    dual_clip: c > 1 turns on the dual clip (verl: 3); 0 or None is off (a Python number).
    proximal_logprobs: float [B, T], no gradient: the clip's denominator pi_old instead of the
      behaviour log-probs (a correction's proximal policy).
    token_weights: float [B, T], no gradient: multiplies each token's clipped objective (an
      off-policy correction's weights or {0, 1} mask). The aggregation's denominators do not
      change (a weight-0 token counts, with zero gradient).
    segment_ids: int [B, T] for packed rows (each (row, segment) a sequence for "sequence_mean"
      and advantage_mean), or None: each row is one sequence.

  Returns:
    (loss float32 scalar, aux dict of float32 scalars):
      num_tokens, advantage_mean (over rows with valid tokens), entropy_proxy (mean of -lp over
      valid tokens: the sampled-token entropy estimate), pg_loss (the aggregated -obj),
      clip_fraction (fraction of valid tokens where the clipped term is the active minimum),
      ratio_mean, ratio_max (over valid tokens, 0 when there are none), kl (token mean of k3, when
      ref_logprobs is given), dual_clip_fraction (with the dual clip: the fraction of valid tokens
      where c * A binds); `AUX_KINDS` says how each combines over micro-batches.
  """
  _check_kl_args(ref_logprobs, kl_coef)
  for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
    if _is_python_number(eps) and not 0 <= eps:
      raise ValueError(f"{name} must be >= 0, got {eps}")
  _check_token_inputs("grpo_loss", advantages, {
      "logprobs": logprobs, "behaviour_logprobs": behaviour_logprobs, "mask": mask,
      "ref_logprobs": ref_logprobs, "proximal_logprobs": proximal_logprobs,
      "token_weights": token_weights, "segment_ids": segment_ids})
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {aggregation!r}; valid choices: {AGGREGATIONS}")
  m = _f32(mask)
  valid = m > 0
  # Zero the padding before any exp, so that garbage there cannot produce inf / NaN gradients.
  lp = jnp.where(valid, _f32(logprobs), 0.0)
  old = jnp.where(valid, _f32(behaviour_logprobs), 0.0)
  if proximal_logprobs is not None:
    old = jnp.where(valid, jax.lax.stop_gradient(_f32(proximal_logprobs)), 0.0)
  adv = _f32(advantages)
  if adv.ndim == 2:
    adv = jnp.where(valid, adv, 0.0)

  aux = {}
  ratio = jnp.exp(lp - old)
  objective, clipped = clipped_surrogate(ratio, adv, eps_low, eps_high)
  if dual_clip:
    objective, bound = dual_clip_bound(objective, adv, dual_clip)
    aux["dual_clip_fraction"] = _masked_mean(bound.astype(jnp.float32), m)
  w = _token_weights(token_weights, valid)
  if w is not None:
    objective = w * objective
  per_token = -objective
  if ref_logprobs is not None:
    per_token = per_token + _kl_term(lp, ref_logprobs, kl_coef, kl_clamp, m, aux)
  loss = aggregate(per_token, m, aggregation, normalizer, segment_ids)

  aux.update(_common_aux(lp, adv, m, -objective, aggregation, normalizer, segment_ids))
  aux.update(_ratio_aux(ratio, m))
  aux["clip_fraction"] = _masked_mean(clipped.astype(jnp.float32), m)
  return loss, jax.lax.stop_gradient(aux)


def asymre_loss(logprobs: Array, advantages: Array, mask: Array, aggregation: str = "token_mean", *,
                normalizer: Optional[Scalar] = None, ref_logprobs: Optional[Array] = None,
                kl_coef: Scalar = 0.0, kl_clamp: Scalar = 0.0,
                behaviour_logprobs: Optional[Array] = None,
                token_weights: Optional[Array] = None,
                segment_ids: Optional[Array] = None) -> tuple[Array, dict[str, Array]]:
  """The Asymmetric REINFORCE loss (arXiv 2506.20520): REINFORCE with a shifted baseline, no ratio.

    loss_{b,t} = -A_b * lp_{b,t} + kl_coef * k3(lp_{b,t}, ref_{b,t})
    loss       = aggregate(loss_{b,t}, mask, aggregation, normalizer)
  i.e. the gradient of J = E_{y ~ behaviour}[log pi_theta(y) (r(y) - V)] with A = r - V from
  `asymre_advantages`. Samples come from the behaviour policy and are used as they are: there is no
  importance ratio, hence no clipping (the objective never refers to pi_old). An off-policy
  correction (`jaxreplay.learner.corrections`) may weight or mask each token's term:
    loss_{b,t} = -w_{b,t} A_b lp_{b,t} + kl_coef * k3,   w = token_weights (1 when None).

  Args:
    logprobs: float [B, T], log pi_theta(target_t) under the parameters being trained.
    advantages: float [B], or [B, T] per token (packed rows).
    mask: {0, 1} [B, T], 1 on completion tokens.
    aggregation: "token_mean" | "sequence_mean" | "constant" (see `aggregate`).
    normalizer: the divisor for "constant" (default B * T).
    ref_logprobs: float [B, T], reference policy log-probs for the KL penalty / statistic, or None.
    kl_coef: weight of the k3 KL penalty (needs ref_logprobs when nonzero).
    kl_clamp: K > 0 clamps k3 as verl does (`k3_kl`); 0 is off.
    behaviour_logprobs: float [B, T], the sampler's log-probs, optional and for monitoring only: when
      given, aux gets ratio_mean / ratio_max of pi_theta / pi_behaviour (how off-policy the batch is).
      The loss does not depend on it.
    token_weights: float [B, T], no gradient, or None: per-token weights of the REINFORCE term
      (0 masks a token; the aggregation's denominators do not change).
    segment_ids: int [B, T] for packed rows, or None (see `grpo_loss`).

  Returns:
    (loss float32 scalar, aux dict of float32 scalars): num_tokens, advantage_mean, entropy_proxy,
    pg_loss, and kl (with ref_logprobs), ratio_mean and ratio_max (with behaviour_logprobs);
    `AUX_KINDS` says how each combines over micro-batches.
  """
  _check_kl_args(ref_logprobs, kl_coef)
  _check_token_inputs("asymre_loss", advantages, {
      "logprobs": logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
      "behaviour_logprobs": behaviour_logprobs, "token_weights": token_weights,
      "segment_ids": segment_ids})
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {aggregation!r}; valid choices: {AGGREGATIONS}")
  m = _f32(mask)
  valid = m > 0
  lp = jnp.where(valid, _f32(logprobs), 0.0)
  adv = _f32(advantages)

  aux = {}
  if adv.ndim == 2:
    adv = jnp.where(valid, adv, 0.0)
  objective = (adv[:, None] if adv.ndim == 1 else adv) * lp
  w = _token_weights(token_weights, valid)
  if w is not None:
    objective = w * objective
  per_token = -objective
  if ref_logprobs is not None:
    per_token = per_token + _kl_term(lp, ref_logprobs, kl_coef, kl_clamp, m, aux)
  loss = aggregate(per_token, m, aggregation, normalizer, segment_ids)

  aux.update(_common_aux(lp, adv, m, -objective, aggregation, normalizer, segment_ids))
  if behaviour_logprobs is not None:
    behaviour = jnp.where(valid, _f32(behaviour_logprobs), 0.0)
    aux.update(_ratio_aux(jnp.exp(lp - behaviour), m))
  return loss, jax.lax.stop_gradient(aux)
