"""Tests of `jaxreplay.infra.safety`: the workdir lock, stop signals, the non-finite guard."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from absl import logging
import numpy as np
import pytest

from jaxreplay.infra import safety
from jaxreplay.learner.batch import Rollout
from tests.helpers.paths import REPO


def test_lock_is_exclusive_and_released(tmp_path):
  with safety.WorkdirLock(str(tmp_path)):
    holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(safety.WorkdirBusy, match=rf"pid {os.getpid()}.*another --workdir"):
      safety.WorkdirLock(str(tmp_path)).acquire()
  assert (tmp_path / ".lock").read_text() == ""  # released: no holder recorded
  with safety.WorkdirLock(str(tmp_path)):  # free again
    pass


def test_lock_held_by_another_process_and_taken_over_after_kill(tmp_path, caplog):
  script = textwrap.dedent(f"""\
      import sys, time
      sys.path.insert(0, {REPO!r})
      from jaxreplay.infra import safety
      safety.WorkdirLock({str(tmp_path)!r}).acquire()
      print("locked", flush=True)
      time.sleep(300)
      """)
  holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(safety.WorkdirBusy, match=f"pid {holder.pid}"):
      safety.WorkdirLock(str(tmp_path)).acquire()
    holder.kill()  # kill -9: the kernel drops the flock with the process
    holder.wait(timeout=30)
    logging.get_absl_logger().propagate = True
    with caplog.at_level("WARNING"):
      lock = safety.WorkdirLock(str(tmp_path)).acquire()
    lock.release()
    assert any(f"pid {holder.pid}" in r.getMessage() and "taking it over" in r.getMessage()
               for r in caplog.records)
  finally:
    holder.kill()


def test_first_signal_requests_a_stop_second_exits_at_once():
  script = textwrap.dedent(f"""\
      import os, signal, sys, time
      sys.path.insert(0, {REPO!r})
      from jaxreplay.infra import safety
      with safety.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("requested", stop.requested, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("not reached", flush=True)
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert "requested SIGTERM" in out.stdout and "not reached" not in out.stdout
  assert out.returncode == 128 + signal.SIGINT


def test_a_signal_at_start_up_ends_the_run_at_once():
  """At start-up the first SIGINT raises StartupInterrupted in the main thread; once `graceful()`
  was called, it requests a stop after the step instead."""
  script = textwrap.dedent(f"""\
      import os, signal, sys, time
      sys.path.insert(0, {REPO!r})
      from jaxreplay.infra import safety
      with safety.StopSignals(startup=True) as stop:
        try:
          os.kill(os.getpid(), signal.SIGINT)
          time.sleep(5)
          print("not reached", flush=True)
        except safety.StartupInterrupted as e:
          print("interrupted", e.signame, flush=True)
        stop.requested = None
        stop.graceful()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        print("requested", stop.requested, flush=True)
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert out.stdout.split("\n")[:2] == ["interrupted SIGINT", "requested SIGINT"], out.stderr
  assert out.returncode == 0


def test_a_start_up_stop_lost_in_a_callback_is_raised_again_without_a_traceback():
  """A start-up signal whose StartupInterrupted is raised inside a callback that swallows it (as
  JAX's garbage-collection callback did: "Exception ignored in _xla_gc_callback", then the run did
  not stop) is delivered again and raised in the main thread, and nothing is printed for it."""
  script = textwrap.dedent(f"""\
      import os, signal, sys, time
      sys.path.insert(0, {REPO!r})
      from jaxreplay.infra import safety
      class Callback:
        def __del__(self):  # exceptions raised here are lost ("Exception ignored in ...")
          os.kill(os.getpid(), signal.SIGINT)
          end = time.monotonic() + 1.0
          while time.monotonic() < end:
            pass  # the handler runs here, inside the callback
      with safety.StopSignals(startup=True, grace_s=60):
        try:
          c = Callback()
          del c
          print("callback returned", flush=True)
          time.sleep(5)
          print("not reached", flush=True)
        except safety.StartupInterrupted as e:
          print("interrupted", e.signame, flush=True)
      """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert out.stdout.split("\n")[:2] == ["callback returned", "interrupted SIGINT"], out.stderr
  assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
  assert out.returncode == 0


def test_the_watchdog_exits_when_the_main_thread_is_held():
  """A start-up signal while the main thread is inside a long C call (an XLA compile, here a
  C sleep the signal does not interrupt): the watchdog, woken by the signal itself, exits after the
  grace period with 128 + signum and the hint."""
  script = textwrap.dedent(f"""\
      import os, signal, sys, threading, time
      sys.path.insert(0, {REPO!r})
      from jaxreplay.infra import safety
      import ctypes
      with safety.StopSignals(startup=True, grace_s=1.0, hint="rerun to resume") as stop:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        # The main thread stays in C (the signal goes to another thread): no Python handler runs.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
        ctypes.CDLL(None).sleep(30)
        print("not reached", flush=True)
      """)
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert out.returncode == 128 + signal.SIGTERM, out.stderr
  assert time.monotonic() - t0 < 25  # not the 30 s of the C call
  assert "not reached" not in out.stdout and "rerun to resume" in out.stderr


def test_stop_signals_restore_previous_handlers():
  before = signal.getsignal(signal.SIGTERM)
  with safety.StopSignals() as stop:
    assert signal.getsignal(signal.SIGTERM) == stop._handle  # pylint: disable=protected-access
  assert signal.getsignal(signal.SIGTERM) == before


def _rollout(version, reward=1.0):
  return Rollout(np.array([1, 2]), np.array([3, 4, 5]), np.array([-0.1, -0.2, -0.3]), reward, 0.5,
                 version, 7)


def test_nonfinite_guard_counts_consecutive_skips_and_stops():
  guard = safety.NonFiniteGuard(max_consecutive=3)
  batch = [_rollout(4), _rollout(5, 0.0)]
  guard.update(1, True, batch, {"loss": float("nan")})
  guard.update(2, False, batch)  # a good update resets the run of skips
  guard.update(3, True, batch, {"loss": float("nan")})
  guard.update(4, True, batch, {"loss": float("nan")})
  assert guard.consecutive == 2 and guard.total == 3
  with pytest.raises(safety.NonFiniteUpdates, match=r"step 5: 3 updates in a row.*learning rate"):
    guard.update(5, True, batch, {"loss": float("nan"), "grad_norm": float("inf")})
  with pytest.raises(ValueError):
    safety.NonFiniteGuard(0)


def test_describe_rollouts_names_versions_rewards_and_lengths():
  text = safety.describe_rollouts([_rollout(4), _rollout(6, 0.0)])
  assert "2 rollouts" in text and "policy versions [4, 6]" in text
  assert "reward mean 0.5" in text and "completion lengths 3..3" in text
  assert safety.describe_rollouts([]) == "no rollouts"


def test_rollout_nonfinite_logprobs_error_says_where():
  with pytest.raises(ValueError, match=r"1 non-finite values.*token 1 .*policy version 9, group 7"):
    Rollout(np.array([1]), np.array([3, 4]), np.array([-0.1, np.nan]), 1.0, 0.0, 9, 7)
