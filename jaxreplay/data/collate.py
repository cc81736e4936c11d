"""Rollouts -> the trainer's fixed-shape `Batch`, right-padded to a length bucket (or packed).

Row i holds rollout i: its prompt then its completion (length L_i = Lp_i + Lc_i tokens), then
padding up to T, the smallest bucket >= max_i L_i. Targets are the next tokens, so position t
predicts targets[:, t] = tokens[:, t + 1]; the completion tokens are the targets of positions
Lp_i - 1 .. L_i - 2, which is where `completion_mask` is 1 and `behaviour_logprobs` holds the
sampler's log-probs (see `jaxreplay.learner.batch`).

Everything is vectorised with numpy: the token arrays are concatenated once and scattered into the
[B, T] arrays with boolean masks (row-major order matches the concatenation order).

`collate(..., pack=True)` packs several rollouts per row instead (`pack_rows`): first-fit
decreasing by length into rows of T tokens, T the bucket (>= the longest rollout) that needs the
fewest token slots rows * T, each rollout its own segment (segment ids 1, 2, ... within a row,
positions restarting at 0), with advantages, rewards and policy versions per token; see
`jaxreplay.learner.batch` for the packed layout. The row count is rounded (`packed_row_count`) so that a
run compiles a bounded number of shapes, and never exceeds the unpacked one.

Multi-turn trajectories (`Rollout.completion_mask` set): the environment's tokens inside a
completion are targets like the others but get `completion_mask` 0 (and behaviour log-prob 0), in
either layout; rollouts without a mask are unchanged.

Per-token versions (rollouts continued across weight refreshes, `rollout.partial="continue"`):
`token_versions=True` adds `Batch.token_versions` [B, T], each completion token's policy version
laid out as `behaviour_logprobs` (from `Rollout.token_versions`, or the rollout's one version);
`min_token_version=v` masks out (completion_mask 0, behaviour log-prob 0) every completion token
sampled by a version older than v: `buffer.max_staleness` enforced per token.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxreplay.learner import batch as batch_lib
from jaxreplay.learner.batch import Batch

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
            batch_size: Optional[int] = None, pack: bool = False, row_multiple: int = 1,
            same_bucket: bool = False, token_versions: bool = False,
            min_token_version: Optional[int] = None) -> Batch:
  """Packs rollouts (objects with the `buffer.Rollout` fields) into a `Batch`, one per row.

  Args:
    rollouts: n rollouts; prompt_tokens / completion_tokens int32 [Lp] / [Lc], logprobs [Lc].
    buckets: allowed sequence lengths T; the smallest one >= the longest rollout is used.
    pad_id: token id written in padding (tokens and targets).
    batch_size: pad with all-padding rows up to this many rows, so every step has the same shape
      (ValueError if n > batch_size). None: n rows.
    pack: several rollouts per row (module docstring: T is then the bucket that needs the fewest
      token slots, rows `packed_row_count`); the packed layout of `jaxreplay.learner.batch` (per-token
      advantages, rewards and policy versions).
    row_multiple: with pack, the row count is a multiple of this (the trainer's
      data * fsdp * num_microbatches); batch_size (when given) must be one too.
    same_bucket: with pack, keep T = the bucket of the unpacked batch (the smallest >= the longest
      rollout) instead of the one with the fewest token slots: the "constant" aggregation's default
      normaliser (rollouts * T in the train step) then equals the unpacked B * T.
    token_versions: fill `Batch.token_versions` (int32 [rows, T]); False leaves it None.
    min_token_version: mask out the completion tokens sampled by a version older than this
      (module docstring); None masks nothing.
  Returns:
    Batch with [rows, T] int32/float32 arrays and [rows] advantages, rewards, policy_version
    ([rows, T] when packed).
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
  versions = _TokenVersions(rollouts, token_versions, min_token_version)
  if pack and n:
    return versions.apply(*_collate_packed(rollouts, buckets, pad_id, batch_size,
                                           int(row_multiple), same_bucket))
  if n == 0:
    if batch_size is None:
      raise ValueError("collate got no rollouts: pass batch_size to build an all-padding batch")
    b = batch_lib.zeros(batch_size, _check_buckets(buckets)[0])
    b = b._replace(tokens=np.full_like(b.tokens, pad_id), targets=np.full_like(b.targets, pad_id))
    return versions.apply(b)
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
  policy = _policy_mask(rollouts)
  if policy is not None:  # multi-turn: the environment's tokens are no targets of any loss
    completion_mask[:n][in_completion] = policy
  behaviour_logprobs = np.zeros((rows, seq_len), np.float32)
  behaviour_logprobs[:n][in_completion] = flat_logprobs

  def per_row(field, dtype):
    out = np.zeros((rows,), dtype)
    out[:n] = np.fromiter((getattr(r, field) for r in rollouts), dtype, n)
    return out

  return versions.apply(Batch(
      tokens=tokens, positions=positions, segment_ids=segment_ids, targets=targets,
      completion_mask=completion_mask, behaviour_logprobs=behaviour_logprobs,
      advantages=per_row("advantage", np.float32), rewards=per_row("reward", np.float32),
      policy_version=per_row("policy_version", np.int32)), np.flatnonzero(in_completion))


