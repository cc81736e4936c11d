"""Off-policy corrections: per-token weights and masks on the policy-gradient term, for stale and
mismatched rollouts. A second axis, composable with every algorithm of `algorithms.ALGORITHMS`.

A replay trainer learns from rollouts sampled by older policies (staleness) through an inference
engine whose numerics differ from the trainer's (mismatch); both show in the per-token behaviour
log-ratio
    lr_{b,t} = log pi_theta(y_t) - log pi_behav(y_t)     (pi_theta at the current params, no
                                                         gradient; pi_behav = Batch.behaviour_logprobs)
A correction turns lr into
  - `weights` float32 [B, T] (no gradient) multiplying each token's policy-gradient objective (0
    masks the token out; the aggregation's denominators are unchanged, so a masked token counts as a
    token with zero gradient: micro-batch weighting stays exact and the loss scale does not jump
    when many tokens are masked), and
  - optionally `proximal_logprobs` [B, T]: the denominator of GRPO's clipped ratio instead of the
    behaviour log-probs (the decoupled form: clip against the trainer's own policy).

The modes (`trainer.off_policy`), each a pure function of arrays and scalars with its row in the
one table `CORRECTIONS` (`Mode`: the function, whether GRPO clips against the proximal policy,
its statistics' kinds). Adding a correction is this file alone: its pure function, its `_mode`
adapter, its row (and, when it has options, fields of `OffPolicyOptions`).
  "none"          nothing (the loss exactly as without this module).
  "tis"           truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
                  Brings You Off-Policy RL Training"; verl, slime, OpenRLHF, SkyRL; IMPALA's
                  rho-bar): w = min(exp(lr), C) (`truncated_is_weights`), clip against
                  pi_theta itself (ratio 1 in value): the token's gradient is -w A grad log pi_theta.
                  C = trainer.tis_cap when > 0, else trainer.off_policy_cap. `trainer.tis_cap > 0`
                  alone (off_policy "none") is this mode, exactly as before issue 27.
  "mis_token"     token-level rejection sampling, verl's behaviour (its token-level rollout
                  rejection sampling, `rollout_rs`): tokens whose ratio against the sampler
                  exp(lr) leaves [1/c, c] are masked (weight 0), the kept ones get weight 1 (no
                  importance weight); c = trainer.off_policy_cap. (IcePop, arXiv 2510.18855,
                  masks the same band but weights the kept tokens by their ratio: not this mode.)
  "mis_sequence"  the same per sequence: the sequence's ratio exp(sum_t lr_t) (the product of its
                  token ratios) outside [1/c, c] masks every token of the sequence.
  "m2po"          M2PO (Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach
                  with Stale Data on LLMs?", arXiv 2510.01161; AReaL's implementation): tokens are
                  masked in decreasing order of lr^2 until the mean of lr^2 over the remaining valid
                  tokens is < trainer.m2po_threshold (tau_M2 = 0.04 in the paper); at least one token
                  is kept. "The batch" is what the loss sees: with trainer.num_microbatches = k > 1
                  each micro-batch is thresholded on its own, which still bounds the whole batch's
                  second moment (a token-weighted mean of micro-batch means each < tau) but may mask
                  more tokens than thresholding the whole batch would.
  "decoupled"     decoupled PPO (Hilton, Cobbe, Schulman, "Batch size-invariance for policy
                  optimization", arXiv 2110.00641, 2021; AReaL, Fu et al., arXiv 2505.24298): the clip
                  acts on pi_theta / pi_prox with the proximal policy pi_prox = the trainer's policy
                  before the update, times the behaviour weight pi_prox / pi_behav, which AReaL filters
                  rather than truncates (`behav_imp_weight_cap`: "we filter out the tokens where
                  behav_imp_weight exceeds behav_imp_weight_cap"): w = exp(lr) where exp(lr) <= c,
                  else 0; c = trainer.off_policy_cap.
                  What this reduces to here: jaxreplay takes ONE update per sampled batch, so the
                  proximal policy (the params before the update) equals the current params in value:
                  pi_prox = stop_gradient(pi_theta), the same in-step value AReaL's extra forward
                  pass would give (params do not change within a step, micro-batches included), so
                  no extra pass is made. The clipped ratio is then 1 in value (the clip never binds)
                  and the token's gradient is -w A grad log pi_theta. With truncation
                  (min(exp(lr), c)) instead of the filter this would be "tis" with C = c exactly;
                  the two differ only on tokens with exp(lr) > c (tis: weight c; decoupled: 0).
With AsymRE (no ratio, no clip) the weights multiply its REINFORCE term -A log pi_theta and the
proximal log-probs are unused: "decoupled" is then the filtered behaviour weight, "tis" the truncated
one.

Why the current params stand in for the behaviour version's: a replay trainer keeps no snapshot of
old params, so lr mixes the rollout's staleness and the sampler/trainer mismatch (see
`loss_fn.make_loss_fn`); on fresh rollouts it is the mismatch alone.

Statistics (aux; each row declares their kinds, as `losses.AUX_KINDS` does for the losses), per
mode: tis_weight_mean,
tis_truncated_fraction (tis); mis_masked_fraction (both mis modes: the fraction of valid tokens
masked), mis_masked_sequence_fraction (mis_sequence); m2po_masked_fraction, m2po_second_moment
(the mean of lr^2 over valid tokens before masking); decoupled_weight_mean,
decoupled_masked_fraction.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from jaxreplay.learner import losses

Array = chex.Array


@dataclasses.dataclass(frozen=True)
class OffPolicyOptions:
  """The off-policy correction of a run (`config.trainer` keys of the same names).

  off_policy: a mode of `CORRECTIONS` (module docstring).
  off_policy_cap: c > 1: the ratio interval [1/c, c] of the mis modes, the filter of "decoupled"
    and the truncation of "tis" when tis_cap is 0 (2.0: verl's and slime's common cap).
  m2po_threshold: tau_M2 > 0, the bound on the mean squared log-ratio of the tokens "m2po" keeps
    (the M2PO paper: 0.04).
  tis_cap: C > 0 truncates "tis" at C; with off_policy "none" it turns "tis" on (the key from
    before issue 27, unchanged); 0 leaves the cap to off_policy_cap.
  """
  off_policy: str = "none"
  off_policy_cap: float = 2.0
  m2po_threshold: float = 0.04
  tis_cap: float = 0.0

  def __post_init__(self):
    if self.off_policy not in CORRECTIONS:
      raise ValueError(f"trainer.off_policy={self.off_policy!r}: expected one of "
                       f"{tuple(CORRECTIONS)}")
    if not 1.0 < self.off_policy_cap < math.inf:
      raise ValueError(f"trainer.off_policy_cap={self.off_policy_cap} must be a finite c > 1 (the "
                       "ratio interval [1/c, c]; 2.0 is common)")
    if not 0.0 < self.m2po_threshold < math.inf:
      raise ValueError(f"trainer.m2po_threshold={self.m2po_threshold} must be > 0 (the mean "
                       "squared log-ratio kept; the M2PO paper uses 0.04)")
    if self.tis_cap < 0:
      raise ValueError(f"trainer.tis_cap={self.tis_cap}: must be >= 0 (0 is off, 2.0 is common)")
    if self.tis_cap and self.off_policy not in ("none", "tis"):
      raise ValueError(f"trainer.tis_cap={self.tis_cap} is the cap of trainer.off_policy='tis', "
                       f"not of {self.off_policy!r}: set trainer.tis_cap=0 (that mode's cap is "
                       "trainer.off_policy_cap)")

  @property
  def mode(self) -> str:
    """The mode in effect: off_policy, or "tis" when only tis_cap > 0 is set."""
    return "tis" if self.off_policy == "none" and self.tis_cap else self.off_policy

  @property
  def cap(self) -> float:
    """The cap of the mode in effect: tis_cap for "tis" when > 0, else off_policy_cap."""
    return self.tis_cap if self.mode == "tis" and self.tis_cap else self.off_policy_cap

  @property
  def uses_proximal(self) -> bool:
    """Whether GRPO clips against the trainer's own policy (pi_theta / stop_gradient(pi_theta))."""
    return CORRECTIONS[self.mode].proximal


