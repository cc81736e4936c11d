"""Tests of jaxreplay.data.buffer: FIFO order, uniform sampling, positive bias, queue mode, threads,
checkpoint round trip and metrics."""
import collections
import dataclasses
import pickle
import threading
import time

import chex
import numpy as np
import pytest
from scipy import stats

from jaxreplay.data import buffer


def make_rollout(i, reward=1.0, version=0, length=None, rng=None):
  """A small rollout whose tokens encode `i` (so contents can be checked after a round trip)."""
  if rng is not None and length is None:
    length = int(rng.integers(1, 6))
  length = length or 2
  return buffer.Rollout(
      prompt_tokens=np.array([i % 1000 + 1], np.int32),
      completion_tokens=np.arange(length, dtype=np.int32) + i,
      logprobs=-np.linspace(0.1, 1.0, length).astype(np.float32) - i * 1e-3,
      reward=reward, advantage=0.5 * reward - 0.25, policy_version=version, group_id=i // 4)


def uids(rollouts):
  return [r.uid for r in rollouts]


# ---- Rollout ---------------------------------------------------------------------------------


def test_rollout_converts_dtypes():
  r = buffer.Rollout([1, 2], np.array([3, 4, 5], np.int64), np.array([-1.0, -2.0, -3.0]),
                     reward=np.float32(1), advantage=0, policy_version=np.int64(3), group_id=7)
  assert r.prompt_tokens.dtype == np.int32 and r.completion_tokens.dtype == np.int32
  assert r.logprobs.dtype == np.float32
  assert isinstance(r.reward, float) and isinstance(r.policy_version, int)
  assert (r.uid, r.use_count, r.length) == (-1, 0, 5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(logprobs=np.zeros(2)), "one log-prob per completion token"),
    (dict(completion_tokens=np.array([1.0, 2.0, 3.0])), "integer token ids"),
    (dict(prompt_tokens=np.zeros((1, 2), np.int32)), "1-D"),
    (dict(prompt_tokens=np.zeros(0, np.int32)), "empty"),
    (dict(completion_tokens=np.array([1, -2, 3])), "negative"),
    (dict(logprobs=np.array([0.0, np.nan, 0.0])), "non-finite"),
    (dict(reward=float("inf")), "finite"),
    (dict(policy_version=1.5), "int"),
    (dict(token_versions=[0, 1]), "one integer policy version per completion token"),
    (dict(token_versions=[0.0, 1.0, 1.0]), "one integer policy version per completion token"),
    (dict(token_versions=[1, 1, 2]), "policy_version=0 must be the oldest"),
])
def test_rollout_rejects_bad_input(kwargs, match):
  base = dict(prompt_tokens=[1], completion_tokens=[1, 2, 3], logprobs=[0.0, 0.0, 0.0],
              reward=1.0, advantage=0.0, policy_version=0, group_id=0)
  with pytest.raises(ValueError, match=match):
    buffer.Rollout(**{**base, **kwargs})


# ---- FIFO, no removal, distinctness ----------------------------------------------------------


def test_fifo_eviction_order():
  buf = buffer.ReplayBuffer(capacity=5)
  caller = [make_rollout(i) for i in range(12)]
  assert buf.add(caller[:3]) == [0, 1, 2]
  assert buf.add(caller[3]) == [3]
  assert buf.add(caller[4:]) == list(range(4, 12))
  assert uids(buf.contents()) == [7, 8, 9, 10, 11]
  assert [r.completion_tokens[0] for r in buf.contents()] == [7, 8, 9, 10, 11]
  assert len(buf) == 5 and buf.metrics()["buffer/evicted"] == 7
  assert all(r.uid == -1 for r in caller), "add must not modify the caller's objects"


def test_sample_removes_nothing_and_is_distinct():
  buf = buffer.ReplayBuffer(capacity=20, seed=3)
  buf.add([make_rollout(i) for i in range(27)])  # wrapped ring: head is not slot 0
  before = uids(buf.contents())
  for _ in range(50):
    batch = buf.sample(20)
    assert sorted(uids(batch)) == sorted(before)  # B == size: every item exactly once
    small = uids(buf.sample(7))
    assert len(set(small)) == 7 and set(small) <= set(before)
  assert len(buf) == 20 and uids(buf.contents()) == before
  assert sum(r.use_count for r in buf.contents()) == 50 * 27