class _TokenVersions:
  """Each completion token's policy version, written into a collated batch (`token_versions`)
  and used to mask the too-stale ones (`min_token_version`); nothing when neither is asked.

  `apply(batch, where)`: `where` int [n tokens] are the flat [rows * T] positions of the
  completion tokens in rollout order (where their behaviour log-probs went, environment tokens of
  multi-turn trajectories included; their versions are then zeroed with their mask); None only for
  an all-padding batch (no completion token)."""

  def __init__(self, rollouts: Sequence, fill: bool, min_version: Optional[int]):
    self.fill, self.min_version = bool(fill), min_version
    self.flat = None
    if (self.fill or min_version is not None) and rollouts:
      self.flat = np.concatenate([r.versions_per_token() for r in rollouts]).astype(np.int32)

  def apply(self, batch: Batch, where: Optional[np.ndarray] = None) -> Batch:
    if not self.fill and self.min_version is None:
      return batch
    in_completion = batch.completion_mask > 0
    versions = np.zeros(batch.tokens.shape, np.int32)
    if self.flat is not None:
      versions.reshape(-1)[where] = self.flat
      versions[~in_completion] = 0
    if self.fill:
      batch = batch._replace(token_versions=versions)
    if self.min_version is not None:
      stale = in_completion & (versions < int(self.min_version))
      batch = batch._replace(
          completion_mask=np.where(stale, 0.0, batch.completion_mask).astype(np.float32),
          behaviour_logprobs=np.where(stale, 0.0, batch.behaviour_logprobs).astype(np.float32))
      if self.fill:
        batch = batch._replace(token_versions=np.where(stale, 0, versions).astype(np.int32))
    return batch


def _policy_mask(rollouts: Sequence) -> Optional[np.ndarray]:
  """float32 [sum Lc]: the concatenated `completion_mask` of the rollouts (1 for those without
  one), or None when no rollout has one (single-turn)."""
  masks = [getattr(r, "completion_mask", None) for r in rollouts]
  if all(m is None for m in masks):
    return None
  return np.concatenate([np.ones(r.completion_tokens.shape[0], np.float32) if m is None
                         else np.asarray(m, np.float32) for r, m in zip(rollouts, masks)])


# ---- packing ------------------------------------------------------------------------------------

# A packed batch's row count is rounded up to one of at most this many sizes per bucket, so the
# jitted train step compiles a bounded number of shapes.
ROW_SIZES_PER_BUCKET = 8


