"""Tests of jaxreplay.data.collate: target shift, mask / log-prob alignment, buckets, padding rows."""
import chex
import numpy as np
import pytest

from jaxreplay.learner import batch as batch_lib
from jaxreplay.data import buffer
from jaxreplay.data import collate


def rollout(prompt, completion, logprobs, reward=1.0, advantage=0.5, version=0,
            token_versions=None):
  return buffer.Rollout(np.array(prompt), np.array(completion), np.array(logprobs, np.float32),
                        reward=reward, advantage=advantage, policy_version=version, group_id=0,
                        token_versions=token_versions)


def reference_collate(rollouts, seq_len, rows, pad_id=0, token_versions=False, min_version=None):
  """Token-by-token loops straight from the Batch docstring (the slow, obvious version); with
  token_versions each completion token's version, with min_version older tokens masked out."""
  out = {k: np.zeros((rows, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids",
                                                          "targets")}
  out["tokens"][:] = pad_id
  out["completion_mask"] = np.zeros((rows, seq_len), np.float32)
  out["behaviour_logprobs"] = np.zeros((rows, seq_len), np.float32)
  for i, r in enumerate(rollouts):
    seq = list(r.prompt_tokens) + list(r.completion_tokens)
    for t, tok in enumerate(seq):
      out["tokens"][i, t] = tok
      out["positions"][i, t] = t
      out["segment_ids"][i, t] = 1
  for i in range(rows):
    for t in range(seq_len):
      out["targets"][i, t] = out["tokens"][i, t + 1] if t + 1 < seq_len else pad_id
  versions = np.zeros((rows, seq_len), np.int32)
  for i, r in enumerate(rollouts):
    lp = len(r.prompt_tokens)
    for j, logprob in enumerate(r.logprobs):  # completion token j sits at lp + j, predicted at lp+j-1
      v = r.policy_version if r.token_versions is None else int(r.token_versions[j])
      if min_version is not None and v < min_version:
        continue  # too stale: masked out
      out["completion_mask"][i, lp + j - 1] = 1.0
      out["behaviour_logprobs"][i, lp + j - 1] = logprob
      versions[i, lp + j - 1] = v
  scalars = lambda f, dt: np.array([getattr(r, f) for r in rollouts] + [0] * (rows - len(rollouts)),
                                   dt)
  return batch_lib.Batch(**out, advantages=scalars("advantage", np.float32),
                         rewards=scalars("reward", np.float32),
                         policy_version=scalars("policy_version", np.int32),
                         token_versions=versions if token_versions else None)


def test_hand_built_batch():
  rs = [rollout([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], reward=1.0, advantage=0.5, version=3),
        rollout([4], [2], [-0.5], reward=0.0, advantage=-0.5, version=2)]
  got = collate.collate(rs, buckets=(4, 8), batch_size=3)
  expected = batch_lib.Batch(
      tokens=np.array([[5, 6, 7, 8, 9, 0, 0, 0], [4, 2, 0, 0, 0, 0, 0, 0], [0] * 8], np.int32),
      positions=np.array([[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0], [0] * 8], np.int32),
      segment_ids=np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8],
                           np.int32),
      targets=np.array([[6, 7, 8, 9, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0], [0] * 8], np.int32),
      completion_mask=np.array([[0, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8],
                               np.float32),
      behaviour_logprobs=np.array([[0, -0.1, -0.2, -0.3, 0, 0, 0, 0],
                                   [-0.5, 0, 0, 0, 0, 0, 0, 0], [0] * 8], np.float32),
      advantages=np.array([0.5, -0.5, 0.0], np.float32),
      rewards=np.array([1.0, 0.0, 0.0], np.float32),
      policy_version=np.array([3, 2, 0], np.int32))
  assert isinstance(got, batch_lib.Batch)
  chex.assert_trees_all_equal(got, expected)
  chex.assert_trees_all_equal_dtypes(got, expected)