def _counts(buf, batch_size, draws, held):
  counts = collections.Counter()
  for _ in range(draws):
    counts.update(uids(buf.sample(batch_size)))
  return np.array([counts[u] for u in held], np.float64)


@pytest.mark.parametrize("n_added, capacity, fraction", [
    (130, 50, 0.0),   # full, after wrap-around
    (30, 50, 0.0),    # partially filled
    (140, 50, 0.4),   # both regions filled (rewards alternate, see below)
])
def test_sampling_is_uniform(n_added, capacity, fraction):
  buf = buffer.ReplayBuffer(capacity=capacity, seed=1, positive_fraction=fraction)
  buf.add([make_rollout(i, reward=float(i % 2)) for i in range(n_added)])
  held = uids(buf.contents())
  if fraction:
    assert buf.positive_size == 20 and buf.recent_size == 30
  counts = _counts(buf, batch_size=10, draws=3000, held=held)
  assert counts.sum() == 30000
  p = stats.chisquare(counts).pvalue
  assert p > 1e-3, f"sampling is not uniform over the held rollouts (chi-square p={p:.2e})"


def test_chisquare_detects_bias():
  """The uniformity test has power: a sampler that favours the newest half fails it."""
  rng = np.random.default_rng(0)
  counts = np.zeros(50)
  for _ in range(3000):
    pick = rng.choice(50, 10, replace=False, p=np.r_[np.full(25, 0.9), np.full(25, 1.1)] / 50)
    counts[pick] += 1
  assert stats.chisquare(counts).pvalue < 1e-3


def test_sampling_stream_depends_on_seed_only():
  def draws(seed):
    buf = buffer.ReplayBuffer(capacity=30, seed=seed)
    buf.add([make_rollout(i) for i in range(40)])
    return [uids(buf.sample(8)) for _ in range(5)]
  assert draws(5) == draws(5)
  assert draws(5) != draws(6)


def test_sample_argument_errors():
  buf = buffer.ReplayBuffer(capacity=8)
  with pytest.raises(ValueError, match="can never be satisfied.*capacity 8.*raise capacity"):
    buf.sample(9)
  with pytest.raises(ValueError, match=">= 1"):
    buf.sample(0)
  with pytest.raises(ValueError, match="Rollout"):
    buf.add([{"tokens": [1]}])
  with pytest.raises(ValueError, match="capacity"):
    buffer.ReplayBuffer(capacity=0)


# ---- blocking, timeout, close ----------------------------------------------------------------


def test_timeout_names_held_and_requested():
  buf = buffer.ReplayBuffer(capacity=10)
  buf.add([make_rollout(i) for i in range(3)])
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match="holds 3 of the 5 rollouts requested"):
    buf.sample(5, timeout=0.05)
  assert time.monotonic() - t0 >= 0.045


def test_blocking_sample_is_woken_by_a_producer():
  buf = buffer.ReplayBuffer(capacity=10)
  result = {}

  def consume():
    result["batch"] = buf.sample(4, timeout=5.0)

  thread = threading.Thread(target=consume)
  thread.start()
  buf.add([make_rollout(i) for i in range(3)])
  time.sleep(0.05)
  assert "batch" not in result and thread.is_alive(), "sample returned before 4 were held"
  buf.add(make_rollout(3))
  thread.join(timeout=5.0)
  assert not thread.is_alive()
  assert sorted(uids(result["batch"])) == [0, 1, 2, 3]


def test_close_wakes_blocked_samplers():
  buf = buffer.ReplayBuffer(capacity=10)
  errors = []

  def consume():
    try:
      buf.sample(4)
    except buffer.BufferClosedError as e:
      errors.append(e)

  threads = [threading.Thread(target=consume) for _ in range(2)]
  for t in threads:
    t.start()
  time.sleep(0.05)
  buf.close()
  for t in threads:
    t.join(timeout=5.0)
  assert len(errors) == 2 and "closed" in str(errors[0])
  with pytest.raises(buffer.BufferClosedError):
    buf.add(make_rollout(0))


