"""Rollouts -> the trainer's fixed-shape `Batch`, right-padded to a length bucket.

Row i holds rollout i: its prompt then its completion (length L_i = Lp_i + Lc_i tokens), then
padding up to T, the smallest bucket >= max_i L_i. Targets are the next tokens, so position t
predicts targets[:, t] = tokens[:, t + 1]; the completion tokens are the targets of positions
Lp_i - 1 .. L_i - 2, which is where `completion_mask` is 1 and `behaviour_logprobs` holds the
sampler's log-probs (see `jaxreplay.batch`).

Everything is vectorised with numpy: the token arrays are concatenated once and scattered into the
[B, T] arrays with boolean masks (row-major order matches the concatenation order).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxreplay import batch as batch_lib
from jaxreplay.batch import Batch

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
  b = tuple(int(x) for x in buckets)
  if not b:
    raise ValueError("buckets is empty: give at least one sequence length, e.g. (512, 1024)")
  if any(x < 2 for x in b):
    raise ValueError(f"buckets={b}: every bucket must be >= 2 tokens (one prompt + one completion)")
  return tuple(sorted(set(b)))


def pick_bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= `length` (tokens); ValueError when none fits."""
  b = _check_buckets(buckets)
  length = int(length)
  if length > b[-1]:
    raise ValueError(f"a rollout of {length} tokens (prompt + completion) is longer than the "
                     f"largest bucket {b[-1]}: add a bucket >= {length} or cap the prompt length "
                     "and max_tokens")
  return b[int(np.searchsorted(b, length, side="left"))]


def collate(rollouts: Sequence, buckets: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0,
            batch_size: Optional[int] = None) -> Batch:
  """Packs rollouts (objects with the `buffer.Rollout` fields) into a `Batch`, one per row.

  Args:
    rollouts: n rollouts; prompt_tokens / completion_tokens int32 [Lp] / [Lc], logprobs [Lc].
    buckets: allowed sequence lengths T; the smallest one >= the longest rollout is used.
    pad_id: token id written in padding (tokens and targets).
    batch_size: pad with all-padding rows up to this many rows, so every step has the same shape
      (ValueError if n > batch_size). None: n rows.
  Returns:
    Batch with [rows, T] int32/float32 arrays and [rows] advantages, rewards, policy_version.
  """
  if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) or pad_id < 0:
    raise ValueError(f"pad_id={pad_id!r} must be a non-negative int token id")
  rollouts = list(rollouts)
  n = len(rollouts)
  if batch_size is not None:
    batch_size = int(batch_size)
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be >= 1 (or None for one row per rollout)")
    if n > batch_size:
      raise ValueError(f"collate got {n} rollouts for batch_size={batch_size} rows: sample at "
                       "most batch_size rollouts")
  rows = n if batch_size is None else batch_size
  if n == 0:
    if batch_size is None:
      raise ValueError("collate got no rollouts: pass batch_size to build an all-padding batch")
    b = batch_lib.zeros(batch_size, _check_buckets(buckets)[0])
    return b._replace(tokens=np.full_like(b.tokens, pad_id), targets=np.full_like(b.targets, pad_id))
  prompts = [r.prompt_tokens for r in rollouts]
  completions = [r.completion_tokens for r in rollouts]
  lp = np.fromiter((p.shape[0] for p in prompts), np.int32, n)  # int32 like `t`: no casts
  lc = np.fromiter((c.shape[0] for c in completions), np.int32, n)
  if lp.min() < 1 or lc.min() < 1:
    raise ValueError("every rollout needs at least one prompt and one completion token")
  length = lp + lc
  longest = int(length.max())
  seq_len = pick_bucket(longest, buckets)

  seqs = [None] * (2 * n)
  seqs[0::2], seqs[1::2] = prompts, completions
  flat_tokens = np.concatenate(seqs)
  flat_logprobs = np.concatenate([r.logprobs for r in rollouts])
  if flat_logprobs.shape[0] != int(lc.sum(dtype=np.int64)):
    raise ValueError("a rollout's logprobs length differs from its completion length")

  t = np.arange(seq_len, dtype=np.int32)[None, :]
  valid = t < length[:, None]                                       # [n, T]
  # Positions Lp-1 .. L-2 predict completion tokens; t < L-1 is valid[:, t + 1].
  in_completion = t >= (lp - 1)[:, None]
  in_completion[:, :-1] &= valid[:, 1:]
  in_completion[:, -1] = False

  tokens = np.full((rows, seq_len), pad_id, np.int32)
  tokens[:n][valid] = flat_tokens
  targets = np.empty_like(tokens)
  targets[:, :-1] = tokens[:, 1:]
  targets[:, -1] = pad_id
  positions = np.zeros((rows, seq_len), np.int32)
  np.multiply(t, valid, out=positions[:n])
  segment_ids = np.zeros((rows, seq_len), np.int32)
  segment_ids[:n] = valid
  completion_mask = np.zeros((rows, seq_len), np.float32)
  completion_mask[:n] = in_completion
  behaviour_logprobs = np.zeros((rows, seq_len), np.float32)
  behaviour_logprobs[:n][in_completion] = flat_logprobs

  def per_row(field, dtype):
    out = np.zeros((rows,), dtype)
    out[:n] = np.fromiter((getattr(r, field) for r in rollouts), dtype, n)
    return out

  return Batch(
      tokens=tokens, positions=positions, segment_ids=segment_ids, targets=targets,
      completion_mask=completion_mask, behaviour_logprobs=behaviour_logprobs,
      advantages=per_row("advantage", np.float32), rewards=per_row("reward", np.float32),
      policy_version=per_row("policy_version", np.int32))
