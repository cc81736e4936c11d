"""Fake rollout workers and a recording prompt source / sink for `rollout.pool.WorkerPool` tests
(used by tests/rollout/test_pool.py and the weight-transport tests of the pool)."""
import itertools
import threading

import numpy as np

from jaxreplay.rollout.base import Completion, Group, SamplingParams, WorkerDied
from jaxreplay.rollout.pool import Delivery, PromptBatch, WorkerPool


SAMPLING = SamplingParams(max_tokens=4)


class FakeWorker:
  """Completions of `max_tokens` copies of the policy version; `generate` takes `delay` seconds
  and dies (WorkerDied) part-way when `die` is set. It fails loudly if a refresh overlaps a request."""

  def __init__(self, index, delay=0.02, version=0):
    self.index = index
    self.delay = delay
    self.policy_version = version
    self.die = threading.Event()
    self.in_generate = threading.Event()
    self.updates = []
    self.requests = 0
    self.call_sizes = []  # (prompts, n) of each generate call
    self.closed = False

  def generate(self, prompts, n, sampling):
    if self.closed:
      raise WorkerDied("closed")
    self.call_sizes.append((len(prompts), n))
    self.in_generate.set()
    try:
      version = self.policy_version
      groups = []
      for i, p in enumerate(prompts):  # Built prompt by prompt: a death leaves a half-made list.
        if self.die.wait(self.delay / len(prompts)):
          raise WorkerDied(f"fake worker {self.index} killed mid-request")
        comps = [Completion(np.full(sampling.max_tokens, version, np.int32),
                            np.full(sampling.max_tokens, -1.0, np.float32), "length") for _ in range(n)]
        groups.append(Group(np.asarray(p), comps, version, i))
      self.requests += 1
      return groups
    finally:
      self.in_generate.clear()

  def load_weights(self, weights):
    if self.in_generate.is_set():
      raise AssertionError("load_weights ran during a request")
    if self.die.is_set():
      raise WorkerDied("dead")
    self.updates.append((weights.hf_dir, weights.version))
    self.policy_version = weights.version

  def kill(self):
    self.die.set()

  def close(self):
    self.closed = True


class Recorder:
  """Prompt source (numbered batches of 2 prompts, n=3) and sink, with a condition to wait on."""

  def __init__(self):
    self.counter = itertools.count()
    self.deliveries = []
    self.drops = []
    self.cond = threading.Condition()

  def source(self, index):
    k = next(self.counter)
    return PromptBatch(prompts=[np.array([1, k % 50 + 3]), np.array([1, 2, 3])], n=3,
                       sampling=SAMPLING, meta=k)

  def sink(self, delivery):
    with self.cond:
      self.deliveries.append(delivery)
      self.cond.notify_all()

  def on_drop(self, batch, reason):
    self.drops.append((batch.meta, reason))

  def wait_for(self, predicate, timeout=20.0):
    with self.cond:
      assert self.cond.wait_for(lambda: predicate(self.deliveries), timeout), "timed out"
      return len(self.deliveries)


def check_complete(d: Delivery):
  assert len(d.groups) == len(d.batch.prompts) == 2
  for g in d.groups:
    assert g.policy_version == d.policy_version
    assert len(g.completions) == d.batch.n
    for c in g.completions:
      assert len(c.tokens) == SAMPLING.max_tokens
      np.testing.assert_array_equal(c.tokens, d.policy_version)  # made with that version's weights


def make_pool(rec, workers, num_workers=2, worker_kwargs=None, **kwargs):
  def make_worker(i):
    w = FakeWorker(i, **(worker_kwargs or {}))
    workers.setdefault(i, []).append(w)
    return w
  return WorkerPool(make_worker, num_workers, rec.source, rec.sink, on_drop=rec.on_drop,
                    restart_backoff_s=0.01, idle_sleep_s=0.01, **kwargs)


STOP = 999  # ChunkWorker's stop token


class ChunkWorker:
  """A deterministic worker for partial rollouts (`rollout.partial`): a context whose first token
  is L (its prompt is [L, k], 2 tokens) gets tokens until it holds L generated tokens, the L-th
  being STOP; every token is 10 * version + 1 with log-prob -(version + 1) / 10, so each token
  tells which weights made it. It records every call's contexts and max_tokens, and calls
  `on_call(worker)` after each call (a test refreshes the pool from there, deterministically)."""

  call_count = None

  def __init__(self, index, version=0, on_call=None, die_on_call=None):
    self.index, self.policy_version = index, version
    self.on_call, self.die_on_call = on_call, die_on_call
    self.calls = []  # (contexts, max_tokens, version) of each generate call
    self.updates = []
    self.closed = False

  def generate(self, prompts, n, sampling):
    assert n == 1, "continued sequences are sampled one per context"
    if self.die_on_call is not None and len(self.calls) == self.die_on_call:
      raise WorkerDied("chunk worker killed")
    self.calls.append(([np.asarray(p).copy() for p in prompts], sampling.max_tokens,
                       self.policy_version))
    v = self.policy_version
    groups = []
    for i, p in enumerate(prompts):
      p = np.asarray(p)
      left = int(p[0]) - (p.size - 2)
      k = min(sampling.max_tokens, left)
      tokens = np.full(k, 10 * v + 1, np.int32)
      reason = "length"
      if k == left:
        tokens[-1], reason = STOP, "stop"
      groups.append(Group(p, [Completion(tokens, np.full(k, -(v + 1) / 10, np.float32), reason)],
                          v, i))
    if self.on_call is not None:
      self.on_call(self)
    return groups

  def load_weights(self, weights):
    self.updates.append(weights.version)
    self.policy_version = weights.version

  def close(self):
    self.closed = True


class LengthSource(Recorder):
  """Requests of one prompt [L, k] per entry of `lengths` (n = `n`, max_tokens `max_tokens`),
  then None."""

  def __init__(self, lengths, n=2, max_tokens=64):
    super().__init__()
    self.lengths, self.n = list(lengths), n
    self.sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,))

  def source(self, index):
    k = next(self.counter)
    if k >= len(self.lengths):
      return None
    return PromptBatch(prompts=[np.array([self.lengths[k], k], np.int32)], n=self.n,
                       sampling=self.sampling, meta=k)