@pytest.mark.parametrize("seed, batch_size, pad_id", [(0, None, 0), (1, 40, 0), (2, 33, 3)])
def test_matches_token_loop_reference(seed, batch_size, pad_id):
  rng = np.random.default_rng(seed)
  rs = []
  for i in range(33):
    lp, lc = int(rng.integers(1, 40)), int(rng.integers(1, 90))
    rs.append(rollout(rng.integers(1, 1000, lp), rng.integers(1, 1000, lc),
                      -rng.random(lc), reward=float(rng.random()), advantage=float(rng.normal()),
                      version=i))
  got = collate.collate(rs, buckets=(64, 128, 256), pad_id=pad_id, batch_size=batch_size)
  rows = batch_size or 33
  chex.assert_shape(got.tokens, (rows, 128))  # the longest is <= 39 + 89 = 128 and > 64
  assert max(r.length for r in rs) > 64
  chex.assert_trees_all_equal(got, reference_collate(rs, 128, rows, pad_id))
  chex.assert_trees_all_equal(got.completion_mask.sum(1)[:33], np.array([len(r.logprobs) for r in rs],
                                                                        np.float32))


def test_bucket_choice():
  assert collate.pick_bucket(1) == 128
  assert collate.pick_bucket(128) == 128
  assert collate.pick_bucket(129) == 256
  assert collate.pick_bucket(8192) == 8192
  assert collate.pick_bucket(5, buckets=(16, 4, 8)) == 8  # unsorted buckets are sorted
  with pytest.raises(ValueError, match="8193 tokens.*largest bucket 8192"):
    collate.pick_bucket(8193)
  with pytest.raises(ValueError, match="empty"):
    collate.pick_bucket(3, buckets=())
  rs = [rollout([1] * 100, [2] * 28, [0.0] * 28), rollout([1], [2], [0.0])]
  assert collate.collate(rs).shape == (2, 128)  # 128 tokens fit the 128 bucket exactly
  rs.append(rollout([1] * 100, [2] * 29, [0.0] * 29))
  assert collate.collate(rs).shape == (3, 256)


def test_bucket_exactly_full_row():
  r = rollout([1, 2], [3, 4], [-1.0, -2.0])
  got = collate.collate([r], buckets=(4,))
  chex.assert_trees_all_equal(got.targets, np.array([[2, 3, 4, 0]], np.int32))
  chex.assert_trees_all_equal(got.completion_mask, np.array([[0, 1, 1, 0]], np.float32))
  chex.assert_trees_all_equal(got.behaviour_logprobs, np.array([[0, -1, -2, 0]], np.float32))


def test_pad_rows_are_all_zero():
  rs = [rollout([1, 2, 3], [4, 5], [-0.1, -0.2], version=7)]
  got = collate.collate(rs, buckets=(8,), batch_size=5, token_versions=True)
  chex.assert_shape(got.tokens, (5, 8))
  chex.assert_shape([got.advantages, got.rewards, got.policy_version], (5,))
  for field in got:  # every field, token_versions included
    assert not np.any(field[1:]), "padding rows must be all zero"
  assert collate.collate(rs, buckets=(8,), batch_size=5).token_versions is None  # not asked
  empty = collate.collate([], buckets=(16, 8), batch_size=2)
  chex.assert_trees_all_equal(empty, batch_lib.zeros(2, 8))


def test_errors():
  r = rollout([1] * 10, [2] * 10, [0.0] * 10)
  with pytest.raises(ValueError, match="20 tokens.*largest bucket 16"):
    collate.collate([r], buckets=(8, 16))
  with pytest.raises(ValueError, match="2 rollouts for batch_size=1"):
    collate.collate([r, r], batch_size=1)
  with pytest.raises(ValueError, match="no rollouts"):
    collate.collate([])
  with pytest.raises(ValueError, match="pad_id"):
    collate.collate([r], pad_id=-1)


