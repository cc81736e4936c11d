"""Tests of the replay buffer's samplers (issue 27): priority "fresh", max_uses, replace_zero_variance
and their combinations (with each other and with the positive bias), by chi-square tests against
the exact sampling distributions (successive sampling for weighted draws without replacement), and
their checkpointing, metrics and thread safety."""
import collections
import itertools
import math
import threading

import numpy as np
import pytest
from scipy import stats

from jaxreplay.config import defaults
from jaxreplay.config import validation
from jaxreplay.data import buffer

P_MIN = 1e-3  # seeded draws: a fixed outcome; a wrong distribution gives p ~ 0


def rollout(i, version=0, reward=1.0, group=None):
  return buffer.Rollout(prompt_tokens=np.array([1], np.int32),
                        completion_tokens=np.array([i + 1, 2], np.int32),
                        logprobs=np.array([-0.5, -0.25], np.float32), reward=reward,
                        advantage=0.0, policy_version=version,
                        group_id=i if group is None else group)


def successive_probability(order, weights):
  """Exact probability of drawing the items `order` in that order by successive sampling."""
  p, left = 1.0, float(sum(weights.values()))
  for i in order:
    p *= weights[i] / left
    left -= weights[i]
  return p


def chi2_p(counts: dict, probs: dict, n: int, min_expected: float = 5.0) -> float:
  """Pearson chi-square p-value of observed counts over outcomes against exact probabilities;
  outcomes expected fewer than `min_expected` times are pooled into one cell. An outcome of
  probability 0 must never occur."""
  assert not [k for k in counts if probs.get(k, 0.0) == 0.0], "drew an impossible outcome"
  keys = sorted(probs, key=repr)
  total = sum(probs.values())
  assert abs(total - 1.0) < 1e-9, total
  obs = np.array([counts.get(k, 0) for k in keys], np.float64)
  exp = np.array([probs[k] * n for k in keys])
  big = exp >= min_expected
  obs, exp = np.append(obs[big], obs[~big].sum()), np.append(exp[big], exp[~big].sum())
  keep = exp > 0
  assert keep.sum() >= 3, "too few cells for a chi-square test"
  return stats.chisquare(obs[keep], exp[keep]).pvalue


def draw_counts(buf, batch, n, key=tuple):
  counts = collections.Counter()
  for _ in range(n):
    counts[key(r.uid for r in buf.sample(batch))] += 1
  return counts


# ---- priority "fresh" ------------------------------------------------------------------------------


@pytest.mark.parametrize("size,batch,tau", [(6, 2, 2.0), (5, 3, 1.0)])
def test_fresh_priority_is_successive_sampling(size, batch, tau):
  versions = [0, 0, 1, 2, 3, 5][:size]
  buf = buffer.ReplayBuffer(16, seed=1, priority="fresh", fresh_tau=tau)
  buf.add([rollout(i, v) for i, v in enumerate(versions)])
  n = 20000
  counts = draw_counts(buf, batch, n)
  # priority exp(-age / tau), age = newest - version (the normalised law ignores the reference)
  weights = {i: math.exp(-(max(versions) - v) / tau) for i, v in enumerate(versions)}
  probs = {o: successive_probability(o, weights) for o in itertools.permutations(range(size), batch)}
  assert chi2_p(counts, probs, n) > P_MIN
  # and it is not uniform: the freshest rollout is drawn first far more often than the oldest
  first = collections.Counter(o[0] for o in counts.elements())
  assert first[size - 1] > 3 * first[0]


