"""The RL algorithms the trainer knows: name -> (advantage function, loss function, options).

The one table of algorithms. An algorithm is
  - its pure functions in `losses.py` (arrays and scalars only, formula and paper in the docstring,
    the keyword arguments every loss takes: see `losses`' module docstring),
  - its options: a small frozen dataclass whose fields are `config.trainer` keys of the same names,
    validated in `__post_init__` (the only place an option's name and range are written), with
    `advantage_args()` / `loss_args()`: the keyword arguments of its two functions,
  - one `Algorithm` row in `ALGORITHMS`.
Adding one (a Dr.GRPO-style loss) is those two files: `losses.py` and this one; the config keys'
defaults go in `config/defaults.py`. Nothing outside this file names an algorithm's options:
`options_from_config(config.trainer)` builds a run's (validation included), `advantages` computes
the advantages at generation time (`data.experience.make_advantage_fn`, stored with each rollout)
and `loss` the loss in the train step (`loss_fn.LossFn`). The statistics a loss returns are
declared in `losses.AUX_KINDS`; numpy-reference tests go in `tests/learner/test_losses.py`.

Off-policy corrections are a second axis (`corrections.py`, `trainer.off_policy`): `loss` hands
every algorithm's loss the correction's per-token weights (`token_weights`), and a loss that clips
a ratio (`Algorithm.clips`) its proximal log-probs too.

  "grpo"    GRPO (arXiv 2402.03300): group-standardised advantages, clipped-ratio loss.
  "asymre"  Asymmetric REINFORCE (arXiv 2506.20520): advantages against a shifted group baseline,
            REINFORCE loss without an importance ratio (so without clipping).
"""
from __future__ import annotations

import dataclasses
import math
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
  adv_std_ddof: the std's delta degrees of freedom: 0 (population std, jaxreplay's default) or 1
    (sample std: TRL's and verl's GRPO; advantages x sqrt(G / (G - 1)), x1.069 at G = 8).
  eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] of the ratio (paper: 0.2, 0.2).
  dual_clip: c > 1 bounds the clipped objective of a token with a negative advantage below by
    c * A (verl's dual-clip PPO, `clip_ratio_c` = 3); 0 or None is off.
  (Truncated importance sampling, `trainer.tis_cap`, is an off-policy correction:
  `corrections.OffPolicyOptions`.)
  """
  adv_eps: float = 1e-6
  adv_std_ddof: int = 0
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: Optional[float] = 0.0

  def __post_init__(self):
    if self.dual_clip is None:
      object.__setattr__(self, "dual_clip", 0.0)
    if not self.adv_eps >= 0:
      raise ValueError(f"trainer.adv_eps={self.adv_eps} must be >= 0 (added to the group's std)")
    if self.adv_std_ddof not in (0, 1):
      raise ValueError(f"trainer.adv_std_ddof={self.adv_std_ddof}: expected 0 (population std) or "
                       "1 (sample std, as TRL and verl)")
    if not (self.eps_low >= 0 and self.eps_high >= 0):
      raise ValueError(f"trainer.eps_low={self.eps_low}, trainer.eps_high={self.eps_high}: the clip "
                       "range [1 - eps_low, 1 + eps_high] needs both >= 0 (the paper: 0.2, 0.2)")
    if self.dual_clip and not 1.0 < self.dual_clip < math.inf:
      raise ValueError(f"trainer.dual_clip={self.dual_clip}: expected 0 (off) or a finite c > 1 "
                       "(verl's dual-clip PPO uses 3)")

  def advantage_args(self) -> dict:
    return {"eps": self.adv_eps, "ddof": int(self.adv_std_ddof)}

  def loss_args(self) -> dict:
    args = {"eps_low": self.eps_low, "eps_high": self.eps_high}
    if self.dual_clip:  # off: the loss exactly as without the option
      args["dual_clip"] = float(self.dual_clip)
    return args


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

  def advantage_args(self) -> dict:
    return {"tau": self.tau}

  def loss_args(self) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One row of `ALGORITHMS`: how rewards become advantages and how the loss is computed.

  advantages: a pure function `(rewards [P, G], **options.advantage_args()) -> float32 [P, G]`.
  loss: a pure function of `losses`' keyword arguments and `**options.loss_args()` ->
    (loss float32 scalar, aux dict of float32 scalars).
  options: the options dataclass (defaults = the paper's), with `advantage_args()` / `loss_args()`.
  clips: the loss clips a ratio pi_theta / pi_old: it takes `proximal_logprobs`, a correction's
    proximal policy (`corrections.Mode.proximal`), whose ratio is 1 in value, so its clip range
    must then be open on both sides (`options.eps_low`, `options.eps_high` > 0).
  min_group_size: the smallest rollout.group_size whose advantages carry a signal (GRPO's group
    standardisation makes a group of 1 zero).
  """
  advantages: Callable[..., Array]
  loss: Callable[..., tuple[Array, dict[str, Array]]]
  options: type
  clips: bool = False
  min_group_size: int = 1


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(losses.grpo_advantages, losses.grpo_loss, GrpoOptions, clips=True,
                      min_group_size=2),
    "asymre": Algorithm(losses.asymre_advantages, losses.asymre_loss, AsymreOptions),
}