class Correction(NamedTuple):
  """What a correction hands the loss (module docstring).

  weights: float32 [B, T], no gradient, multiplying each token's policy-gradient objective; None = 1.
  proximal_logprobs: float32 [B, T], no gradient: GRPO's clip denominator; None = the behaviour's.
  aux: float32 scalar statistics (their kinds declared in the mode's row of `CORRECTIONS`).
  """
  weights: Optional[Array]
  proximal_logprobs: Optional[Array]
  aux: dict


# ---------------------------------------------------------------------------------- pure functions


def _check(fn_name: str, arrays: dict, segment_ids=None):
  with losses._checking(fn_name):  # pylint: disable=protected-access
    chex.assert_rank(list(arrays.values()), 2)
    chex.assert_equal_shape(list(arrays.values()))
    for name, a in arrays.items():
      if name == "mask":
        losses._assert_numeric(a, name)  # pylint: disable=protected-access
      else:
        chex.assert_type(a, float)
    if segment_ids is not None:
      chex.assert_rank(segment_ids, 2)
      chex.assert_equal_shape([segment_ids, arrays["mask"]])
      chex.assert_type(segment_ids, int)


def behaviour_log_ratio(logprobs: Array, behaviour_logprobs: Array, mask: Array) -> Array:
  """lr = stop_gradient(logprobs) - behaviour_logprobs on valid tokens, 0 on padding.

  Args:
    logprobs: float [B, T], log pi_theta of the sampled tokens (any gradient is stopped).
    behaviour_logprobs: float [B, T], the sampler's log-probs (Batch.behaviour_logprobs).
    mask: {0, 1} [B, T], 1 on completion tokens; padding may hold any value.

  Returns:
    float32 [B, T], no gradient.
  """
  _check("behaviour_log_ratio", {"logprobs": logprobs, "behaviour_logprobs": behaviour_logprobs,
                                 "mask": mask})
  valid = jnp.asarray(mask) > 0
  lp = jnp.where(valid, jnp.asarray(logprobs).astype(jnp.float32), 0.0)
  behaviour = jnp.where(valid, jnp.asarray(behaviour_logprobs).astype(jnp.float32), 0.0)
  return jax.lax.stop_gradient(lp - behaviour)