# ---- positive bias ---------------------------------------------------------------------------


def test_positive_bias_hand_traced():
  # N=4, delta=0.5: 2 recent slots + 2 positive slots.
  buf = buffer.ReplayBuffer(capacity=4, positive_fraction=0.5)
  rewards = [1, 0, 1, 1, 0, 1, 0, 0]
  buf.add([make_rollout(i, reward=float(r)) for i, r in enumerate(rewards)])
  # 0 -> positive; 1 dropped; 2 -> positive; 3 -> positive (drops 0); 4 dropped; 5 -> positive
  # (drops 2). Recent: [6, 7]; positive: [3, 5].
  assert uids(buf.contents()) == [6, 7, 3, 5]
  assert (buf.recent_size, buf.positive_size) == (2, 2)
  m = buf.metrics()
  assert (m["buffer/evicted"], m["buffer/promoted"], m["buffer/positive_size"]) == (4, 4, 2)


def test_positive_bias_matches_a_reference_model():
  rng = np.random.default_rng(0)
  buf = buffer.ReplayBuffer(capacity=10, positive_fraction=0.3)
  assert (buf.n_recent, buf.n_positive) == (7, 3)
  recent, positive = collections.deque(), collections.deque()
  for i in range(300):
    reward = float(rng.choice([-1.0, 0.0, 1.0]))
    buf.add(make_rollout(i, reward=reward))
    recent.append((i, reward))
    if len(recent) > 7:
      old = recent.popleft()
      if old[1] > 0:
        positive.append(old)
        if len(positive) > 3:
          positive.popleft()
    if i % 37 == 0:
      assert uids(buf.contents()) == [u for u, _ in recent] + [u for u, _ in positive]
  assert uids(buf.contents()) == [u for u, _ in recent] + [u for u, _ in positive]
  assert all(r.reward > 0 for r in buf.contents()[7:])


@pytest.mark.parametrize("capacity, fraction, sizes", [
    (84, 0.25, (63, 21)), (10, 0.35, (7, 3)), (7, 0.29, (5, 2)), (84, 0.0, (84, 0)),
])
def test_region_rounding(capacity, fraction, sizes):
  buf = buffer.ReplayBuffer(capacity, positive_fraction=fraction)
  assert (buf.n_recent, buf.n_positive) == sizes


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=10, positive_fraction=1.0), r"\[0, 1\)"),
    (dict(capacity=10, positive_fraction=0.05), "no positive slot"),
    (dict(capacity=10, positive_fraction=0.5, consume=True), "consume"),
])
def test_bad_positive_fraction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    buffer.ReplayBuffer(**kwargs)


# ---- consume=True: the on-policy queue -------------------------------------------------------


def test_lifo_queue_pops_the_newest_first():
  buf = buffer.ReplayBuffer(capacity=10, consume=True)  # LIFO: the paper's on-policy baseline
  buf.add([make_rollout(i) for i in range(6)])
  assert uids(buf.sample(4)) == [5, 4, 3, 2]
  assert uids(buf.contents()) == [0, 1]
  buf.add([make_rollout(i) for i in range(6, 9)])
  assert uids(buf.sample(3)) == [8, 7, 6]
  assert uids(buf.contents()) == [0, 1]  # old rollouts wait at the bottom of the stack
  buf.add([make_rollout(i) for i in range(9, 19)])  # overflow still drops the oldest
  assert buf.metrics()["buffer/evicted"] == 2 and uids(buf.contents()) == list(range(9, 19))
  assert uids(buf.sample(2)) == [18, 17]
  m = buf.metrics()
  assert (m["buffer/consumed"], m["buffer/total_sampled"], m["buffer/total_added"]) == (9, 9, 19)
  state = buf.state_dict()
  again = buffer.ReplayBuffer(capacity=10, consume=True)
  again.load_state_dict(state)
  assert uids(again.sample(3)) == [16, 15, 14]
  with pytest.raises(ValueError, match="consume_lifo"):
    buffer.ReplayBuffer(capacity=10, consume=True, consume_order="fifo").load_state_dict(state)
  with pytest.raises(ValueError, match="consume_order"):
    buffer.ReplayBuffer(capacity=10, consume=True, consume_order="random")


