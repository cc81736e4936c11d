"""Tests of jaxreplay.collate: target shift, mask / log-prob alignment, buckets, padding rows."""
import chex
import numpy as np
import pytest

from jaxreplay import batch as batch_lib
from jaxreplay import buffer, collate


def rollout(prompt, completion, logprobs, reward=1.0, advantage=0.5, version=0):
  return buffer.Rollout(np.array(prompt), np.array(completion), np.array(logprobs, np.float32),
                        reward=reward, advantage=advantage, policy_version=version, group_id=0)


def reference_collate(rollouts, seq_len, rows, pad_id=0):
  """Token-by-token loops straight from the Batch docstring (the slow, obvious version)."""
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
  for i, r in enumerate(rollouts):
    lp = len(r.prompt_tokens)
    for j, logprob in enumerate(r.logprobs):  # completion token j sits at lp + j, predicted at lp+j-1
      out["completion_mask"][i, lp + j - 1] = 1.0
      out["behaviour_logprobs"][i, lp + j - 1] = logprob
  scalars = lambda f, dt: np.array([getattr(r, f) for r in rollouts] + [0] * (rows - len(rollouts)),
                                   dt)
  return batch_lib.Batch(**out, advantages=scalars("advantage", np.float32),
                         rewards=scalars("reward", np.float32),
                         policy_version=scalars("policy_version", np.int32))


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
  got = collate.collate(rs, buckets=(8,), batch_size=5)
  chex.assert_shape(got.tokens, (5, 8))
  chex.assert_shape([got.advantages, got.rewards, got.policy_version], (5,))
  for field in got:
    assert not np.any(field[1:]), "padding rows must be all zero"
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
