"""Mixed single- and multi-turn rollouts for the masking tests (tests/learner/test_batch.py,
tests/data/test_buffer.py): token ids below `vocab`, behaviour log-probs in [-3, -0.1] on the
policy's tokens and 0 on the environment's, nonzero advantages.

`mixed_rollouts(seed)`: 6 rollouts in groups of 2: multi-turn ones (2-3 policy turns with 2-5
observation tokens between them: `completion_mask` 0, `turn_starts`) and single-turn ones (no mask).
`env_positions(batch, rollouts)`: bool [B, T], the environment's target positions in a collated
batch (completion targets whose mask is 0).
`moved_env_targets(batch, env, vocab, seed)`: what the mask must hide (the environment's target
tokens and their behaviour log-probs changed); `poked_policy_target(batch, vocab)`: the control
(one policy token's target changed).
"""
import dataclasses

import numpy as np

from jaxreplay.data import collate as collate_lib
from jaxreplay.learner.batch import Rollout


def _trajectory(rng, turns: int, vocab: int):
  tokens, mask, starts = [], [], []
  for k in range(turns):
    if k:
      obs = rng.integers(3, vocab, rng.integers(2, 6))
      tokens += obs.tolist()
      mask += [0.0] * len(obs)
    starts.append(len(tokens))
    turn = rng.integers(3, vocab, rng.integers(2, 7))
    tokens += turn.tolist()
    mask += [1.0] * len(turn)
  return np.asarray(tokens, np.int32), np.asarray(mask, np.float32), np.asarray(starts, np.int32)


def mixed_rollouts(seed: int = 0, vocab: int = 64, n: int = 6) -> list[Rollout]:
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = rng.integers(3, vocab, rng.integers(3, 7)).astype(np.int32)
    multi = i % 3 != 2  # two of three multi-turn
    if multi:
      tokens, mask, starts = _trajectory(rng, int(rng.integers(2, 4)), vocab)
    else:
      tokens = rng.integers(3, vocab, rng.integers(4, 12)).astype(np.int32)
      mask = starts = None
    lp = -rng.uniform(0.1, 3.0, tokens.shape[0]).astype(np.float32)
    if multi:
      lp = np.where(mask > 0, lp, 0.0).astype(np.float32)
    adv = float(rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 1.5))
    out.append(Rollout(prompt_tokens=prompt, completion_tokens=tokens, logprobs=lp,
                       reward=float(adv > 0), advantage=adv, policy_version=int(i % 2),
                       group_id=i // 2, completion_mask=mask, turn_starts=starts))
  return out


def without_masks(rollouts):
  """The same rollouts with every completion token the policy's (what a replay path that drops
  the mask would train on)."""
  return [dataclasses.replace(r, completion_mask=None, turn_starts=None) for r in rollouts]


def env_positions(rollouts, **collate_kwargs) -> np.ndarray:
  """bool [B, T]: targets inside a completion whose mask is 0 in `collate(rollouts, **kwargs)`."""
  masked = collate_lib.collate(rollouts, **collate_kwargs).completion_mask
  full = collate_lib.collate(without_masks(rollouts), **collate_kwargs).completion_mask
  return (full > 0) & (masked == 0)


def moved_env_targets(batch, env: np.ndarray, vocab: int, seed: int = 3):
  """`batch` with every target at the environment's positions `env` (bool [B, T]) replaced by
  another token id (what the policy would be trained to predict there) and their behaviour
  log-probs by values in [-5, -0.1]; the inputs (`tokens`, the policy's context) are unchanged."""
  rng = np.random.default_rng(seed)
  moved = batch._replace(
      targets=np.where(env, (batch.targets + rng.integers(1, vocab, env.shape)) % vocab,
                       batch.targets).astype(np.int32),
      behaviour_logprobs=np.where(env, -rng.uniform(0.1, 5, env.shape),
                                  batch.behaviour_logprobs).astype(np.float32))
  assert (moved.targets != batch.targets).sum() == env.sum()
  return moved


def poked_policy_target(batch, vocab: int):
  """`batch` with the target of its first policy token (mask 1) changed: the control that moves
  an update."""
  pos = tuple(np.argwhere(batch.completion_mask > 0)[0])
  targets = batch.targets.copy()
  targets[pos] = (targets[pos] + 1) % vocab
  return batch._replace(targets=targets)