def truncated_is_weights(trainer_logprobs: Array, sampler_logprobs: Array,
                         cap: Optional[float] = None) -> Array:
  """Truncated importance weights of the sampled tokens (the "tis" mode).

    w = stop_gradient(min(exp(trainer_lp - sampler_lp), cap))    (no truncation when cap is None).

  The inference engine (vLLM) and the trainer compute slightly different probabilities for the same
  parameters, and a replayed rollout was sampled by an older policy; w re-weights tokens drawn by
  the sampler towards the trainer's policy (Yao et al. 2025; cap C = 2 is the common choice in
  verl, slime, OpenRLHF, SkyRL).

  Args:
    trainer_logprobs: float [B, T], the trainer's log-probs of the sampled tokens.
    sampler_logprobs: float [B, T], the sampler's log-probs of the same tokens
      (Batch.behaviour_logprobs).
    cap: upper bound C > 0 on w, or None.

  Returns:
    float32 [B, T], no gradient.
  """
  if losses._is_python_number(cap) and not cap > 0:  # pylint: disable=protected-access
    raise ValueError(f"tis_cap must be > 0 (2.0 is common), got {cap}")
  _check("truncated_is_weights", {"trainer_logprobs": trainer_logprobs,
                                  "sampler_logprobs": sampler_logprobs})
  w = jnp.exp(jnp.asarray(trainer_logprobs, jnp.float32) - jnp.asarray(sampler_logprobs,
                                                                        jnp.float32))
  if cap is not None:
    w = jnp.minimum(w, jnp.asarray(cap, jnp.float32))
  return jax.lax.stop_gradient(w)