def test_collates_a_buffer_sample():
  buf = buffer.ReplayBuffer(capacity=16, seed=0)
  rng = np.random.default_rng(0)
  buf.add([rollout(rng.integers(1, 50, 5), rng.integers(1, 50, 7), -rng.random(7), version=v)
           for v in range(16)])
  sampled = buf.sample(6)
  got = collate.collate(sampled, batch_size=8)
  chex.assert_shape(got.tokens, (8, 128))
  chex.assert_trees_all_equal(got.policy_version[:6],
                              np.array([r.policy_version for r in sampled], np.int32))
  chex.assert_trees_all_equal(got.behaviour_logprobs[:6, 4:11],
                              np.stack([r.logprobs for r in sampled]))


# ---- packing -------------------------------------------------------------------------------------

def test_pack_rows_first_fit_decreasing_by_hand():
  # Longest first: 6 -> row 0 (room 2), 5 -> row 1 (3), 4 -> row 2 (4), 3 -> row 1 (0), 2 -> row 0.
  chex.assert_trees_all_equal(collate.pack_rows([5, 3, 4, 2, 6], 8), np.array([1, 1, 2, 0, 0]))
  chex.assert_trees_all_equal(collate.pack_rows([8, 8], 8), np.array([0, 1]))
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 8\]"):
    collate.pack_rows([9], 8)


def test_packed_row_count():
  assert collate.packed_row_count(9, cap=64) == 16        # quantum 64 / 8 = 8
  assert collate.packed_row_count(64, cap=64) == 64
  assert collate.packed_row_count(1, cap=64) == 8
  assert collate.packed_row_count(57, cap=60, row_multiple=4) == 60  # quantum 8, capped at 60
  assert collate.packed_row_count(3, cap=8, row_multiple=2) == 4     # quantum 2
  sizes = {collate.packed_row_count(k, cap=64, row_multiple=4) for k in range(1, 65)}
  assert len(sizes) <= collate.ROW_SIZES_PER_BUCKET and all(s % 4 == 0 for s in sizes)
  with pytest.raises(ValueError, match="multiple of data \\* fsdp \\* num_microbatches"):
    collate.packed_row_count(3, cap=10, row_multiple=4)