def pack_rows(lengths: Sequence[int], seq_len: int) -> np.ndarray:
  """First-fit decreasing: int [n] row index of each sequence in rows of `seq_len` tokens.

  Sequences are placed longest first (ties: the earlier one first), each into the first row with
  room; the rows are numbered in order of opening.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and (lengths.max() > seq_len or lengths.min() < 1):
    raise ValueError(f"pack_rows: lengths must lie in [1, {seq_len}], got {lengths.min()}.."
                     f"{lengths.max()}")
  row_of = np.empty(lengths.shape[0], np.int64)
  free: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    length = int(lengths[i])
    for r, room in enumerate(free):
      if room >= length:
        free[r] -= length
        row_of[i] = r
        break
    else:
      row_of[i] = len(free)
      free.append(seq_len - length)
  return row_of


def packed_row_count(needed: int, cap: int, row_multiple: int = 1) -> int:
  """The rows of a packed batch that needs `needed` rows: the smallest multiple of the quantum
  q = row_multiple * ceil(cap / (ROW_SIZES_PER_BUCKET * row_multiple)) >= needed, at most `cap`.

  `cap` (the unpacked row count, a multiple of row_multiple) bounds it, so packing never adds rows,
  and a bucket sees at most ROW_SIZES_PER_BUCKET + 1 row counts (one compile each).
  """
  if row_multiple < 1 or cap % row_multiple:
    raise ValueError(f"packing into at most {cap} rows with row_multiple={row_multiple}: the row "
                     "count must be a multiple of data * fsdp * num_microbatches; make "
                     "buffer.batch_size a multiple of it")
  quantum = row_multiple * -(-cap // (ROW_SIZES_PER_BUCKET * row_multiple))
  return min(cap, quantum * -(-needed // quantum))


def _collate_packed(rollouts: list, buckets: Sequence[int], pad_id: int,
                    batch_size: Optional[int], row_multiple: int, same_bucket: bool
                    ) -> tuple[Batch, np.ndarray]:
  """The packed batch and the flat [rows * T] positions of its completion tokens, in order."""
  n = len(rollouts)
  lp = np.fromiter((r.prompt_tokens.shape[0] for r in rollouts), np.int64, n)
  lc = np.fromiter((r.completion_tokens.shape[0] for r in rollouts), np.int64, n)
  length = lp + lc
  cap = batch_size if batch_size is not None else row_multiple * -(-n // row_multiple)
  # The bucket (>= the longest rollout) whose packing needs the fewest token slots rows * T; on a
  # tie the shorter one (less attention work per token).
  best = None
  smallest = pick_bucket(int(length.max()), buckets)  # raises when no bucket is long enough
  for seq_len in _check_buckets(buckets):
    if seq_len < smallest or (same_bucket and seq_len != smallest):
      continue
    row_of = pack_rows(length, seq_len)
    rows = packed_row_count(int(row_of.max()) + 1, cap, row_multiple)
    if best is None or rows * seq_len < best[0] * best[1]:
      best = (rows, seq_len, row_of)
  rows, seq_len, row_of = best

  # Offsets and segment ids in rollout order within each row (stable: placement order is free).
  order = np.lexsort((np.arange(n), row_of))
  offset = np.zeros(n, np.int64)
  segment = np.zeros(n, np.int64)
  ends = np.cumsum(length[order])
  row_sorted = row_of[order]
  first = np.r_[True, row_sorted[1:] != row_sorted[:-1]]
  row_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
  offset[order] = ends - length[order] - np.r_[0, ends][row_start]
  segment[order] = np.arange(n) - row_start + 1

  # Flat [rows * T] index of every token, rollout by rollout (the concatenation order).
  total = int(length.sum())
  local = np.arange(total) - np.repeat(np.cumsum(length) - length, length)   # position in rollout
  flat = np.repeat(row_of * seq_len + offset, length) + local
  seqs = [None] * (2 * n)
  seqs[0::2] = [r.prompt_tokens for r in rollouts]
  seqs[1::2] = [r.completion_tokens for r in rollouts]

  def scatter(values, dtype, fill=0):
    out = np.full(rows * seq_len, fill, dtype)
    out[flat] = values
    return out.reshape(rows, seq_len)

  tokens = scatter(np.concatenate(seqs), np.int32, pad_id)
  positions = scatter(local, np.int32)
  segment_ids = scatter(np.repeat(segment, length), np.int32)
  # Target of a token: the next token of its own rollout; its last token's target is padding.
  last = local == np.repeat(length - 1, length)
  next_flat = np.minimum(flat + 1, rows * seq_len - 1)
  targets = scatter(np.where(last, pad_id, tokens.reshape(-1)[next_flat]), np.int32, pad_id)
  # Positions Lp-1 .. L-2 of a rollout predict its completion tokens.
  in_completion = (local >= np.repeat(lp - 1, length)) & ~last
  completion = in_completion.astype(np.float32)
  policy = _policy_mask(rollouts)
  if policy is not None:  # multi-turn: the environment's tokens are no targets of any loss
    completion[in_completion] = policy
  completion_mask = scatter(completion, np.float32)
  behaviour = np.zeros(total, np.float32)
  behaviour[in_completion] = np.concatenate([r.logprobs for r in rollouts])
  behaviour_logprobs = scatter(behaviour, np.float32)

  def per_token(field, dtype):
    values = np.fromiter((getattr(r, field) for r in rollouts), dtype, n)
    return scatter(np.repeat(values, length), dtype)

  batch = Batch(
      tokens=tokens, positions=positions, segment_ids=segment_ids, targets=targets,
      completion_mask=completion_mask, behaviour_logprobs=behaviour_logprobs,
      advantages=per_token("advantage", np.float32), rewards=per_token("reward", np.float32),
      policy_version=per_token("policy_version", np.int32))
  return batch, flat[in_completion]  # where each completion token (in rollout order) went


def padding_fraction(batch: Batch) -> float:
  """Share of the batch's [B, T] token slots that hold padding (segment id 0)."""
  return float(np.mean(np.asarray(batch.segment_ids) == 0))