def mis_token_keep(log_ratio: Array, mask: Array, cap: float) -> Array:
  """Token-level rejection sampling (verl's): 1 where the ratio exp(lr) against the sampler lies
  in [1/cap, cap], else 0 (kept tokens weigh 1, not their ratio).

  Compared in log space (|lr| <= log cap, boundaries kept), so huge ratios cannot overflow.

  Args:
    log_ratio: float [B, T] (`behaviour_log_ratio`). mask: {0, 1} [B, T]. cap: c > 1.

  Returns:
    float32 [B, T]: 1 on kept valid tokens, 0 on masked and padding tokens.
  """
  _check("mis_token_keep", {"log_ratio": log_ratio, "mask": mask})
  valid = jnp.asarray(mask) > 0
  keep = jnp.abs(jnp.asarray(log_ratio, jnp.float32)) <= jnp.float32(math.log(cap))
  return (valid & keep).astype(jnp.float32)


def _per_token(seq_values: Array, segment_ids: Optional[Array], shape) -> Array:
  """Per-sequence values ([B, 1] or [B, T + 1], see `losses.sequence_sums`) back on each token."""
  if segment_ids is None:
    return jnp.broadcast_to(seq_values, shape)
  seg = jnp.clip(jnp.asarray(segment_ids).astype(jnp.int32), 0, shape[1])
  return jnp.take_along_axis(seq_values, seg, axis=1)


def mis_sequence_keep(log_ratio: Array, mask: Array, cap: float,
                      segment_ids: Optional[Array] = None) -> Array:
  """Sequence-level masked IS: every token of a sequence whose ratio prod_t exp(lr_t) leaves
  [1/cap, cap] gets 0, the tokens of the others 1 (log space: |sum_t lr_t| <= log cap).

  Args:
    log_ratio: float [B, T]. mask: {0, 1} [B, T]. cap: c > 1.
    segment_ids: int [B, T] of packed rows (a sequence is a (row, segment) pair), or None: each
      row is one sequence.

  Returns:
    float32 [B, T]: 1 on valid tokens of kept sequences, 0 elsewhere.
  """
  _check("mis_sequence_keep", {"log_ratio": log_ratio, "mask": mask}, segment_ids)
  valid = jnp.asarray(mask) > 0
  lr = jnp.where(valid, jnp.asarray(log_ratio, jnp.float32), 0.0)
  seq_lr = losses.sequence_sums(lr, segment_ids)
  keep_seq = (jnp.abs(seq_lr) <= jnp.float32(math.log(cap))).astype(jnp.float32)
  return jnp.where(valid, _per_token(keep_seq, segment_ids, lr.shape), 0.0)


def m2po_keep(log_ratio: Array, mask: Array, threshold: float) -> Array:
  """M2PO's second-moment mask (arXiv 2510.01161; AReaL's `_apply_m2po_masking`).

  With m2 = lr^2 on the n valid tokens sorted in decreasing order m2_(1) >= ... >= m2_(n) (ties in
  the order of a stable sort of the flattened [B, T] positions), j* = the smallest j in [0, n) with
  mean(m2_(j+1), ..., m2_(n)) < threshold, or n - 1 when there is none (one token is always kept);
  the j* tokens of largest m2 are masked. No valid token: nothing is masked.

  Args:
    log_ratio: float [B, T]. mask: {0, 1} [B, T]. threshold: tau_M2 > 0.

  Returns:
    float32 [B, T]: 1 on kept valid tokens, 0 on masked and padding tokens.
  """
  _check("m2po_keep", {"log_ratio": log_ratio, "mask": mask})
  valid = (jnp.asarray(mask) > 0).reshape(-1)
  lr = jnp.asarray(log_ratio, jnp.float32).reshape(-1)
  m2 = jnp.where(valid, lr * lr, 0.0)
  size = m2.shape[0]
  n = jnp.sum(valid.astype(jnp.int32))
  # Decreasing m2, padding (key +1 > any -m2 <= 0) last; a stable sort breaks ties by position.
  order = jnp.argsort(jnp.where(valid, -m2, 1.0), stable=True)
  sorted_m2 = m2[order]
  suffix = jnp.cumsum(sorted_m2[::-1])[::-1]              # sum of sorted_m2[j:], padding adds 0
  j = jnp.arange(size)
  counts = jnp.maximum(n - j, 1).astype(jnp.float32)
  below = (suffix / counts < jnp.float32(threshold)) & (j < n)
  num_masked = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
  rank = jnp.zeros(size, jnp.int32).at[order].set(j.astype(jnp.int32))
  keep = valid & (rank >= num_masked)
  return keep.astype(jnp.float32).reshape(jnp.shape(log_ratio))


