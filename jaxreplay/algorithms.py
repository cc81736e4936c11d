"""The RL algorithms the trainer knows: name -> (advantage function, loss function) over `losses`.

The one table of algorithms: `experience.make_advantage_fn` reads its advantages (computed once, at
generation time, and stored with each rollout), `trainer.LossFn` its loss (in the train step), and
`trainer.LOSSES` is its keys. To add an algorithm: its pure functions in `losses.py`, an entry here,
the statistics it returns in `losses.AUX_KINDS`, numpy-reference tests in `tests/test_losses.py`.

  "grpo"    GRPO (arXiv 2402.03300): group-standardised advantages, clipped-ratio loss; optional
            truncated importance sampling (see `grpo_loss`).
  "asymre"  Asymmetric REINFORCE (arXiv 2506.20520): advantages against a shifted group baseline,
            REINFORCE loss without an importance ratio (so without clipping or truncated IS).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import chex
import jax

from jaxreplay import losses
from jaxreplay.batch import Batch

Array = chex.Array


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """How rewards become advantages and how the loss is computed, with the options each takes.

  advantages: `(rewards [P, G], **{o: value for o in advantage_options}) -> float32 [P, G]`.
  loss: `(logprobs [B, T], batch, ref_logprobs [B, T] or None, *, aggregation, normalizer, kl_coef,
    **{o: value for o in loss_options}) -> (loss float32 scalar, aux dict of float32 scalars)`.
  advantage_options, loss_options: the keyword hyper-parameters beyond those every algorithm takes,
    named as in `config.trainer` and the fields of `trainer.LossFn`.
  """
  advantages: Callable[..., Array]
  loss: Callable[..., tuple[Array, dict[str, Array]]]
  advantage_options: tuple[str, ...] = ()
  loss_options: tuple[str, ...] = ()


def grpo_advantages(rewards: Array, *, adv_eps: float = 1e-6) -> Array:
  """`losses.grpo_advantages(rewards, eps=adv_eps)`: rewards [P, G] -> float32 [P, G]."""
  return losses.grpo_advantages(rewards, eps=adv_eps)


def asymre_advantages(rewards: Array, *, tau: float = -0.1) -> Array:
  """`losses.asymre_advantages(rewards, tau)`: rewards [P, G] -> float32 [P, G]."""
  return losses.asymre_advantages(rewards, tau=tau)


def _segments(batch: Batch) -> Optional[Array]:
  """The segment ids that delimit rollouts in a packed batch; None when each row is one rollout."""
  return batch.segment_ids if batch.packed else None


def grpo_loss(logprobs: Array, batch: Batch, ref_logprobs: Optional[Array] = None, *,
              aggregation: str = "token_mean", normalizer: Optional[float] = None,
              kl_coef: float = 0.0, eps_low: float = 0.2, eps_high: float = 0.2,
              tis_cap: float = 0.0) -> tuple[Array, dict[str, Array]]:
  """`losses.grpo_loss` on a Batch; with tis_cap = C > 0, truncated IS at the current params.

  tis_cap = 0: the plain clipped loss, ratio pi_theta / pi_sampler (Batch.behaviour_logprobs).
  tis_cap = C > 0: tis_logprobs = stop_gradient(logprobs), so the token weight is
  w = stop_gradient(min(pi_theta / pi_sampler, C)), the clipped ratio is the trainer's own
  (1 in value), and the gradient of the per-token loss wrt log pi_theta is -w * A (see
  `trainer.make_loss_fn` for the full statement and references).
  """
  tis = {}
  if tis_cap:
    tis = dict(tis_logprobs=jax.lax.stop_gradient(logprobs), tis_cap=tis_cap)
  return losses.grpo_loss(logprobs, batch.behaviour_logprobs, batch.advantages,
                          batch.completion_mask, eps_low, eps_high, aggregation=aggregation,
                          normalizer=normalizer, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                          segment_ids=_segments(batch), **tis)


def asymre_loss(logprobs: Array, batch: Batch, ref_logprobs: Optional[Array] = None, *,
                aggregation: str = "token_mean", normalizer: Optional[float] = None,
                kl_coef: float = 0.0) -> tuple[Array, dict[str, Array]]:
  """`losses.asymre_loss` on a Batch; behaviour log-probs only feed the ratio_* statistics."""
  return losses.asymre_loss(logprobs, batch.advantages, batch.completion_mask,
                            aggregation=aggregation, normalizer=normalizer,
                            ref_logprobs=ref_logprobs, kl_coef=kl_coef,
                            behaviour_logprobs=batch.behaviour_logprobs,
                            segment_ids=_segments(batch))


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(grpo_advantages, grpo_loss, advantage_options=("adv_eps",),
                      loss_options=("eps_low", "eps_high", "tis_cap")),
    "asymre": Algorithm(asymre_advantages, asymre_loss, advantage_options=("tau",)),
}


def get(name: str) -> Algorithm:
  """ALGORITHMS[name], or a ValueError naming the known algorithms."""
  if name not in ALGORITHMS:
    raise ValueError(f"loss {name!r} is unknown; expected one of {tuple(ALGORITHMS)}")
  return ALGORITHMS[name]