@pytest.mark.parametrize("base", ["reward", "advantage"])
def test_freshper_priority_is_the_papers_formula(base):
  """FreshPER (arXiv 2604.16918; its code's `reward_fresh_priority` and sum tree): rollout i drawn
  with weight ((|x_i| + eps) * exp(-age_i / tau)) ** alpha, x = reward or advantage, by
  successive sampling; chi-square against the exact distribution of that formula."""
  versions = [0, 1, 1, 2, 3]
  values = [1.0, 0.0, -2.0, 0.5, 1.0]  # reward or advantage of each rollout
  tau, alpha, eps = 2.0, 0.6, 0.3  # a large eps: the zero-valued rollout keeps a visible weight
  buf = buffer.ReplayBuffer(16, seed=4, priority="fresh", fresh_tau=tau, fresh_base=base,
                            fresh_alpha=alpha, fresh_eps=eps)
  buf.add([buffer.Rollout(prompt_tokens=np.array([1], np.int32),
                          completion_tokens=np.array([i + 1], np.int32),
                          logprobs=np.array([-0.5], np.float32),
                          reward=values[i] if base == "reward" else 1.0,
                          advantage=values[i] if base == "advantage" else 0.0,
                          policy_version=v, group_id=i) for i, v in enumerate(versions)])
  n = 20000
  counts = draw_counts(buf, 2, n)
  weights = {i: ((abs(x) + eps) * math.exp(-(max(versions) - v) / tau)) ** alpha
             for i, (x, v) in enumerate(zip(values, versions))}
  probs = {o: successive_probability(o, weights) for o in itertools.permutations(range(5), 2)}
  assert chi2_p(counts, probs, n) > P_MIN
  # the base matters: rollout 2 (|x| = 2, age 2) is drawn first more often than rollout 1 (x = 0,
  # the same age), which the age decay alone would draw as often
  first = collections.Counter(o[0] for o in counts.elements())
  assert first[2] > 2 * first[1]


def test_fresh_defaults_draw_the_batches_of_before():
  """priority "fresh" at fresh_base "uniform" and fresh_alpha 1 (the defaults) draws bit for bit
  what `fresh_log_weights` alone gave before the FreshPER options existed."""
  from jaxreplay.data import samplers  # pylint: disable=g-import-not-at-top
  versions = np.array([0, 2, 2, 5, 7])
  slots = np.arange(5, dtype=np.int64)

  class Held:
    size = recent_size = 5

    def versions(self, s):
      return versions[s]

  got = samplers.fresh_priority_log_weights(samplers.SamplerOptions(fresh_tau=3.0), Held(), slots)
  np.testing.assert_array_equal(got, samplers.fresh_log_weights(versions, 3.0))
  with pytest.raises(ValueError, match="fresh_base='rank'"):
    buffer.ReplayBuffer(8, priority="fresh", fresh_base="rank")
  with pytest.raises(ValueError, match="shape priority 'fresh' only"):
    buffer.ReplayBuffer(8, fresh_alpha=0.6)
  c = defaults.base_config()
  c.buffer.priority, c.buffer.fresh_base, c.buffer.fresh_alpha = "fresh", "reward", 0.0
  with pytest.raises(ValueError, match="fresh_alpha=0.0"):
    validation.validate_config(c)


def test_successive_sampling_function():
  rng = np.random.default_rng(0)
  log_w = np.log(np.array([1.0, 2.0, 3.0, 0.5]))
  n = 20000
  counts = collections.Counter(tuple(buffer.successive_sampling(rng, log_w, 2).tolist())
                               for _ in range(n))
  weights = dict(enumerate(np.exp(log_w)))
  probs = {o: successive_probability(o, weights) for o in itertools.permutations(range(4), 2)}
  assert chi2_p(counts, probs, n) > P_MIN


def test_fresh_with_positive_bias_draws_over_both_regions():
  """The positive region only decides what is held; the priority covers everything held."""
  buf = buffer.ReplayBuffer(8, seed=2, positive_fraction=0.5, priority="fresh", fresh_tau=3.0)
  # 10 rollouts into 4 recent + 4 positive slots: the first six leave the recent region, the
  # positive ones (even i) move to the positive region
  buf.add([rollout(i, version=i, reward=float(i % 2 == 0)) for i in range(10)])
  held = buf.contents()
  assert buf.positive_size == 3 and buf.recent_size == 4
  newest = max(r.policy_version for r in held)
  weights = {r.uid: math.exp(-(newest - r.policy_version) / 3.0) for r in held}
  n = 20000
  counts = draw_counts(buf, 2, n)
  probs = {o: successive_probability(o, weights) for o in itertools.permutations(weights, 2)}
  assert chi2_p(counts, probs, n) > P_MIN


# ---- replace_zero_variance -------------------------------------------------------------------------


def grouped_buffer(seed=3, **kw):
  """Groups of 3: 0 all-correct and 2 all-wrong (zero variance), 1 and 3 mixed."""
  buf = buffer.ReplayBuffer(32, seed=seed, replace_zero_variance=True, **kw)
  rewards = {0: (1, 1, 1), 1: (1, 0, 0), 2: (0, 0, 0), 3: (0, 1, 1)}
  buf.add([rollout(3 * g + j, version=g, reward=float(r), group=g)
           for g, rs in rewards.items() for j, r in enumerate(rs)])
  return buf