def decoupled_weights(log_ratio: Array, mask: Array, cap: float) -> Array:
  """The decoupled-PPO behaviour weight, filtered as AReaL does: w = pi_prox / pi_behav = exp(lr)
  where it is <= cap, else 0 (0 on padding).

  Args:
    log_ratio: float [B, T] (lr = log pi_prox - log pi_behav). mask: {0, 1} [B, T]. cap: c > 1.

  Returns:
    float32 [B, T], no gradient.
  """
  _check("decoupled_weights", {"log_ratio": log_ratio, "mask": mask})
  valid = jnp.asarray(mask) > 0
  lr = jnp.where(valid, jnp.asarray(log_ratio, jnp.float32), 0.0)
  keep = valid & (lr <= jnp.float32(math.log(cap)))
  return jax.lax.stop_gradient(jnp.where(keep, jnp.exp(jnp.where(keep, lr, 0.0)), 0.0))


# ------------------------------------------------------------------------------- the modes' table


def _fraction(masked: Array, m: Array) -> Array:
  return losses._masked_mean(masked.astype(jnp.float32), m)  # pylint: disable=protected-access


def _none(lp, behaviour, m, segment_ids, options):
  del lp, behaviour, m, segment_ids, options
  return Correction(None, None, {})


def _tis(lp, behaviour, m, segment_ids, options):
  del segment_ids
  valid = m > 0
  prox = jnp.where(valid, jax.lax.stop_gradient(lp), 0.0)
  w = truncated_is_weights(prox, jnp.where(valid, behaviour, 0.0), options.cap)
  return Correction(w, prox, {"tis_weight_mean": losses._masked_mean(w, m),  # pylint: disable=protected-access
                              "tis_truncated_fraction": _fraction(w >= options.cap, m)})


def _mis_token(lp, behaviour, m, segment_ids, options):
  del segment_ids
  keep = mis_token_keep(behaviour_log_ratio(lp, behaviour, m), m, options.cap)
  return Correction(keep, None, {"mis_masked_fraction": _fraction(1.0 - keep, m)})


def _mis_sequence(lp, behaviour, m, segment_ids, options):
  keep = mis_sequence_keep(behaviour_log_ratio(lp, behaviour, m), m, options.cap, segment_ids)
  means, seq_valid = losses.sequence_means(1.0 - keep, m, segment_ids)
  masked_seq = jnp.sum((means > 0).astype(jnp.float32) * seq_valid) / jnp.maximum(
      jnp.sum(seq_valid), 1.0)
  return Correction(keep, None, {"mis_masked_fraction": _fraction(1.0 - keep, m),
                                 "mis_masked_sequence_fraction": masked_seq})


def _m2po(lp, behaviour, m, segment_ids, options):
  del segment_ids
  lr = behaviour_log_ratio(lp, behaviour, m)
  keep = m2po_keep(lr, m, options.m2po_threshold)
  return Correction(keep, None, {"m2po_masked_fraction": _fraction(1.0 - keep, m),
                                 "m2po_second_moment": losses._masked_mean(lr * lr, m)})  # pylint: disable=protected-access