def test_consume_queue_semantics():
  buf = buffer.ReplayBuffer(capacity=10, consume=True, consume_order="fifo")
  buf.add([make_rollout(i) for i in range(6)])
  assert uids(buf.sample(4)) == [0, 1, 2, 3]
  assert len(buf) == 2
  with pytest.raises(TimeoutError, match="holds 2 of the 3"):
    buf.sample(3, timeout=0.02)
  buf.add([make_rollout(i) for i in range(6, 9)])
  assert uids(buf.sample(3)) == [4, 5, 6]
  assert uids(buf.contents()) == [7, 8]
  m = buf.metrics()
  assert (m["buffer/consumed"], m["buffer/evicted"], m["buffer/total_sampled"]) == (7, 0, 7)
  assert m["buffer/replay_ratio"] == pytest.approx(7 / 9)
  buf.add([make_rollout(i) for i in range(9, 21)])  # overflow drops the oldest
  assert buf.metrics()["buffer/evicted"] == 4
  assert uids(buf.sample(10)) == list(range(11, 21)) and len(buf) == 0


# ---- threads ---------------------------------------------------------------------------------


def _run_threads(buf, n_producers, n_consumers, per_producer, batch_size):
  added, sampled, errors = [], [], []
  producers_done = threading.Event()
  lock = threading.Lock()

  def produce(seed):
    rng = np.random.default_rng(seed)
    mine, i = [], 0
    try:
      while i < per_producer:
        k = int(min(rng.integers(1, 9), per_producer - i))
        mine.extend(buf.add([make_rollout(seed * 10_000 + i + j, reward=float(rng.integers(0, 2)))
                             for j in range(k)]))
        i += k
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
    with lock:
      added.append(mine)

  def consume():
    try:
      while True:
        try:
          batch = buf.sample(batch_size, timeout=0.05)
        except TimeoutError:
          if producers_done.is_set():
            return
          continue
        with lock:
          sampled.append(uids(batch))
        if producers_done.is_set() and not buf.consume:  # a replay buffer never runs dry
          return
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  prod = [threading.Thread(target=produce, args=(s,)) for s in range(n_producers)]
  cons = [threading.Thread(target=consume) for _ in range(n_consumers)]
  for t in prod + cons:
    t.start()
  for t in prod:
    t.join(timeout=10.0)
  producers_done.set()
  for t in cons:
    t.join(timeout=10.0)
  assert not any(t.is_alive() for t in prod + cons), "a thread hung"
  assert not errors, errors
  return added, sampled


def test_threads_replay_loses_and_duplicates_nothing():
  buf = buffer.ReplayBuffer(capacity=64, seed=0)
  added, sampled = _run_threads(buf, 4, 3, per_producer=500, batch_size=16)
  flat = [u for mine in added for u in mine]
  assert sorted(flat) == list(range(2000)), "uids must be unique and contiguous"
  assert all(mine == sorted(mine) for mine in added), "uids increase in each producer's order"
  assert uids(buf.contents()) == list(range(2000 - 64, 2000)), "FIFO eviction order"
  assert all(len(set(b)) == 16 for b in sampled)
  m = buf.metrics()
  assert m["buffer/evicted"] == 2000 - 64 and m["buffer/total_added"] == 2000
  assert m["buffer/total_sampled"] == 16 * len(sampled) > 0
  use = collections.Counter(u for b in sampled for u in b)
  assert [use[r.uid] for r in buf.contents()] == [r.use_count for r in buf.contents()]


