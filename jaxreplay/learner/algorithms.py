"""The RL algorithms the trainer knows: name -> (advantage function, loss function, options).

The one table of algorithms. An algorithm is
  - its pure functions in `losses.py` (arrays and scalars only, formula and paper in the docstring),
  - its options: a small frozen dataclass whose fields are `config.trainer` keys of the same names,
    validated in `__post_init__` (the only place an option's name and range are written),
  - one entry in `ALGORITHMS`.
`options_from_config(name, config.trainer)` builds the options of a run (validation included);
`data.experience.make_advantage_fn` computes the advantages at generation time (stored with each
rollout), `trainer.LossFn` the loss in the train step. The statistics a loss returns are declared in
`losses.AUX_KINDS`; numpy-reference tests go in `tests/learner/test_losses.py`.

Off-policy corrections are a second axis (`corrections.py`, `trainer.off_policy`): every loss
takes `off_policy` (a `corrections.OffPolicyOptions`) and applies its per-token weights / masks to
its policy-gradient term (and, for GRPO, its proximal log-probs to the clip).

  "grpo"    GRPO (arXiv 2402.03300): group-standardised advantages, clipped-ratio loss.
  "asymre"  Asymmetric REINFORCE (arXiv 2506.20520): advantages against a shifted group baseline,
            REINFORCE loss without an importance ratio (so without clipping).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import chex

from jaxreplay.learner import corrections
from jaxreplay.learner import losses
from jaxreplay.learner.batch import Batch

Array = chex.Array


@dataclasses.dataclass(frozen=True)
class GrpoOptions:
  """GRPO's options (`config.trainer` keys of the same names).

  adv_eps: added to the group's reward std in the advantage (`losses.grpo_advantages`).
  eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] of the ratio (paper: 0.2, 0.2).
  (Truncated importance sampling, `trainer.tis_cap`, is an off-policy correction:
  `corrections.OffPolicyOptions`.)
  """
  adv_eps: float = 1e-6
  eps_low: float = 0.2
  eps_high: float = 0.2

  def __post_init__(self):
    if not self.adv_eps >= 0:
      raise ValueError(f"trainer.adv_eps={self.adv_eps} must be >= 0 (added to the group's std)")
    if not (self.eps_low >= 0 and self.eps_high >= 0):
      raise ValueError(f"trainer.eps_low={self.eps_low}, trainer.eps_high={self.eps_high}: the clip "
                       "range [1 - eps_low, 1 + eps_high] needs both >= 0 (the paper: 0.2, 0.2)")


@dataclasses.dataclass(frozen=True)
class AsymreOptions:
  """AsymRE's options (`config.trainer` keys of the same names).

  tau: the baseline shift delta V: A_i = r_i - (mean_group(r) + tau); tau < 0 keeps the baseline
    below the behaviour policy's value (the paper: -0.1).
  """
  tau: float = -0.1

  def __post_init__(self):
    if not -1e6 < self.tau < 1e6:
      raise ValueError(f"trainer.tau={self.tau} must be a finite shift of the baseline (e.g. -0.1)")


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """How rewards become advantages and how the loss is computed, with the options each takes.

  advantages: `(rewards [P, G], options) -> float32 [P, G]`.
  loss: `(logprobs [B, T], batch, ref_logprobs [B, T] or None, *, aggregation, normalizer, kl_coef,
    options, off_policy) -> (loss float32 scalar, aux dict of float32 scalars)`.
  options: the algorithm's options dataclass (its defaults are the paper's).
  check_off_policy: `(options, off_policy) -> None`, raises ValueError for a correction the
    algorithm's options cannot take (None: every one).
  """
  advantages: Callable[..., Array]
  loss: Callable[..., tuple[Array, dict[str, Array]]]
  options: type
  check_off_policy: Optional[Callable[[Any, corrections.OffPolicyOptions], None]] = None


def grpo_advantages(rewards: Array, options: GrpoOptions = GrpoOptions()) -> Array:
  """`losses.grpo_advantages(rewards, eps=options.adv_eps)`: rewards [P, G] -> float32 [P, G]."""
  return losses.grpo_advantages(rewards, eps=options.adv_eps)


def asymre_advantages(rewards: Array, options: AsymreOptions = AsymreOptions()) -> Array:
  """`losses.asymre_advantages(rewards, tau=options.tau)`: rewards [P, G] -> float32 [P, G]."""
  return losses.asymre_advantages(rewards, tau=options.tau)


def _segments(batch: Batch) -> Optional[Array]:
  """The segment ids that delimit rollouts in a packed batch; None when each row is one rollout."""
  return batch.segment_ids if batch.packed else None


_NO_CORRECTION = corrections.OffPolicyOptions()


def _correction_kwargs(correction: corrections.Correction, proximal: bool) -> dict:
  """The loss's keyword arguments of a correction (none at all for "none": the loss unchanged)."""
  kw = {}
  if correction.weights is not None:
    kw["token_weights"] = correction.weights
  if proximal and correction.proximal_logprobs is not None:
    kw["proximal_logprobs"] = correction.proximal_logprobs
  return kw