def test_zero_variance_groups_are_replaced_when_others_suffice():
  buf = grouped_buffer()
  informative = [3, 4, 5, 9, 10, 11]
  n = 20000
  counts = draw_counts(buf, 3, n, key=frozenset)
  probs = {frozenset(s): 1.0 / math.comb(6, 3) for s in itertools.combinations(informative, 3)}
  assert chi2_p(counts, probs, n) > P_MIN
  assert buf.last_batch_stats["zero_variance"].sum() == 0
  m = buf.metrics()
  assert m["buffer/zero_variance_fraction"] == 0.5 and m["buffer/batch_zero_variance_fraction"] == 0


def test_zero_variance_fill_when_others_are_too_few():
  """B = 8 > 6 informative rollouts: all six, plus 2 of the 6 zero-variance ones uniformly."""
  buf = grouped_buffer(seed=4)
  n = 15000
  counts = collections.Counter()
  for _ in range(n):
    got = {r.uid for r in buf.sample(8)}
    assert {3, 4, 5, 9, 10, 11} <= got
    counts[frozenset(got - {3, 4, 5, 9, 10, 11})] += 1
  probs = {frozenset(s): 1.0 / math.comb(6, 2) for s in itertools.combinations([0, 1, 2, 6, 7, 8], 2)}
  assert chi2_p(counts, probs, n) > P_MIN
  assert buf.metrics()["buffer/batch_zero_variance_fraction"] == 0.25


