"""Run-level safety: one run per workdir, graceful stop on signals, a guard against NaN updates.

  WorkdirLock      an exclusive `flock` on WORKDIR/.lock for the run's life. A second run on a busy
                   workdir fails at once (`WorkdirBusy`, naming the holder's pid and host); a lock
                   left by a dead process is released by the kernel with the process, so it is taken
                   over, with a message naming the dead pid.
  StopSignals      the first SIGTERM / SIGINT asks the run to stop after the current step (the
                   pipeline then checkpoints, closes its writers and returns); a second one exits at
                   once with 128 + signal number, as a shell does.
  NonFiniteGuard   counts consecutive updates the trainer skipped because the loss, gradient or new
                   parameters were NaN/inf (`trainer.make_train_step(skip_nonfinite=True)`); K in a row
                   stop the run with `NonFiniteUpdates`, a message that names the step, the batch and
                   the likely cause.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from typing import Any, Optional, Sequence

from absl import logging
import numpy as np

LOCK_NAME = ".lock"


class WorkdirBusy(RuntimeError):
  """Another live process runs in this workdir."""


class NonFiniteUpdates(RuntimeError):
  """Too many consecutive train steps had a non-finite loss or gradient."""


class WorkdirLock:
  """Exclusive lock of a run directory, held from `acquire()` to `release()` (or the `with` block).

  The lock is an `fcntl.flock` on WORKDIR/.lock: the kernel drops it when the holder dies (kill -9
  included), so a stale lock can never block a resume. The file records the holder's pid, host and
  start time; when it names a pid that no longer holds the lock, the takeover is logged.
  Processes other than the run's first (`jax.process_index() > 0` on a shared filesystem) should not
  take the lock: the caller decides.
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_NAME)
    self._fd: Optional[int] = None

  def acquire(self) -> "WorkdirLock":
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read_holder(fd)
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
             f"{holder.get('started')}" if holder else "another process")
      raise WorkdirBusy(
          f"workdir {os.path.dirname(self.path)} is in use by {who}: two runs in one workdir would "
          "mix their checkpoints and metric rows. Wait for that run to finish, stop it (kill "
          f"{holder.get('pid', '<pid>')}: it saves a checkpoint and exits), or choose another "
          "--workdir") from None
    previous = _read_holder(fd)
    if previous and previous.get("pid") != os.getpid():
      logging.warning("workdir lock: the previous run (pid %s on %s, started %s) ended without "
                      "releasing it (killed?); taking it over", previous.get("pid"),
                      previous.get("host"), previous.get("started"))
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _read_holder(fd: int) -> dict[str, Any]:
  try:
    raw = os.pread(fd, 4096, 0)
    return json.loads(raw.decode()) if raw.strip() else {}
  except (OSError, ValueError):
    return {}


class StopSignals:
  """SIGTERM / SIGINT handling for the run's main thread, as a context manager.

  Inside the block, the first signal sets `requested` (the name of the signal) and logs that the run
  will stop after the current step; the second exits the process at once (`os._exit(128 + signum)`,
  nothing more is written). The previous handlers come back on exit. Outside the main thread
  (signal handlers cannot be installed there) it does nothing.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested: Optional[str] = None
    self.signum: Optional[int] = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.requested is not None:
      logging.error("second %s: exiting now without saving", name)
      logging.flush()
      os._exit(128 + signum)  # pylint: disable=protected-access
    self.requested, self.signum = name, signum
    logging.warning("%s received: stopping after the current step (a checkpoint is saved); send it "
                    "again to exit at once", name)

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()


class NonFiniteGuard:
  """Counts consecutive skipped (non-finite) updates; `max_consecutive` in a row raise.

  `update(step, skipped, rollouts)` after each train step: `skipped` is the step's
  `nonfinite_skipped` metric, `rollouts` the batch's rollouts (for the message).
  """

  def __init__(self, max_consecutive: int):
    if max_consecutive < 1:
      raise ValueError(f"max_consecutive={max_consecutive} must be >= 1")
    self.max_consecutive = int(max_consecutive)
    self.consecutive = 0
    self.total = 0

  def update(self, step: int, skipped: bool, rollouts: Sequence[Any] = (),
             metrics: Optional[dict[str, float]] = None) -> None:
    if not skipped:
      self.consecutive = 0
      return
    self.consecutive += 1
    self.total += 1
    detail = describe_rollouts(rollouts)
    values = ", ".join(f"{k}={metrics[k]:.4g}" for k in ("loss", "grad_norm", "param_norm")
                       if metrics and k in metrics)
    logging.warning("step %d: non-finite update skipped (%s); %d in a row. Batch: %s", step,
                    values, self.consecutive, detail)
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteUpdates(
          f"step {step}: {self.consecutive} updates in a row had a non-finite loss, gradient or "
          f"parameters ({values}); the last batch: {detail}. The run stops here; its checkpoints "
          "hold only finite parameters. Likely causes: a learning rate far too large "
          "(trainer.learning_rate), no gradient clipping (trainer.max_grad_norm), or overflow in a "
          "low-precision dtype (model dtype bfloat16/float16). Lower the learning rate or enable "
          "clipping, then rerun the same command: it resumes from the last checkpoint")


def describe_rollouts(rollouts: Sequence[Any], limit: int = 3) -> str:
  """A short text naming a batch's rollouts (policy versions, rewards, lengths, the worst log-prob)."""
  if not rollouts:
    return "no rollouts"
  versions = sorted({int(getattr(r, "policy_version", -1)) for r in rollouts})
  rewards = np.asarray([float(getattr(r, "reward", np.nan)) for r in rollouts])
  lengths = [len(getattr(r, "completion_tokens", ())) for r in rollouts]
  parts = [f"{len(rollouts)} rollouts", f"policy versions {versions[:8]}"
           + ("..." if len(versions) > 8 else ""),
           f"reward mean {np.nanmean(rewards):.3g}" if np.isfinite(rewards).any() else "no rewards",
           f"completion lengths {min(lengths)}..{max(lengths)}"]
  bad = []
  for i, r in enumerate(rollouts):
    lp = np.asarray(getattr(r, "logprobs", ()), np.float64)
    if lp.size and not np.all(np.isfinite(lp)):
      bad.append(f"#{i} (group {getattr(r, 'group_id', '?')}, version "
                 f"{getattr(r, 'policy_version', '?')})")
  if bad:
    parts.append("non-finite behaviour log-probs in " + ", ".join(bad[:limit])
                 + (f" and {len(bad) - limit} more" if len(bad) > limit else ""))
  return "; ".join(parts)