def _decoupled(lp, behaviour, m, segment_ids, options):
  del segment_ids
  valid = m > 0
  prox = jnp.where(valid, jax.lax.stop_gradient(lp), 0.0)
  lr = behaviour_log_ratio(prox, behaviour, m)
  w = decoupled_weights(lr, m, options.cap)
  masked = valid & (lr > jnp.float32(math.log(options.cap)))
  return Correction(w, prox, {"decoupled_weight_mean": losses._masked_mean(w, m),  # pylint: disable=protected-access
                              "decoupled_masked_fraction": _fraction(masked, m)})


@dataclasses.dataclass(frozen=True)
class Mode:
  """One correction's row of `CORRECTIONS`.

  fn: `(logprobs f32 [B, T] (no gradient), behaviour f32 [B, T], mask f32 [B, T], segment_ids or
    None, OffPolicyOptions) -> Correction`.
  aux: the kind of each statistic fn returns (`losses.AUX_KIND_NAMES`: how it combines over
    micro-batches).
  proximal: fn returns proximal log-probs, and GRPO clips against them (pi_theta itself: the
    ratio is 1 in value, which needs eps_low, eps_high > 0).
  """
  fn: Callable[..., Correction]
  aux: Mapping[str, str] = dataclasses.field(default_factory=dict)
  proximal: bool = False


# off_policy mode -> its row; validation and OffPolicyOptions read the modes from here.
CORRECTIONS: dict[str, Mode] = {
    "none": Mode(_none),
    "tis": Mode(_tis, {"tis_weight_mean": "token_mean", "tis_truncated_fraction": "token_mean"},
                proximal=True),
    "mis_token": Mode(_mis_token, {"mis_masked_fraction": "token_mean"}),
    "mis_sequence": Mode(_mis_sequence, {"mis_masked_fraction": "token_mean",
                                         "mis_masked_sequence_fraction": "row_mean"}),
    "m2po": Mode(_m2po, {"m2po_masked_fraction": "token_mean",
                         "m2po_second_moment": "token_mean"}),
    "decoupled": Mode(_decoupled, {"decoupled_weight_mean": "token_mean",
                                   "decoupled_masked_fraction": "token_mean"}, proximal=True),
}


def aux_kinds() -> dict[str, str]:
  """Every correction's statistics and their kinds (the rows' `aux`, merged)."""
  return {k: v for mode in CORRECTIONS.values() for k, v in mode.aux.items()}


def correct(options: OffPolicyOptions, logprobs: Array, behaviour_logprobs: Array, mask: Array,
            segment_ids: Optional[Array] = None) -> Correction:
  """The correction `options.mode` of a (micro-)batch.

  Args:
    options: the run's OffPolicyOptions.
    logprobs: float [B, T], log pi_theta (its gradient is stopped here; the loss keeps its own).
    behaviour_logprobs: float [B, T], the sampler's log-probs.
    mask: {0, 1} [B, T]. segment_ids: int [B, T] of packed rows, or None.

  Returns:
    Correction(weights, proximal_logprobs, aux); "none" gives (None, None, {}).
  """
  if options.mode == "none":
    return Correction(None, None, {})
  m = jnp.asarray(mask).astype(jnp.float32)
  lp = jax.lax.stop_gradient(jnp.asarray(logprobs).astype(jnp.float32))
  return CORRECTIONS[options.mode].fn(lp, jnp.asarray(behaviour_logprobs).astype(jnp.float32), m,
                                      segment_ids, options)


def option_names() -> tuple[str, ...]:
  """The `config.trainer` keys of the corrections (OffPolicyOptions' fields)."""
  return tuple(f.name for f in dataclasses.fields(OffPolicyOptions))


def options_from_config(trainer_config: Any) -> OffPolicyOptions:
  """OffPolicyOptions from `config.trainer` (any mapping; missing keys keep their defaults),
  validated."""
  return OffPolicyOptions(**{k: trainer_config[k] for k in option_names() if k in trainer_config})