def _random_rollouts(n, seed, max_prompt=12, max_completion=40):
  """n rollouts of 2..50 tokens; rollout i has policy_version i (to find it in a packed batch);
  every other one continued across refreshes: token versions i, i, ..., i + 1, ... (as
  `rollout.partial="continue"` makes them)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    lp, lc = int(rng.integers(1, max_prompt)), int(rng.integers(1, max_completion))
    versions = None
    if i % 2:
      versions = i + np.cumsum(rng.random(lc) < 0.2)
      versions[0] = i
    out.append(rollout(rng.integers(1, 90, lp), rng.integers(1, 90, lc), -rng.random(lc),
                       reward=float(i % 3), advantage=float(rng.normal()), version=i,
                       token_versions=versions))
  return out


@pytest.mark.parametrize("min_version", [None, 5])
def test_token_versions_and_stale_masking_equal_the_reference(min_version):
  rs = _random_rollouts(12, 3)
  assert any(len(np.unique(r.versions_per_token())) > 1 for r in rs)  # some span versions
  got = collate.collate(rs, buckets=(64,), batch_size=14, token_versions=True,
                        min_token_version=min_version)
  want = reference_collate(rs, 64, 14, token_versions=True, min_version=min_version)
  chex.assert_trees_all_equal(got, want)
  if min_version is not None:  # something was masked, and nothing of a version >= 5
    plain = collate.collate(rs, buckets=(64,), batch_size=14)
    assert got.completion_mask.sum() < plain.completion_mask.sum()
    assert np.all(got.token_versions[got.completion_mask > 0] >= min_version)


@pytest.mark.parametrize("seed,batch_size,row_multiple", [(0, 16, 1), (1, 24, 4), (2, 7, 1)])
def test_packed_segments_equal_the_unpacked_rows(seed, batch_size, row_multiple):
  """Every rollout of the packed batch, read back from its (row, segment), equals its row of the
  unpacked batch (itself checked against the token-by-token reference above)."""
  rs = _random_rollouts(batch_size - 2, seed)
  # Per-token versions with the oldest masked: they must follow each rollout into its segment.
  unpacked = collate.collate(rs, buckets=(32, 64), pad_id=3, batch_size=batch_size,
                             token_versions=True, min_token_version=3)
  packed = collate.collate(rs, buckets=(32, 64), pad_id=3, batch_size=batch_size, pack=True,
                           row_multiple=row_multiple, token_versions=True, min_token_version=3)
  rows, seq_len = packed.tokens.shape
  assert seq_len == unpacked.tokens.shape[1] and packed.packed
  assert rows % row_multiple == 0 and rows <= batch_size
  chex.assert_shape([packed.advantages, packed.rewards, packed.policy_version], (rows, seq_len))
  seen = np.zeros((rows, seq_len), bool)
  for i, r in enumerate(rs):
    where = np.argwhere((packed.policy_version == i) & (packed.segment_ids > 0))
    row = int(where[0, 0])
    cols = where[:, 1]
    seg = packed.segment_ids[row, cols[0]]
    assert np.all(where[:, 0] == row) and np.all(np.diff(cols) == 1), "one contiguous segment"
    assert np.all(packed.segment_ids[row, cols] == seg)
    assert cols.size == r.length
    seen[row, cols] = True
    for field in ("tokens", "positions", "targets", "completion_mask", "behaviour_logprobs",
                  "token_versions"):
      got = getattr(packed, field)[row, cols]
      want = getattr(unpacked, field)[i, :r.length]
      chex.assert_trees_all_equal(got, want)  # the last token's target is padding in both
    for field, value in (("advantages", r.advantage), ("rewards", r.reward),
                         ("policy_version", r.policy_version)):
      np.testing.assert_array_equal(getattr(packed, field)[row, cols],
                                    np.float32(value) if field != "policy_version" else value)
  # Segment ids count 1, 2, ... within each row; everything outside the rollouts is padding.
  for row in range(rows):
    ids = packed.segment_ids[row][packed.segment_ids[row] > 0]
    if ids.size:
      assert np.array_equal(np.unique(ids), np.arange(1, ids.max() + 1))
  for name, field in packed._asdict().items():
    if name not in ("tokens", "targets"):
      assert not np.any(field[~seen]), f"{name}: padding must be zero"
  assert np.all(packed.tokens[~seen] == 3) and np.all(packed.targets[~seen] == 3)
  assert collate.padding_fraction(packed) < collate.padding_fraction(unpacked)


def test_pack_is_the_default_off_and_errors():
  rs = _random_rollouts(4, 0)
  assert not collate.collate(rs, buckets=(64,)).packed
  with pytest.raises(ValueError, match="make buffer.batch_size a multiple"):
    collate.collate(rs, buckets=(64,), batch_size=6, pack=True, row_multiple=4)
  # batch_size None: rows rounded up to row_multiple, at most the rollouts' count rounded so.
  got = collate.collate(rs, buckets=(64,), pack=True, row_multiple=4)
  assert got.tokens.shape[0] == 4


def test_packing_picks_the_bucket_with_fewest_slots_unless_told_to_keep_it():
  # 64 rollouts of 9..11 tokens: rows of 16 hold one each, rows of 32 hold 2-3.
  rs = [rollout([1] * 4, [2] * (5 + i % 3), [0.0] * (5 + i % 3)) for i in range(64)]
  unpacked = collate.collate(rs, buckets=(16, 32), batch_size=64)
  packed = collate.collate(rs, buckets=(16, 32), batch_size=64, pack=True)
  kept = collate.collate(rs, buckets=(16, 32), batch_size=64, pack=True, same_bucket=True)
  assert unpacked.tokens.shape == (64, 16) and kept.tokens.shape[1] == 16
  assert packed.tokens.shape[1] == 32 and packed.tokens.size < unpacked.tokens.size
  assert collate.padding_fraction(packed) < collate.padding_fraction(unpacked)
  for b in (packed, kept):
    assert b.completion_mask.sum() == unpacked.completion_mask.sum()
