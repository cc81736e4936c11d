"""Messages from trainer process 0 to the other trainer processes (multi-process async schedule).

Under the asynchronous schedule with several trainer processes (`jax.distributed`), process 0 owns
the replay buffer and the rollout workers; every other process ("follower") holds no buffer and
generates nothing. Each step process 0 samples the batch's rollouts and sends them to every
follower, so that all processes collate the same batch and take the same step; engine evaluation
results travel the same way. The messages go through the key-value store of JAX's coordination
service (the one `jax.distributed.initialize` started), not through device collectives: a follower
may wait minutes for the next batch (engines starting, a slow generation) without holding a device
collective open.

Messages are numbered: the n-th `send` of process 0 is the n-th `receive` of every follower (both
sides run the same control flow). A message is pickled and stored in chunks of at most
`CHUNK_BYTES` (the coordination service's RPCs have a size limit); process 0 deletes a message once
every follower has acknowledged it (`_ack/<process>` keys), so the store holds a few at a time.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, Optional

CHUNK_BYTES = 8 << 20  # 8 MiB per key-value entry
POLL_MS = 5_000  # a follower re-checks the leader's liveness this often while waiting


class LeaderGone(RuntimeError):
  """Process 0 stopped sending (it failed, or the coordination service went away)."""


def _client():
  """The coordination-service client of `jax.distributed` (None when single-process)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("StepChannel needs jax.distributed.initialize(...) first (a multi-process "
                       "trainer: launch with --coordinator_address / --num_processes / "
                       "--process_id)")
  return client


class StepChannel:
  """Numbered messages from process 0 to all other processes.

  Args:
    process_index, process_count: this process and how many there are (jax.process_index(),
      jax.process_count()).
    name: the key prefix (one channel per run).
    timeout_s: a follower's longest wait for one message before it gives up (LeaderGone); None
      waits as long as the coordination service lives.
    client: the key-value client (tests pass a fake); default: jax.distributed's.
  """

  def __init__(self, process_index: int, process_count: int, name: str = "jaxreplay/steps",
               timeout_s: Optional[float] = None, client=None):
    if process_count < 2:
      raise ValueError(f"a StepChannel joins >= 2 trainer processes, got {process_count}")
    self.process_index, self.process_count = int(process_index), int(process_count)
    self.name, self.timeout_s = name, timeout_s
    self._client = client if client is not None else _client()
    self._sent = 0  # messages sent (process 0) or received (followers)
    self._unacked: list[int] = []  # process 0: messages not yet deleted
    self.bytes_sent = 0

  @property
  def is_leader(self) -> bool:
    return self.process_index == 0

  def _key(self, seq: int, part: str) -> str:
    return f"{self.name}/{seq}/{part}"

  def send(self, message: Any) -> int:
    """Process 0: publishes `message` (picklable) as the next message; returns its number."""
    if not self.is_leader:
      raise RuntimeError("only trainer process 0 sends on the StepChannel")
    seq = self._sent
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for i, chunk in enumerate(chunks):
      self._client.key_value_set_bytes(self._key(seq, str(i)), chunk)
    self._client.key_value_set(self._key(seq, "n"), str(len(chunks)))  # last: the message is whole
    self._sent += 1
    self.bytes_sent += len(data)
    self._unacked.append(seq)
    self._collect()
    return seq

  def receive(self) -> Any:
    """A follower: the next message of process 0 (blocks until it is sent)."""
    if self.is_leader:
      raise RuntimeError("trainer process 0 sends on the StepChannel; it does not receive")
    seq = self._sent
    n = int(self._get(self._key(seq, "n"), text=True))
    data = b"".join(self._get(self._key(seq, str(i))) for i in range(n))
    self._sent += 1
    self._client.key_value_set(f"{self.name}/_ack/{self.process_index}", str(seq),
                               allow_overwrite=True)
    return pickle.loads(data)

  def _get(self, key: str, text: bool = False):
    deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
    while True:
      try:
        if text:
          return self._client.blocking_key_value_get(key, POLL_MS)
        return self._client.blocking_key_value_get_bytes(key, POLL_MS)
      except Exception as e:  # pylint: disable=broad-except
        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
          raise LeaderGone(f"trainer process {self.process_index} lost trainer process 0 while "
                           f"waiting for message {key!r}: {e}") from e
      if deadline is not None and time.monotonic() > deadline:
        raise LeaderGone(f"trainer process {self.process_index} waited {self.timeout_s:.0f} s for "
                         f"message {key!r} from trainer process 0")

  def _collect(self) -> None:
    """Deletes the messages every follower has acknowledged."""
    acked = []
    for p in range(1, self.process_count):
      try:
        acked.append(int(self._client.key_value_try_get(f"{self.name}/_ack/{p}")))
      except Exception:  # pylint: disable=broad-except
        acked.append(-1)  # NOT_FOUND: that follower has acknowledged nothing yet
    done = min(acked)
    keep = []
    for seq in self._unacked:
      if seq <= done:
        self._client.key_value_delete(f"{self.name}/{seq}/")  # a directory delete: every part
      else:
        keep.append(seq)
    self._unacked = keep
