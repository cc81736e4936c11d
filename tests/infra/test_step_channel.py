"""StepChannel: numbered messages from trainer process 0 to the others, over a key-value store.

The real store is jax.distributed's coordination service (exercised by tests/integration/test_multiprocess.py);
here a fake with the same methods and error texts checks ordering, chunking, clean-up and timeouts.
"""
import threading

import numpy as np
import pytest

from jaxreplay.infra import step_channel
from jaxreplay.data.buffer import Rollout


class FakeStore:
  """The coordination service's key-value methods used by StepChannel (thread-safe)."""

  def __init__(self):
    self.data = {}
    self.cond = threading.Condition()

  def key_value_set(self, key, value, allow_overwrite=False):
    self.key_value_set_bytes(key, value, allow_overwrite)

  def key_value_set_bytes(self, key, value, allow_overwrite=False):
    with self.cond:
      if key in self.data and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
      self.data[key] = value
      self.cond.notify_all()

  def _blocking(self, key, timeout_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
      return self.data[key]

  blocking_key_value_get = blocking_key_value_get_bytes = _blocking

  def key_value_try_get(self, key):
    with self.cond:
      if key not in self.data:
        raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
      return self.data[key]

  def key_value_delete(self, key):
    with self.cond:
      for k in [k for k in self.data if k == key or k.startswith(key)]:
        del self.data[k]


def _rollout(i):
  return Rollout(np.arange(3, dtype=np.int32) + i, np.arange(5, dtype=np.int32),
                 np.full(5, -0.5 * i, np.float32), float(i), 0.25 * i, i, i)


def test_messages_arrive_in_order_in_chunks_and_are_deleted_once_acknowledged(monkeypatch):
  monkeypatch.setattr(step_channel, "CHUNK_BYTES", 100)  # every message spans several chunks
  store = FakeStore()
  leader = step_channel.StepChannel(0, 3, client=store)
  followers = [step_channel.StepChannel(p, 3, client=store) for p in (1, 2)]
  messages = [("step", 0.5 * i, [_rollout(j) for j in range(i + 1)]) for i in range(4)]
  for m in messages:
    leader.send(m)
  assert any(k.endswith("/2") for k in store.data)  # a message is stored as several chunks
  for f in followers:
    for want in messages:
      kind, now, rollouts = f.receive()
      assert (kind, now) == want[:2]
      assert len(rollouts) == len(want[2])
      for got, exp in zip(rollouts, want[2]):
        np.testing.assert_array_equal(got.completion_tokens, exp.completion_tokens)
        np.testing.assert_array_equal(got.logprobs, exp.logprobs)
        assert (got.reward, got.advantage, got.policy_version) == (exp.reward, exp.advantage,
                                                                   exp.policy_version)
  # Every follower acknowledged message 3: the next send deletes messages 0..3.
  leader.send(("jobs", [1, 2]))
  left = {k.split("/")[2] for k in store.data if not k.split("/")[2] == "_ack"}
  assert left == {"4"}
  assert [f.receive() for f in followers] == [("jobs", [1, 2])] * 2


def test_a_message_is_kept_until_the_slowest_follower_has_it():
  store = FakeStore()
  leader = step_channel.StepChannel(0, 3, client=store)
  fast, slow = step_channel.StepChannel(1, 3, client=store), step_channel.StepChannel(2, 3, client=store)
  leader.send("a")
  assert fast.receive() == "a"
  leader.send("b")
  assert slow.receive() == "a"  # still there for the slow one
  assert fast.receive() == "b" and slow.receive() == "b"


def test_a_follower_blocks_until_the_leader_sends():
  store = FakeStore()
  leader, follower = step_channel.StepChannel(0, 2, client=store), step_channel.StepChannel(1, 2, client=store)
  got = []
  t = threading.Thread(target=lambda: got.append(follower.receive()))
  t.start()
  t.join(0.2)
  assert t.is_alive() and not got
  leader.send({"x": 1})
  t.join(5)
  assert got == [{"x": 1}]


def test_roles_and_timeouts(monkeypatch):
  monkeypatch.setattr(step_channel, "POLL_MS", 20)
  store = FakeStore()
  leader = step_channel.StepChannel(0, 2, client=store)
  follower = step_channel.StepChannel(1, 2, client=store, timeout_s=0.1)
  with pytest.raises(RuntimeError, match="only trainer process 0 sends"):
    follower.send("x")
  with pytest.raises(RuntimeError, match="does not receive"):
    leader.receive()
  with pytest.raises(step_channel.LeaderGone, match="waited 0 s"):
    follower.receive()
  with pytest.raises(ValueError, match=">= 2 trainer processes"):
    step_channel.StepChannel(0, 1, client=store)


def test_a_store_failure_is_leader_gone():
  class Broken(FakeStore):
    def _blocking(self, key, timeout_ms):
      raise RuntimeError("UNAVAILABLE: coordination service shut down")
    blocking_key_value_get = blocking_key_value_get_bytes = _blocking

  follower = step_channel.StepChannel(1, 2, client=Broken())
  with pytest.raises(step_channel.LeaderGone, match="lost trainer process 0"):
    follower.receive()