def grpo_loss(logprobs: Array, batch: Batch, ref_logprobs: Optional[Array] = None, *,
              aggregation: str = "token_mean", normalizer: Optional[float] = None,
              kl_coef: float = 0.0, options: GrpoOptions = GrpoOptions(),
              off_policy: corrections.OffPolicyOptions = _NO_CORRECTION
              ) -> tuple[Array, dict[str, Array]]:
  """`losses.grpo_loss` on a Batch, with the off-policy correction `off_policy`.

  "none": the plain clipped loss, ratio pi_theta / pi_sampler (Batch.behaviour_logprobs).
  "tis" (or tis_cap = C > 0 alone): the clip denominator is stop_gradient(logprobs) and the token
  weight w = stop_gradient(min(pi_theta / pi_sampler, C)): the clipped ratio is the trainer's own
  (1 in value), and the gradient of the per-token loss wrt log pi_theta is -w * A (see
  `trainer.make_loss_fn` for the full statement and references). The other modes:
  `corrections` (masks on the clipped objective; "decoupled": clip against the proximal policy).
  """
  correction = corrections.correct(off_policy, logprobs, batch.behaviour_logprobs,
                                   batch.completion_mask, _segments(batch))
  loss, aux = losses.grpo_loss(logprobs, batch.behaviour_logprobs, batch.advantages,
                               batch.completion_mask, options.eps_low, options.eps_high,
                               aggregation=aggregation, normalizer=normalizer,
                               ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                               segment_ids=_segments(batch),
                               **_correction_kwargs(correction, proximal=True))
  return loss, {**aux, **correction.aux}


def _check_grpo_off_policy(options: GrpoOptions, off_policy: corrections.OffPolicyOptions) -> None:
  if off_policy.uses_proximal and not (options.eps_low > 0 and options.eps_high > 0):
    what = (f"trainer.tis_cap={off_policy.tis_cap}" if off_policy.tis_cap
            else f"trainer.off_policy={off_policy.off_policy!r}")
    raise ValueError(f"{what} needs eps_low > 0 and eps_high > 0 (got {options.eps_low}, "
                     f"{options.eps_high}): the clipped ratio is then exactly 1, and on a clip "
                     "boundary the gradients of min / clip split at the tie")


def asymre_loss(logprobs: Array, batch: Batch, ref_logprobs: Optional[Array] = None, *,
                aggregation: str = "token_mean", normalizer: Optional[float] = None,
                kl_coef: float = 0.0, options: AsymreOptions = AsymreOptions(),
                off_policy: corrections.OffPolicyOptions = _NO_CORRECTION
                ) -> tuple[Array, dict[str, Array]]:
  """`losses.asymre_loss` on a Batch; behaviour log-probs feed the ratio_* statistics (tau acts in
  the advantages, computed at generation) and the off-policy correction, whose weights multiply
  the REINFORCE term (AsymRE has no clip, so proximal log-probs are unused)."""
  del options
  correction = corrections.correct(off_policy, logprobs, batch.behaviour_logprobs,
                                   batch.completion_mask, _segments(batch))
  loss, aux = losses.asymre_loss(logprobs, batch.advantages, batch.completion_mask,
                                 aggregation=aggregation, normalizer=normalizer,
                                 ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                                 behaviour_logprobs=batch.behaviour_logprobs,
                                 segment_ids=_segments(batch),
                                 **_correction_kwargs(correction, proximal=False))
  return loss, {**aux, **correction.aux}


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(grpo_advantages, grpo_loss, GrpoOptions, _check_grpo_off_policy),
    "asymre": Algorithm(asymre_advantages, asymre_loss, AsymreOptions),
}


def get(name: str) -> Algorithm:
  """ALGORITHMS[name], or a ValueError naming the known algorithms."""
  if name not in ALGORITHMS:
    raise ValueError(f"loss {name!r} is unknown; expected one of {tuple(ALGORITHMS)}")
  return ALGORITHMS[name]


def option_names(name: str) -> tuple[str, ...]:
  """The options algorithm `name` takes (its dataclass's fields)."""
  return tuple(f.name for f in dataclasses.fields(get(name).options))


def make_options(name: str, values: Mapping[str, Any]) -> Any:
  """Algorithm `name`'s options from `values` (any mapping: a dict, `config.trainer`).

  Each field is read from `values` when present (missing ones keep their defaults), and validated by
  the dataclass. An option of another algorithm set away from its default is an error naming it
  (e.g. trainer.eps_low with the AsymRE loss, which has no ratio to clip).
  """
  options_cls = get(name).options
  own = {f.name for f in dataclasses.fields(options_cls)}
  for other, algorithm in ALGORITHMS.items():
    if other == name:
      continue
    for f in dataclasses.fields(algorithm.options):
      if f.name in own or f.name not in values:
        continue
      if values[f.name] != f.default:
        raise ValueError(
            f"trainer.{f.name}={values[f.name]} is an option of loss {other!r}, not of "
            f"{name!r}; set trainer.{f.name}={f.default!r} (or trainer.loss={other!r})")
  return options_cls(**{k: values[k] for k in own if k in values})


def options_from_config(trainer_config) -> Any:
  """The options of `trainer_config.loss` read from `config.trainer` (validated)."""
  return make_options(trainer_config.loss, trainer_config)


def check_off_policy(name: str, options: Any, off_policy: corrections.OffPolicyOptions) -> None:
  """Raises ValueError when algorithm `name` with `options` cannot take the correction."""
  check = get(name).check_off_policy
  if check is not None:
    check(options, off_policy)
