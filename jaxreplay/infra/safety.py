"""Run-level safety: one run per workdir, graceful stop on signals, a guard against NaN updates.

  WorkdirLock      an exclusive `flock` on WORKDIR/.lock for the run's life. A second run on a busy
                   workdir fails at once (`WorkdirBusy`, naming the holder's pid and host); a lock
                   left by a dead process is released by the kernel with the process, so it is taken
                   over, with a message naming the dead pid.
  StopSignals      the first SIGTERM / SIGINT asks the run to stop after the current step (the
                   pipeline then checkpoints, closes its writers and returns); a second one exits at
                   once with 128 + signal number, as a shell does. During start-up (until the
                   run's step 0 is recorded) the first one ends the run at once
                   (`StartupInterrupted`), within a grace period even while an XLA compile holds the main thread.
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
import sys
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


class StartupInterrupted(KeyboardInterrupt):
  """A stop signal before the run started (step 0 recorded): the run ends at once (nothing to
  save)."""

  def __init__(self, signame: str):
    super().__init__(signame)
    self.signame = signame


class StopSignals:
  """SIGTERM / SIGINT handling for the run's main thread, as a context manager.

  Two modes. At start-up (`startup=True`, until `graceful()` is called: the pipeline does just
  before it writes its step-0 row) nothing has been trained yet: the first signal ends the run at
  once. Its handler raises
  `StartupInterrupted` (a KeyboardInterrupt) in the main thread, whose `with` blocks close what was
  started; a watchdog thread, woken by the signal itself (`signal.set_wakeup_fd`: the main thread
  may be inside a long XLA compile, where no Python handler runs), ends the process with
  128 + signal number once `grace_s` have passed without it exiting, after logging `hint`.
  Afterwards (and always with `startup=False`) the first signal sets `requested` (the signal's
  name) and logs that the run will stop after the current step; the second exits the process at
  once (`os._exit(128 + signum)`, nothing more is written; the watchdog does it too when the main
  thread does not get to it within `grace_s`). The previous handlers come back on exit. Outside
  the main thread (signal handlers cannot be installed there) it does nothing.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, startup: bool = False, grace_s: float = 3.0, hint: str = ""):
    self.requested: Optional[str] = None
    self.signum: Optional[int] = None
    self.startup = startup
    self.grace_s = float(grace_s)
    self.hint = hint
    self._previous: dict[int, Any] = {}
    self._wakeup: Optional[tuple[int, int, int]] = None  # (read fd, write fd, previous wakeup fd)
    self._count = 0  # signals seen by the watchdog
    self._unraisable_hook: Optional[Any] = None  # sys.unraisablehook before the block

  def graceful(self) -> None:
    """Ends the start-up mode: from now on a first signal stops the run after its step."""
    self.startup = False

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.requested is not None:
      logging.error("second %s: exiting now without saving", name)
      logging.flush()
      os._exit(128 + signum)  # pylint: disable=protected-access
    self.requested, self.signum = name, signum
    if self.startup:
      raise StartupInterrupted(name)
    logging.warning("%s received: stopping after the current step (a checkpoint is saved); send it "
                    "again to exit at once", name)

  def _unraisable(self, unraisable) -> None:
    """A start-up stop raised inside a callback that swallows exceptions (JAX's garbage-collection
    callback runs Python code wherever a collection starts) is lost there; it is delivered again
    from another thread, so that the main thread raises it once the callback has returned, and no
    "Exception ignored" traceback is printed. Anything else goes to the previous hook."""
    if isinstance(unraisable.exc_value, StartupInterrupted) and self.signum is not None:
      signum, self.requested = self.signum, None
      threading.Timer(0.05, os.kill, args=(os.getpid(), signum)).start()
      return
    (self._unraisable_hook or sys.__unraisablehook__)(unraisable)

  def _watch(self, read_fd: int) -> None:
    """The watchdog thread: exits the process when a start-up signal (or a second one) is not
    honoured by the main thread within grace_s."""
    while True:
      try:
        data = os.read(read_fd, 64)
      except OSError:
        return
      if not data:
        os.close(read_fd)  # the block ended (its write end was closed)
        return
      for signum in data:
        if signum not in self.SIGNALS:
          continue
        self._count += 1
        if self.startup or self._count >= 2:
          threading.Thread(target=self._exit_after_grace, args=(signum,), daemon=True).start()

  def _exit_after_grace(self, signum: int) -> None:
    time.sleep(self.grace_s)
    name = signal.Signals(signum).name
    logging.error("%s: the run did not stop within %.0f s; exiting now. %s", name, self.grace_s,
                  self.hint)
    logging.flush()
    os._exit(128 + signum)  # pylint: disable=protected-access

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
      self._unraisable_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
      read_fd, write_fd = os.pipe()
      os.set_blocking(write_fd, False)
      try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
      except ValueError:  # not the main interpreter: no watchdog
        os.close(read_fd)
        os.close(write_fd)
      else:
        self._wakeup = (read_fd, write_fd, previous)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                         name="stop-signals-watchdog").start()
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()
    if self._unraisable_hook is not None:
      sys.unraisablehook, self._unraisable_hook = self._unraisable_hook, None
    if self._wakeup is not None:
      read_fd, write_fd, previous = self._wakeup
      self._wakeup = None
      signal.set_wakeup_fd(previous)
      os.close(write_fd)  # the watchdog reads EOF and ends


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
