"""The trainer's fixed-shape batch: one rollout per row, right-padded to a length bucket.

Shapes (B rows, T = the bucket length in tokens):
  tokens             int32   [B, T]  prompt + completion tokens, then padding (pad id 0)
  positions          int32   [B, T]  0..len-1 on valid tokens, 0 on padding
  segment_ids        int32   [B, T]  1 on valid tokens, 0 on padding (attention mask)
  targets            int32   [B, T]  tokens shifted left by one: targets[:, t] = tokens[:, t + 1]
  completion_mask    float32 [B, T]  1 where targets[:, t] is a completion token, else 0
  behaviour_logprobs float32 [B, T]  sampler's log-prob of targets[:, t] (0 where mask is 0)
  advantages         float32 [B]     group-relative advantage of the row's rollout
  rewards            float32 [B]     the rollout's reward
  policy_version     int32   [B]     version of the policy that generated the rollout
A row that is all padding (mask 0) contributes nothing to any loss.
"""
from __future__ import annotations

from typing import NamedTuple

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

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens.shape)


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