def test_threads_consume_each_uid_exactly_once():
  buf = buffer.ReplayBuffer(capacity=256, consume=True)
  added, sampled = _run_threads(buf, 4, 3, per_producer=500, batch_size=8)
  consumed = [u for b in sampled for u in b]
  assert len(consumed) == len(set(consumed)), "a rollout was consumed twice"
  held = set(uids(buf.contents()))
  assert held.isdisjoint(consumed) and len(held) < 8
  lost = set(range(2000)) - held - set(consumed)
  m = buf.metrics()
  assert len(lost) == m["buffer/evicted"], "every uid is consumed, held, or counted as evicted"
  assert m["buffer/consumed"] == len(consumed)


# ---- checkpoint ------------------------------------------------------------------------------


def _filled_buffer():
  rng = np.random.default_rng(7)
  buf = buffer.ReplayBuffer(capacity=12, seed=11, positive_fraction=0.25)
  for step in range(8):
    buf.add([make_rollout(step * 4 + j, reward=float(rng.integers(0, 2)), version=step, rng=rng)
             for j in range(4)])
    if len(buf) >= 6:
      buf.sample(6, current_version=step)
  return buf


@pytest.mark.parametrize("storage", ["dict", "pickle", "npz"])
def test_state_round_trip(storage, tmp_path):
  buf = _filled_buffer()
  state = buf.state_dict()
  if storage == "pickle":
    state = pickle.loads(pickle.dumps(state))
  elif storage == "npz":
    np.savez(tmp_path / "buf.npz", **state)
    with np.load(tmp_path / "buf.npz", allow_pickle=False) as f:
      state = dict(f)
  restored = buffer.ReplayBuffer(capacity=12, seed=999, positive_fraction=0.25)
  restored.load_state_dict(state)
  a, b = buf.contents(), restored.contents()
  assert uids(a) == uids(b) and restored.positive_size == buf.positive_size > 0
  for x, y in zip(a, b):
    chex.assert_trees_all_equal(
        (x.prompt_tokens, x.completion_tokens, x.logprobs, x.reward, x.advantage,
         x.policy_version, x.group_id, x.use_count),
        (y.prompt_tokens, y.completion_tokens, y.logprobs, y.reward, y.advantage,
         y.policy_version, y.group_id, y.use_count))
  assert restored.metrics() == {k: v for k, v in buf.metrics().items()
                                if not k.startswith(("buffer/batch", "buffer/staleness"))}
  rng = np.random.default_rng(3)
  for step in range(5):  # the un-stopped buffer and the restored one continue identically
    new = [make_rollout(100 + step * 3 + j, reward=1.0, rng=rng) for j in range(3)]
    assert buf.add(new) == restored.add(new)
    assert uids(buf.sample(6)) == uids(restored.sample(6))


def test_load_state_checks_configuration():
  state = _filled_buffer().state_dict()
  with pytest.raises(ValueError, match="capacity=12 but this buffer has capacity=13"):
    buffer.ReplayBuffer(capacity=13, positive_fraction=0.25).load_state_dict(state)
  with pytest.raises(ValueError, match="positive_fraction"):
    buffer.ReplayBuffer(capacity=12, positive_fraction=0.5).load_state_dict(state)
  with pytest.raises(ValueError, match="missing keys"):
    buffer.ReplayBuffer(capacity=12, positive_fraction=0.25).load_state_dict({"capacity": 12})
  bad = dict(state, uid=state["uid"][:-1])
  with pytest.raises(ValueError, match="'uid' has shape"):
    buffer.ReplayBuffer(capacity=12, positive_fraction=0.25).load_state_dict(bad)


# ---- metrics ---------------------------------------------------------------------------------


