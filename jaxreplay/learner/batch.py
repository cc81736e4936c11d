"""The two records the trainer consumes: `Rollout` (one sampled completion, host side) and `Batch`.

`Batch` is the trainer's fixed-shape batch: one rollout per row, right-padded to a length bucket
(or, packed, several rollouts per row: see "Packed layout" below).

Shapes (B rows, T = the bucket length in tokens):
  tokens             int32   [B, T]  prompt + completion tokens, then padding (pad id 0)
  positions          int32   [B, T]  0..len-1 on valid tokens, 0 on padding
  segment_ids        int32   [B, T]  1 on valid tokens, 0 on padding (attention mask)
  targets            int32   [B, T]  tokens shifted left by one: targets[:, t] = tokens[:, t + 1]
  completion_mask    float32 [B, T]  1 where targets[:, t] is a completion token, else 0
  behaviour_logprobs float32 [B, T]  sampler's log-prob of targets[:, t] (0 where mask is 0)
  advantages         float32 [B]     group-relative advantage of the row's rollout
  rewards            float32 [B]     the rollout's reward
  policy_version     int32   [B]     version of the policy that generated the rollout (its oldest
                                     token's, for a rollout continued across weight refreshes)
  token_versions     int32   [B, T]  optional (None unless collated with `token_versions=True`):
                                     the version of the policy that sampled targets[:, t], aligned
                                     with completion_mask (0 where it is 0); a rollout continued
                                     across refreshes (`rollout.partial="continue"`) holds several
A row that is all padding (mask 0) contributes nothing to any loss.

Multi-turn trajectories (`rollout.multiturn`): a rollout's completion holds the policy's turns and
the environment's observations between them; `completion_mask` is 0 on the observation tokens too
(`Rollout.completion_mask`), so they enter no loss, KL, entropy or off-policy statistic, and their
`behaviour_logprobs` are 0.

Packed layout (`collate.collate(..., pack=True)`; `Batch.packed` is True): a row holds several
rollouts one after another, rollout k of the row in segment k (segment_ids 1, 2, ...; 0 on
padding), its positions restarting at 0 and the target of its last token padding. The
per-rollout fields become per-token, each token carrying its rollout's value (0 on padding):
  advantages         float32 [B, T]
  rewards            float32 [B, T]
  policy_version     int32   [B, T]
(`token_versions`, per token already, is laid out as `behaviour_logprobs` in both layouts.)
A rollout is then a (row, segment) pair: per-sequence statistics (`losses.aggregate`'s
"sequence_mean", advantage_mean) are taken over those, not over rows.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import numpy as np


class Batch(NamedTuple):
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  targets: np.ndarray
  completion_mask: np.ndarray
  behaviour_logprobs: np.ndarray
  advantages: np.ndarray
  rewards: np.ndarray
  policy_version: np.ndarray
  token_versions: Any = None  # int32 [B, T] or None (module docstring)

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens.shape)

  @property
  def packed(self) -> bool:
    """Whether rows may hold several rollouts (per-token advantages; see the module docstring).
    Static under jit: it reads a rank, not values."""
    return len(self.advantages.shape) == 2


def zeros(batch_size: int, seq_len: int) -> Batch:
  """An all-padding batch of the given shape (useful for eval_shape and compilation)."""
  bt = (batch_size, seq_len)
  return Batch(
      tokens=np.zeros(bt, np.int32),
      positions=np.zeros(bt, np.int32),
      segment_ids=np.zeros(bt, np.int32),
      targets=np.zeros(bt, np.int32),
      completion_mask=np.zeros(bt, np.float32),
      behaviour_logprobs=np.zeros(bt, np.float32),
      advantages=np.zeros((batch_size,), np.float32),
      rewards=np.zeros((batch_size,), np.float32),
      policy_version=np.zeros((batch_size,), np.int32),
  )


def _int_array(x: Any, name: str) -> np.ndarray:
  a = np.asarray(x)
  if a.ndim != 1:
    raise ValueError(f"Rollout.{name} must be a 1-D token array, got shape {a.shape}")
  if a.size and a.dtype.kind not in "iu":
    raise ValueError(f"Rollout.{name} must hold integer token ids, got dtype {a.dtype}")
  a = a.astype(np.int32, copy=False)
  if a.size == 0:
    raise ValueError(f"Rollout.{name} is empty; a rollout needs at least one prompt and one "
                     "completion token")
  if a.min() < 0:
    raise ValueError(f"Rollout.{name} has a negative token id ({int(a.min())})")
  return a


@dataclasses.dataclass(eq=False)  # identity equality: fields hold numpy arrays
class Rollout:
  """One sampled completion of one prompt, with everything the trainer needs.

  prompt_tokens      int32   [Lp]  the prompt (Lp >= 1)
  completion_tokens  int32   [Lc]  the sampled completion (Lc >= 1)
  logprobs           float32 [Lc]  the sampler's log-prob of each completion token
  reward             float         the task reward
  advantage          float         group-relative advantage (computed by the producer)
  policy_version     int           version of the weights that sampled it
  group_id           int           id of the prompt group it belongs to
  uid                int           unique, increasing id assigned by `ReplayBuffer.add` (-1 before)
  use_count          int           times the buffer returned it from `sample`
  completion_mask    float32 [Lc]  multi-turn: 1 on the policy's tokens, 0 on the environment's
                                   (observations between turns; their logprobs are 0); None: every
                                   completion token is the policy's (one turn)
  turn_starts        int32   [K]   multi-turn: where each of the policy's K turns starts in the
                                   completion (turn_starts[0] = 0, increasing, each on a policy
                                   token); None: one turn
  token_versions     int32   [Lc]  optional: the policy version that sampled each completion token,
                                   for a completion continued across weight refreshes
                                   (`rollout.partial="continue"`); its minimum (the oldest token's)
                                   must be `policy_version`. None: every token at policy_version
  Inputs are converted to these dtypes (integer token arrays only); bad input raises ValueError.
  """
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  logprobs: np.ndarray
  reward: float
  advantage: float
  policy_version: int
  group_id: int
  uid: int = -1
  use_count: int = 0
  completion_mask: Optional[np.ndarray] = None
  turn_starts: Optional[np.ndarray] = None
  token_versions: Optional[np.ndarray] = None

  def __post_init__(self):
    self.prompt_tokens = _int_array(self.prompt_tokens, "prompt_tokens")
    self.completion_tokens = _int_array(self.completion_tokens, "completion_tokens")
    lp = np.asarray(self.logprobs)
    if lp.ndim != 1 or lp.shape[0] != self.completion_tokens.shape[0]:
      raise ValueError(f"Rollout.logprobs has shape {lp.shape}, expected one log-prob per "
                       f"completion token: ({self.completion_tokens.shape[0]},)")
    if lp.dtype.kind not in "fiu":
      raise ValueError(f"Rollout.logprobs must be floats, got dtype {lp.dtype}")
    self.logprobs = lp.astype(np.float32, copy=False)
    if not np.all(np.isfinite(self.logprobs)):
      bad = np.flatnonzero(~np.isfinite(self.logprobs))
      raise ValueError(
          f"Rollout.logprobs has {bad.size} non-finite values (NaN/inf) of {self.logprobs.size}, "
          f"first at completion token {int(bad[0])} (token id "
          f"{int(self.completion_tokens[bad[0]])}, value {self.logprobs[bad[0]]}); the rollout "
          f"came from policy version {self.policy_version}, group {self.group_id}. The sampler "
          "computed them from the weights it was given: if that version's parameters are NaN the "
          "training diverged before it (see nonfinite_skipped and param_norm in metrics.jsonl), "
          "otherwise the sampler overflowed (try float32 or a lower temperature)")
    for name in ("reward", "advantage"):
      v = float(getattr(self, name))
      if not math.isfinite(v):
        raise ValueError(f"Rollout.{name}={v} must be finite")
      setattr(self, name, v)
    for name in ("policy_version", "group_id", "uid", "use_count"):
      v = getattr(self, name)
      if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"Rollout.{name} must be an int, got {v!r}")
      setattr(self, name, int(v))
    if self.token_versions is not None:
      self.token_versions = self._checked_versions(self.token_versions)
    if self.completion_mask is not None or self.turn_starts is not None:
      self._check_turns()

  def _check_turns(self) -> None:
    """Multi-turn fields: a {0, 1} mask [Lc] whose first token is the policy's, logprobs 0 on the
    environment's tokens, turn starts increasing from 0, each on a policy token."""
    lc = self.completion_tokens.shape[0]
    mask = (np.ones(lc, np.float32) if self.completion_mask is None
            else np.asarray(self.completion_mask))
    if mask.shape != (lc,) or not np.all((mask == 0) | (mask == 1)):
      raise ValueError(f"Rollout.completion_mask must be {{0, 1}} [{lc}] (one per completion "
                       f"token), got shape {mask.shape}")
    mask = mask.astype(np.float32, copy=False)
    if mask[0] != 1:
      raise ValueError("Rollout.completion_mask[0] is 0: a completion starts with a policy turn")
    if np.any(self.logprobs[mask == 0] != 0):
      raise ValueError("Rollout.logprobs must be 0 on environment tokens (completion_mask 0)")
    starts = (np.zeros(1, np.int32) if self.turn_starts is None
              else np.asarray(self.turn_starts))
    if (starts.ndim != 1 or starts.size == 0 or starts.dtype.kind not in "iu" or starts[0] != 0
        or np.any(np.diff(starts) <= 0) or starts[-1] >= lc or np.any(mask[starts] != 1)):
      raise ValueError(f"Rollout.turn_starts={starts.tolist()[:8]} must be increasing offsets in "
                       f"[0, {lc}) starting at 0, each on a policy token (completion_mask 1)")
    self.completion_mask = mask
    self.turn_starts = starts.astype(np.int32, copy=False)

  @property
  def num_turns(self) -> int:
    """The policy's turns in the completion (1 for a single-turn rollout)."""
    return 1 if self.turn_starts is None else int(self.turn_starts.shape[0])

  @property
  def policy_tokens(self) -> int:
    """Completion tokens the policy generated (all of them unless multi-turn)."""
    if self.completion_mask is None:
      return int(self.completion_tokens.shape[0])
    return int(self.completion_mask.sum())

  def _checked_versions(self, versions: Any) -> np.ndarray:
    v = np.asarray(versions)
    if v.shape != self.completion_tokens.shape or (v.size and v.dtype.kind not in "iu"):
      raise ValueError(f"Rollout.token_versions has shape {v.shape} dtype {v.dtype}, expected one "
                       f"integer policy version per completion token: "
                       f"({self.completion_tokens.shape[0]},)")
    v = v.astype(np.int32, copy=False)
    if int(v.min()) != self.policy_version:
      raise ValueError(f"Rollout.policy_version={self.policy_version} must be the oldest of its "
                       f"token_versions (min {int(v.min())}): a continued rollout is as old as "
                       "its first token")
    return v

  @property
  def newest_version(self) -> int:
    """The version of its newest token (`policy_version` when all tokens share one)."""
    return self.policy_version if self.token_versions is None else int(self.token_versions.max())

  def versions_per_token(self) -> np.ndarray:
    """int32 [Lc]: each completion token's policy version."""
    if self.token_versions is not None:
      return self.token_versions
    return np.full(self.completion_tokens.shape[0], self.policy_version, np.int32)

  @property
  def length(self) -> int:
    """Prompt + completion tokens."""
    return self.prompt_tokens.shape[0] + self.completion_tokens.shape[0]
