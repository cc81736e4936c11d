"""The loss the train step calls: one algorithm with its options and the off-policy correction.

`LossFn` is a hashable closure over scalars and frozen dataclasses (`loss_fn(logprobs [B, T], batch,
ref_logprobs=None) -> (loss, aux)`), built by `make_loss_fn(name, options, ...)` or, for a run, by
`loss_fn_from_config(config.trainer)`; `trainer.make_train_step` and the diagnostics take it. The
algorithms are the table `algorithms.ALGORITHMS`, the corrections `corrections.CORRECTIONS`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax

from jaxreplay.learner import algorithms
from jaxreplay.learner import corrections
from jaxreplay.learner import losses
from jaxreplay.learner.batch import Batch


@dataclasses.dataclass(frozen=True)
class LossFn:
  """One algorithm's loss: `loss_fn(logprobs [B, T], batch, ref_logprobs=None) -> (loss, aux)`.

  Calls `algorithms.loss(name, ...)` with the algorithm's options (its dataclass, e.g.
  `algorithms.GrpoOptions`; None = the defaults) and the off-policy correction `off_policy` (a
  `corrections.OffPolicyOptions`; None = "none"). Build it with `make_loss_fn` (documented there,
  truncated importance sampling included) or `loss_fn_from_config`.

  The fields that apply to every algorithm: aggregation (`losses.aggregate`), kl_coef (the k3
  penalty's weight to the frozen reference), kl_clamp (K > 0 clamps k3 as verl does, at 10;
  0 = off: `losses.k3_kl`), normalizer ("constant"'s divisor, None = the batch's B * T).
  Holds only scalars and frozen dataclasses (hashable): the trainer never reads a config object.
  `aggregation` and `normalizer` tell the trainer how to weigh micro-batches, `needs_ref` whether
  the step needs reference log-probs.
  """
  name: str = "grpo"
  aggregation: str = "token_mean"
  kl_coef: float = 0.0
  normalizer: Optional[float] = None
  options: Any = None
  off_policy: Optional[corrections.OffPolicyOptions] = None
  kl_clamp: float = 0.0

  def __post_init__(self):
    algorithm = algorithms.get(self.name)
    if self.options is None:
      object.__setattr__(self, "options", algorithm.options())
    elif not isinstance(self.options, algorithm.options):
      raise TypeError(f"loss {self.name!r} takes {algorithm.options.__name__}, got "
                      f"{type(self.options).__name__}")
    if self.off_policy is None:
      object.__setattr__(self, "off_policy", corrections.OffPolicyOptions())
    elif not isinstance(self.off_policy, corrections.OffPolicyOptions):
      raise TypeError(f"off_policy must be a corrections.OffPolicyOptions, got "
                      f"{type(self.off_policy).__name__}")
    algorithms.check_off_policy(self.name, self.options, self.off_policy)
    if self.aggregation not in losses.AGGREGATIONS:
      raise ValueError(f"aggregation {self.aggregation!r} is unknown; expected one of "
                       f"{losses.AGGREGATIONS}")
    if self.normalizer is not None and self.aggregation != "constant":
      raise ValueError("normalizer is only used with aggregation='constant', got "
                       f"{self.aggregation!r}")
    if not 0.0 <= self.kl_clamp < math.inf:
      raise ValueError(f"trainer.kl_clamp={self.kl_clamp}: expected 0 (off) or a finite bound "
                       "K > 0 on the k3 KL per token (verl clamps at 10)")

  @property
  def needs_ref(self) -> bool:
    return self.kl_coef != 0.0

  def __call__(self, logprobs: jax.Array, batch: Batch, ref_logprobs: Optional[jax.Array] = None):
    return algorithms.loss(
        self.name, logprobs, batch, ref_logprobs, aggregation=self.aggregation,
        normalizer=self.normalizer, kl_coef=self.kl_coef, kl_clamp=self.kl_clamp,
        options=self.options, off_policy=self.off_policy)


def loss_fn_from_config(trainer_config) -> LossFn:
  """The loss of `config.trainer`: trainer.loss with its options (`algorithms.options_from_config`),
  the off-policy correction (`corrections.options_from_config`), trainer.aggregation,
  trainer.kl_coef and trainer.kl_clamp. Raises ValueError naming a bad option (the config
  validation calls it)."""
  return make_loss_fn(trainer_config.loss, algorithms.options_from_config(trainer_config),
                      aggregation=trainer_config.aggregation,
                      kl_coef=float(trainer_config.kl_coef),
                      kl_clamp=float(trainer_config.kl_clamp),
                      off_policy=corrections.options_from_config(trainer_config))


def make_loss_fn(name: str = "grpo", options: Any = None, *, aggregation: str = "token_mean",
                 kl_coef: float = 0.0, kl_clamp: float = 0.0, normalizer: Optional[float] = None,
                 off_policy: Optional[corrections.OffPolicyOptions] = None) -> LossFn:
  """The loss for `make_train_step`: an algorithm of `algorithms.ALGORITHMS` with its options.

  Args:
    name: a name of `algorithms.ALGORITHMS` ("grpo": clipped ratio, `losses.grpo_loss`; "asymre":
      no ratio, `losses.asymre_loss`).
    options: that algorithm's options dataclass (`algorithms.GrpoOptions(eps_low=..., ...)`,
      `algorithms.AsymreOptions(tau=...)`); None: its defaults (the paper's).
    aggregation: "token_mean" | "sequence_mean" | "constant" (see `losses.aggregate`).
    kl_coef: weight of the k3 KL penalty to the frozen reference params (the train state needs
      `init_train_state(..., with_ref_params=True)`).
    kl_clamp: K > 0 clamps the per-token k3 at K as verl does (`losses.k3_kl`); 0 is off.
    normalizer: the "constant" divisor; None for the whole batch's B * T.
    off_policy: the off-policy correction (`corrections.OffPolicyOptions`: "tis" (or tis_cap = C
      alone), "mis_token", "mis_sequence", "m2po", "decoupled"); None: none.

  Truncated importance sampling (TIS), OffPolicyOptions(tis_cap=C) with C > 0 (or "tis" with
  off_policy_cap C). The usual TIS weight uses the trainer's log-probs under the parameters of the
  version that generated each rollout; a replay trainer cannot recompute those per rollout, so this
  uses its log-probs at the current params theta: the correction (`corrections.truncated_is_weights`)
  hands the loss, per valid token (lp = log pi_theta, the gradient flowing through it; A the row's
  advantage),
    w    = stop_gradient(min(exp(lp - behaviour_lp), C)) = min(pi_theta / pi_sampler, C)
    rho  = exp(lp - stop_gradient(lp))                   = 1 in value, d rho / d lp = 1
    loss = -w * min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_coef * k3   (-w A + ...)
    d loss / d lp = -w A  (+ the KL term's gradient),
  aggregated as the loss: the update follows sum_t w A grad log pi_theta, REINFORCE with the
  importance weight pi_theta / pi_sampler truncated at C. pi_sampler (Batch.behaviour_logprobs)
  carries both the rollout's staleness and the sampler's numerics, so w re-weights each token towards
  pi_theta for both (per token: the usual approximation of the sequence's ratio), and truncation
  bounds its variance at the price of bias on tokens with w > C. The clip acts on the trainer's own
  ratio, which is 1, so it never binds: clip_fraction is 0 and ratio_mean = ratio_max = 1, while the
  aux gains tis_weight_mean and tis_truncated_fraction (the fraction of tokens with w at C). This is
  the TIS correction of verl, slime and OpenRLHF (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; cap C = 2), there with the trainer's log-probs at the
  behaviour version, and the truncated importance-weighted policy gradient of IMPALA (Espeholt et
  al. 2018, arXiv 1802.01561, V-trace's rho-bar) and ACER (Wang et al. 2017, arXiv 1611.01224,
  without its bias correction). AsymRE has no importance ratio and no clip: with it the weight w
  multiplies its REINFORCE term, -w A log pi_theta.

  Raises:
    ValueError: an unknown name or aggregation, a normalizer without "constant", a kl_clamp < 0,
      or a proximal correction ("tis", "decoupled") with GRPO's eps_low or eps_high 0.
    TypeError: options of another algorithm.
  """
  return LossFn(name=name, aggregation=aggregation, kl_coef=float(kl_coef),
                normalizer=None if normalizer is None else float(normalizer), options=options,
                off_policy=off_policy, kl_clamp=float(kl_clamp))