def test_metrics_after_a_known_schedule():
  buf = buffer.ReplayBuffer(capacity=8, seed=0)
  m0 = buf.metrics()
  assert set(buffer.METRIC_KEYS) == set(m0) and m0["buffer/replay_ratio"] == 0.0
  r, b, steps = 4, 6, 10
  staleness = []
  for step in range(steps):
    buf.add([make_rollout(step * r + j, version=step) for j in range(r)])
    if len(buf) >= b:
      batch = buf.sample(b, current_version=step)
      st = buf.last_batch_stats
      assert st["uids"].tolist() == uids(batch)
      assert st["use_counts"].tolist() == [x.use_count for x in batch]
      assert st["use_count_mean"] == pytest.approx(np.mean([x.use_count for x in batch]))
      assert st["use_count_max"] == max(x.use_count for x in batch)
      chex.assert_trees_all_equal(st["staleness"], step - np.array([x.policy_version for x in batch]))
      staleness.append(st["staleness_mean"])
  m = buf.metrics(current_version=steps)
  assert set(buffer.METRIC_KEYS + buffer.BATCH_KEYS + buffer.STALENESS_KEYS
             + buffer.HELD_STALENESS_KEYS) == set(m)
  n_batches = steps - 1  # the first step holds only 4 < 6
  assert m["buffer/total_added"] == 40 and m["buffer/total_sampled"] == 6 * n_batches
  assert m["buffer/replay_ratio"] == pytest.approx(6 * n_batches / 40)
  assert m["buffer/evicted"] == 32 and m["buffer/size"] == 8 and m["buffer/fill"] == 1.0
  held_uses = sum(x.use_count for x in buf.contents())
  assert m["buffer/use_count_mean"] == pytest.approx(6 * n_batches / 40)
  assert m["buffer/evicted_use_count_mean"] == pytest.approx((6 * n_batches - held_uses) / 32)
  assert m["buffer/held_use_count_mean"] == pytest.approx(held_uses / 8)
  assert m["buffer/staleness_mean"] == pytest.approx(staleness[-1])
  assert 0 <= m["buffer/staleness_min"] <= m["buffer/staleness_max"] <= 1  # N = 2 steps of R
  assert m["buffer/held_staleness_mean"] == pytest.approx(1.5)  # versions 8, 9 at step 10
  assert m["buffer/held_staleness_max"] == 2


# ---- per-token versions and max_staleness (rollout.partial="continue") ------------------------


def _continued(i, versions, reward=1.0):
  """A rollout whose completion tokens were sampled by `versions` (its oldest is its version)."""
  versions = np.asarray(versions)
  return buffer.Rollout(prompt_tokens=np.array([i + 1], np.int32),
                        completion_tokens=np.arange(versions.size, dtype=np.int32) + i,
                        logprobs=np.full(versions.size, -0.5, np.float32), reward=reward,
                        advantage=0.1, policy_version=int(versions.min()), group_id=i,
                        token_versions=versions)


def test_per_token_staleness_and_stale_drops(tmp_path):
  buf = buffer.ReplayBuffer(capacity=8, seed=0, max_staleness=2)
  old = _continued(0, [0, 0])               # newest token 0
  spanning = _continued(1, [0, 0, 1, 3])    # oldest 0, newest 3
  fresh = _continued(2, [4, 4, 4])
  plain = make_rollout(3, version=4)        # no per-token versions: all at 4
  buf.add([old, spanning, fresh, plain])
  assert buf.contents()[1].newest_version == 3 and buf.contents()[3].newest_version == 4
  assert buf.drop_stale(2) == 0  # staleness 2 is allowed
  assert buf.drop_stale(3) == 1 and uids(buf.contents()) == [1, 2, 3]  # `old` left, unused
  assert buf.drop_stale(5) == 0  # `spanning`'s newest token (3) is 2 versions old
  got = buf.sample(3, current_version=5)
  m = buf.metrics(current_version=5)
  versions = np.concatenate([r.versions_per_token() for r in got])
  assert m["buffer/token_staleness_mean"] == pytest.approx(np.mean(5 - versions))
  assert m["buffer/token_staleness_max"] == 5.0
  assert m["buffer/versions_per_rollout_mean"] == pytest.approx((3 + 1 + 1) / 3)
  assert m["buffer/staleness_max"] == 5.0  # per rollout: by its oldest token
  assert (m["buffer/stale_dropped"], m["buffer/stale_dropped_unused"]) == (1.0, 1.0)
  # the state keeps the per-token versions and the counters
  np.savez(tmp_path / "buf.npz", **buf.state_dict())
  with np.load(tmp_path / "buf.npz", allow_pickle=False) as f:
    state = dict(f)
  restored = buffer.ReplayBuffer(capacity=8, seed=0, max_staleness=2)
  restored.load_state_dict(state)
  for a, b in zip(buf.contents(), restored.contents()):
    np.testing.assert_array_equal(a.versions_per_token(), b.versions_per_token())
  assert restored.drop_stale(6) == 1 and uids(restored.contents()) == [2, 3]  # newest 3: 6-3 > 2
  assert restored.metrics()["buffer/stale_dropped"] == 2.0
  # without a limit nothing is dropped, and no key of it is reported
  plain_buf = buffer.ReplayBuffer(capacity=8)
  plain_buf.add([_continued(0, [0]), make_rollout(1)])
  assert plain_buf.drop_stale(100) == 0 and len(plain_buf) == 2
  assert not set(buffer.STALE_DROP_KEYS) & set(plain_buf.metrics(current_version=100))
  assert "token_versions" not in buffer.ReplayBuffer(capacity=2).state_dict()
  plain_buf.sample(1, current_version=3)
  with pytest.raises(ValueError, match="max_staleness"):
    buffer.ReplayBuffer(capacity=8, max_staleness=-1)