def get(name: str) -> Algorithm:
  """ALGORITHMS[name], or a ValueError naming the known algorithms."""
  if name not in ALGORITHMS:
    raise ValueError(f"loss {name!r} is unknown; expected one of {tuple(ALGORITHMS)}")
  return ALGORITHMS[name]


def _options(name: str, options: Any) -> Any:
  """`options` checked to be algorithm `name`'s dataclass; None: its defaults."""
  cls = get(name).options
  if options is None:
    return cls()
  if not isinstance(options, cls):
    raise TypeError(f"loss {name!r} takes {cls.__name__}, got {type(options).__name__}")
  return options


def advantages(name: str, rewards: Array, options: Any = None) -> Array:
  """Algorithm `name`'s advantages of rewards [P, G] (float32 [P, G]) with its options."""
  return get(name).advantages(rewards, **_options(name, options).advantage_args())


_NO_CORRECTION = corrections.OffPolicyOptions()


def _segments(batch: Batch) -> Optional[Array]:
  """The segment ids that delimit rollouts in a packed batch; None when each row is one rollout."""
  return batch.segment_ids if batch.packed else None


def loss(name: str, logprobs: Array, batch: Batch, ref_logprobs: Optional[Array] = None, *,
         aggregation: str = "token_mean", normalizer: Optional[float] = None,
         kl_coef: float = 0.0, kl_clamp: float = 0.0, options: Any = None,
         off_policy: corrections.OffPolicyOptions = _NO_CORRECTION
         ) -> tuple[Array, dict[str, Array]]:
  """Algorithm `name`'s loss on a Batch, with the off-policy correction `off_policy`.

  The correction (`corrections.correct`: "none" gives nothing, the loss unchanged) hands the loss
  its per-token weights and, to a loss that clips (`Algorithm.clips`), its proximal log-probs:
  "tis" then clips against stop_gradient(logprobs) (ratio 1 in value) and weights each token by
  w = min(pi_theta / pi_sampler, C), so the gradient is -w A grad log pi_theta (see
  `loss_fn.make_loss_fn`); the masks weight tokens 0 or 1.

  Args:
    logprobs: float [B, T], log pi_theta (gradients flow). batch: the `Batch` (its behaviour
      log-probs, advantages, completion mask and, packed, segment ids).
    ref_logprobs: float [B, T] of the KL reference, or None.
    aggregation, normalizer, kl_coef, kl_clamp: as the losses take them (`losses.grpo_loss`).
    options: the algorithm's options dataclass (None: its defaults).
    off_policy: the correction's `corrections.OffPolicyOptions`.

  Returns:
    (loss float32 scalar, aux: the loss's statistics and the correction's).
  """
  algorithm = get(name)
  options = _options(name, options)
  segments = _segments(batch)
  correction = corrections.correct(off_policy, logprobs, batch.behaviour_logprobs,
                                   batch.completion_mask, segments)
  kw = {}
  if kl_clamp:  # off: the losses exactly as without the option
    kw["kl_clamp"] = kl_clamp
  if correction.weights is not None:
    kw["token_weights"] = correction.weights
  if algorithm.clips and correction.proximal_logprobs is not None:
    kw["proximal_logprobs"] = correction.proximal_logprobs
  value, aux = algorithm.loss(
      logprobs=logprobs, behaviour_logprobs=batch.behaviour_logprobs, advantages=batch.advantages,
      mask=batch.completion_mask, aggregation=aggregation, normalizer=normalizer,
      ref_logprobs=ref_logprobs, kl_coef=kl_coef, segment_ids=segments, **kw,
      **options.loss_args())
  return value, {**aux, **correction.aux}


def check_off_policy(name: str, options: Any, off_policy: corrections.OffPolicyOptions) -> None:
  """Raises ValueError when algorithm `name` with `options` cannot take the correction: a loss
  that clips, against a proximal policy (ratio 1), needs both sides of its clip open (eps > 0):
  on a clip boundary the gradients of min / clip split at the tie."""
  if not (get(name).clips and off_policy.uses_proximal):
    return
  eps = {k: v for k, v in dataclasses.asdict(options).items() if k in ("eps_low", "eps_high")}
  if not all(v > 0 for v in eps.values()):
    what = (f"trainer.tis_cap={off_policy.tis_cap}" if off_policy.tis_cap
            else f"trainer.off_policy={off_policy.off_policy!r}")
    raise ValueError(f"{what} needs eps_low > 0 and eps_high > 0 (got "
                     f"{', '.join(str(v) for v in eps.values())}): the clipped ratio is then "
                     "exactly 1, and on a clip boundary the gradients of min / clip split at the tie")


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