def test_zero_variance_with_fresh_priority():
  buf = grouped_buffer(seed=5, priority="fresh", fresh_tau=1.5)
  n = 20000
  counts = draw_counts(buf, 2, n)
  weights = {u: math.exp(-(3 - u // 3) / 1.5) for u in (3, 4, 5, 9, 10, 11)}  # version = group
  probs = {o: successive_probability(o, weights) for o in itertools.permutations(weights, 2)}
  assert chi2_p(counts, probs, n) > P_MIN


def test_a_group_keeps_its_evicted_members_rewards():
  """A group whose differing member was evicted is still informative (its rewards were not all
  equal), until no member is held."""
  buf = buffer.ReplayBuffer(4, seed=0, replace_zero_variance=True)
  buf.add([rollout(0, reward=0.0, group=7), rollout(1, reward=1.0, group=7)])
  buf.add([rollout(2, reward=1.0, group=8), rollout(3, reward=1.0, group=8)])
  buf.add([rollout(4, reward=1.0, group=9)])      # evicts uid 0 (group 7's reward 0)
  assert [r.uid for r in buf.contents()] == [1, 2, 3, 4]
  assert buf.metrics()["buffer/zero_variance_fraction"] == 0.75  # groups 8, 9; 7 still mixed
  for _ in range(50):
    assert [r.uid for r in buf.sample(1)] == [1]


def test_uniform_zero_variance_with_every_group_informative_draws_the_default_batches():
  a = buffer.ReplayBuffer(16, seed=6)
  b = buffer.ReplayBuffer(16, seed=6, replace_zero_variance=True)
  for buf in (a, b):
    buf.add([rollout(i, reward=float(i % 2), group=i // 2) for i in range(12)])
  for _ in range(20):
    assert [r.uid for r in a.sample(5)] == [r.uid for r in b.sample(5)]


# ---- max_uses ------------------------------------------------------------------------------------


def test_max_uses_retires_after_k_uses_and_keeps_fifo_order():
  buf = buffer.ReplayBuffer(8, seed=7, positive_fraction=0.25, max_uses=2)
  buf.add([rollout(i, reward=1.0) for i in range(10)])   # 2 promoted to the positive region
  uses = collections.Counter()
  for _ in range(6):
    held_before = [r.uid for r in buf.contents()]
    if len(held_before) < 3:
      break
    batch = [r.uid for r in buf.sample(3)]
    uses.update(batch)
    held = [r.uid for r in buf.contents()]
    assert held == [u for u in held_before if uses[u] < 2]   # the order of the rest is kept
    assert all(uses[u] <= 2 for u in uses)
  m = buf.metrics()
  assert m["buffer/retired"] == sum(1 for u in uses if uses[u] == 2)
  assert m["buffer/size"] == 8 - m["buffer/retired"]
  assert m["buffer/use_count_mean"] == pytest.approx(sum(uses.values()) / 10)
  with pytest.raises(TimeoutError):  # fewer than B held: sample waits for producers
    buf.sample(len(buf) + 1, timeout=0.01)


def test_max_uses_next_batch_is_uniform_over_the_rest():
  """max_uses=1: the second batch is drawn uniformly from the four rollouts the first one left."""
  counts = collections.Counter()
  n = 6000
  for seed in range(n):
    buf = buffer.ReplayBuffer(8, seed=seed, max_uses=1)
    buf.add([rollout(i) for i in range(6)])
    first = {r.uid for r in buf.sample(2)}
    second = {r.uid for r in buf.sample(2)}
    assert not first & second
    rest = sorted(set(range(6)) - first)
    counts[frozenset(rest.index(u) for u in second)] += 1
  probs = {frozenset(s): 1 / 6 for s in itertools.combinations(range(4), 2)}
  assert chi2_p(counts, probs, n) > P_MIN


# ---- checkpoints, metrics, threads, validation ------------------------------------------------------


def busy_buffer(seed=8):
  buf = buffer.ReplayBuffer(12, seed=seed, positive_fraction=0.25, priority="fresh", fresh_tau=2.0,
                            max_uses=2, replace_zero_variance=True)
  for step in range(6):
    buf.add([rollout(10 * step + j, version=step, reward=float((step + j) % 3 == 0), group=step)
             for j in range(4)])
    buf.sample(4, current_version=step + 1)
  return buf


def test_checkpoint_round_trip_continues_the_same_draws():
  buf = busy_buffer()
  state = buf.state_dict()
  again = buffer.ReplayBuffer(12, positive_fraction=0.25, priority="fresh", fresh_tau=2.0,
                              max_uses=2, replace_zero_variance=True)
  again.load_state_dict(state)
  assert [r.uid for r in again.contents()] == [r.uid for r in buf.contents()]
  state_keys = lambda m: {k: v for k, v in m.items()  # not the last batch's statistics
                          if not k.startswith(("buffer/batch_", "buffer/staleness_"))}
  assert state_keys(buf.metrics()) == state_keys(again.metrics())
  for step in range(4):
    for b in (buf, again):
      b.add([rollout(100 + 4 * step + j, version=10 + step, reward=float(j == 0), group=50 + step)
             for j in range(4)])
    assert [r.uid for r in buf.sample(3)] == [r.uid for r in again.sample(3)]
  assert buf.metrics()["buffer/retired"] == again.metrics()["buffer/retired"] > 0


def test_old_checkpoints_without_the_new_keys_load():
  buf = busy_buffer()
  state = {k: v for k, v in buf.state_dict().items() if k not in buffer._OPTIONAL_STATE_KEYS}
  again = buffer.ReplayBuffer(12, positive_fraction=0.25, max_uses=2, replace_zero_variance=True)
  again.load_state_dict(state)
  assert [r.uid for r in again.contents()] == [r.uid for r in buf.contents()]
  assert again.metrics()["buffer/retired"] == 0
  # and a default buffer loads a state written with the options on
  plain = buffer.ReplayBuffer(12, positive_fraction=0.25)
  plain.load_state_dict(buf.state_dict())
  assert len(plain) == len(buf)


def test_metric_keys_appear_with_their_options():
  plain = buffer.ReplayBuffer(8)
  plain.add([rollout(i) for i in range(4)])
  plain.sample(2)
  keys = set(plain.metrics())
  assert not keys & set(buffer.MAX_USES_KEYS + buffer.ZERO_VARIANCE_KEYS)
  assert set(busy_buffer().metrics()) >= keys | set(buffer.MAX_USES_KEYS + buffer.ZERO_VARIANCE_KEYS)


def test_threads_add_and_sample_concurrently():
  buf = buffer.ReplayBuffer(64, seed=9, priority="fresh", max_uses=2, replace_zero_variance=True)
  errors, done = [], threading.Event()

  def producer(k):
    step = 0
    while not done.is_set():
      buf.add([rollout(100000 * k + 4 * step + j, version=step, reward=float(j < k % 3),
                       group=100000 * k + step) for j in range(4)])
      step += 1

  def consumer():
    try:
      for _ in range(300):
        got = [r.uid for r in buf.sample(4, timeout=10)]
        if len(set(got)) != 4:
          errors.append(got)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  producers = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
  consumers = [threading.Thread(target=consumer) for _ in range(2)]
  for t in producers + consumers:
    t.start()
  for t in consumers:
    t.join()
  done.set()
  for t in producers:
    t.join()
  assert not errors
  m = buf.metrics()
  assert m["buffer/total_sampled"] == 2 * 300 * 4
  assert m["buffer/size"] + m["buffer/evicted"] + m["buffer/retired"] == m["buffer/total_added"]
  assert all(r.use_count < 2 for r in buf.contents())


def test_bad_options_and_config_validation():
  with pytest.raises(ValueError, match="priority='oldest'"):
    buffer.ReplayBuffer(8, priority="oldest")
  with pytest.raises(ValueError, match="fresh_tau=0"):
    buffer.ReplayBuffer(8, priority="fresh", fresh_tau=0.0)
  with pytest.raises(ValueError, match="max_uses=-1"):
    buffer.ReplayBuffer(8, max_uses=-1)
  with pytest.raises(ValueError, match="consume=True"):
    buffer.ReplayBuffer(8, consume=True, max_uses=1)
  c = defaults.base_config()
  c.buffer.priority, c.buffer.max_uses, c.buffer.fresh_tau = "fresh", 2, 8.0
  c.buffer.replace_zero_variance = True
  validation.validate_config(c)
  assert buffer.sampler_options(c.buffer) == dict(priority="fresh", fresh_tau=8.0, max_uses=2,
                                                  replace_zero_variance=True, fresh_base="uniform",
                                                  fresh_alpha=1.0, fresh_eps=1e-6)
  c.buffer.on_policy = True
  with pytest.raises(ValueError, match="on_policy=True uses each rollout once"):
    validation.validate_config(c)
  c.buffer.on_policy, c.buffer.priority = False, "lru"
  with pytest.raises(ValueError, match="buffer.priority='lru'"):
    validation.validate_config(c)


# ---- the sampler table -------------------------------------------------------------------------


def test_a_new_sampler_is_one_table_entry(monkeypatch):
  """A toy sampler (the oldest B held) added to `samplers.SAMPLERS` only: the buffer draws with it
  (its bookkeeping, here max_uses, still the storage's), validation accepts its name; removed, the
  name is refused again."""
  from jaxreplay.data import samplers  # pylint: disable=g-import-not-at-top

  class Oldest:
    consumes = False

    def draw(self, held, rng, batch_size):
      del rng
      return held.slots(np.arange(batch_size, dtype=np.int64))

  monkeypatch.setitem(samplers.SAMPLERS, "oldest", lambda options: Oldest())
  buf = buffer.ReplayBuffer(8, seed=0, priority="oldest", max_uses=1)
  buf.add([rollout(i) for i in range(6)])
  assert [r.uid for r in buf.sample(2)] == [0, 1]
  assert [r.uid for r in buf.sample(2)] == [2, 3]  # the first two were retired after one use
  assert buf.metrics()["buffer/retired"] == 4
  c = defaults.base_config()
  c.buffer.priority = "oldest"
  validation.validate_config(c)
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"buffer.priority='oldest': expected one of \('uniform', "
                                       r"'fresh'\)"):
    validation.validate_config(c)


def test_newest_unused_wraps_the_configured_sampler():
  """The reuse controller's mode takes the newest B never-used rollouts while B are unused, then
  falls back to the priority's draw (here the same draws as a buffer that never switched)."""
  a = buffer.ReplayBuffer(16, seed=3)
  b = buffer.ReplayBuffer(16, seed=3)
  for buf in (a, b):
    buf.add([rollout(i) for i in range(6)])
  a.set_newest_unused(True)
  assert [r.uid for r in a.sample(2)] == [5, 4]
  assert [r.uid for r in a.sample(2)] == [3, 2]
  assert [r.uid for r in a.sample(2)] == [1, 0]
  for _ in range(5):  # every rollout used: the uniform draws, from the untouched RNG stream
    assert [r.uid for r in a.sample(3)] == [r.uid for r in b.sample(3)]