# ---- multi-turn trajectories: replayed exactly as they were fresh ---------------------------------


@pytest.mark.parametrize("options", [
    dict(), dict(positive_fraction=0.25), dict(priority="fresh"), dict(max_uses=2)],
    ids=["uniform", "positive_bias", "fresh", "max_uses"])
def test_replayed_trajectory_loss_equals_its_fresh_loss(options):
  """Mixed single- and multi-turn rollouts: drawn (a first use, then a second one after a
  checkpoint round trip), each keeps its mask and turn starts, collates to the batch it gave
  when fresh and has the same loss and statistics at the same parameters, bit for bit."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxreplay.data import collate as collate_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import loss_fn as loss_fn_lib  # pylint: disable=g-import-not-at-top
  from tests.helpers import trajectories  # pylint: disable=g-import-not-at-top

  fresh = trajectories.mixed_rollouts(seed=4, n=8)
  buf = buffer.ReplayBuffer(8, seed=1, **options)
  buf.add([dataclasses.replace(r) for r in fresh])  # uids 0..7 in order
  again = buffer.ReplayBuffer(8, seed=1, **options)
  loss_fn = loss_fn_lib.make_loss_fn("grpo", kl_coef=0.1)
  rng = np.random.default_rng(0)
  noise = rng.normal(0, 0.3, (8, 64)).astype(np.float32)
  for use, source in [(1, buf), (2, again)]:
    if use == 2:
      again.load_state_dict(buf.state_dict())
    held = len(source)
    replayed = sorted(source.sample(held), key=lambda r: r.uid)
    assert all(r.use_count == use for r in replayed)
    originals = [fresh[r.uid] for r in replayed]
    assert any(r.num_turns > 1 for r in replayed) and any(r.num_turns == 1 for r in replayed)
    for r, f in zip(replayed, originals):
      for field in ("completion_mask", "turn_starts"):
        a, b = getattr(r, field), getattr(f, field)
        assert (a is None) == (b is None), (use, field)
        if a is not None:
          np.testing.assert_array_equal(a, b)
    want_batch = collate_lib.collate(originals, buckets=(64,))
    batch = collate_lib.collate(replayed, buckets=(64,))
    for field in ("tokens", "targets", "completion_mask", "behaviour_logprobs", "advantages"):
      np.testing.assert_array_equal(getattr(batch, field), getattr(want_batch, field))
    lp = jnp.asarray(want_batch.behaviour_logprobs + noise[:held])
    want, got = loss_fn(lp, want_batch, lp * 1.1), loss_fn(lp, batch, lp * 1.1)
    assert float(got[0]) == float(want[0]), use
    for key in want[1]:
      assert float(got[1][key]) == float(want[1][key]), (use, key)
