"""Fake workers, intake and hooks that drive the schedules (`jaxreplay.run.schedules`) without a
model: the tests of tests/run/schedules/ watch the events they record."""
import threading

import numpy as np

from jaxreplay.rollout.base import Completion, Group, PromptBatch, SamplingParams, Weights
from jaxreplay.run.schedules import GenerationCost, SimState, SimulatedScheduler


SAMPLING = SamplingParams(max_tokens=2)


class FakeWorker:
  """Completions of 2 tokens, or of `lengths(prompt)` tokens when given (no call counter)."""

  call_count = None

  def __init__(self, weights, log, lengths=None):
    self.policy_version, self.log, self.lengths = weights.version, log, lengths
    self.log.append(("make", weights.version))

  def generate(self, prompts, n, sampling):
    groups = []
    for i, p in enumerate(prompts):
      k = 2 if self.lengths is None else self.lengths(p)
      comp = Completion(np.zeros(k, np.int32), np.zeros(k, np.float32), "length")
      groups.append(Group(np.asarray(p), [comp] * n, self.policy_version, i))
    return groups

  def load_weights(self, weights):
    self.log.append(("load", weights.version))
    self.policy_version = weights.version

  def close(self):
    self.log.append(("close", self.policy_version))


class FakeIntake:
  """Requests of one prompt x 2 rollouts; `capacity` bounds held + in-flight rollouts (on-policy)."""

  def __init__(self, capacity=None):
    self.capacity, self.held, self.in_flight, self.count = capacity, 0, 0, 0
    self.delivered_versions, self.lock = [], threading.Lock()

  def next_request(self):
    with self.lock:
      if self.capacity is not None and self.held + self.in_flight + 2 > self.capacity:
        return None
      self.in_flight += 2
      self.count += 1
      return PromptBatch([np.array([1, self.count], np.int32)], 2, SAMPLING, meta=self.count)

  def score(self, batch, groups):
    return np.zeros((len(groups), len(groups[0].completions)), np.float32)

  def deliver(self, batch, groups, rewards=None):
    with self.lock:
      self.in_flight -= 2
      self.held += 2
      self.delivered_versions.append(groups[0].policy_version)

  def dropped(self, batch, error):
    with self.lock:
      self.in_flight -= 2


class FakeHooks:
  """Trains when >= batch rollouts are held (consuming them when `consume`); publishes each step."""

  def __init__(self, batch=2, consume=False, capacity=None, refresh_every=1, total=3):
    self.intake = FakeIntake(capacity)
    self.batch, self.consume, self.refresh_every, self.total = batch, consume, refresh_every, total
    self.step, self.weights, self.events = 0, Weights(0), []
    self.generated_seconds = []

  def done(self):
    return self.step >= self.total

  def latest_weights(self):
    return self.weights

  def generated(self, groups, seconds):
    self.generated_seconds.append(seconds)

  def can_train(self):
    return self.intake.held >= self.batch

  def train_step(self, now):
    self.events.append(("train", self.step, now, self.intake.delivered_versions[-self.batch:]))
    if self.consume:
      with self.intake.lock:
        self.intake.held -= self.batch
    self.step += 1
    return self.step

  def train_share(self, step):
    del step
    return 1.0

  def publish_if_due(self, step):
    if step % self.refresh_every:
      return None
    self.weights = Weights(step)
    return self.weights

  def finish_step(self, step, now):
    self.events.append(("finish", step, now))


def simulated(make, w, t, hooks_or_none=None, seconds_per_rollout=1.0, prefill=0.0, state=None,
              reference_tokens=2.0, train=1.0):
  state = state or SimState(reference_tokens=reference_tokens)
  cost = GenerationCost(seconds_per_rollout, prefill, state)
  return SimulatedScheduler(make, w, t, cost, train, state)
