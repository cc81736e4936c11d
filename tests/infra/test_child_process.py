"""Tests of `ChildProcess`: calls, errors with the child's traceback, start-up failures and
timeouts, per-call timeouts, death, the child's environment, and scripts without a main guard.

The served classes live at module level: the child imports this module by name.
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxreplay.infra.child_process import ChildDied, ChildProcess, ChildTimeout
from tests.helpers.paths import REPO

_ENV_AT_IMPORT = os.environ.get("JAXREPLAY_CHILD_TEST")  # read in the child when it imports us


class Unpicklable(Exception):

  def __reduce__(self):
    raise TypeError("this exception does not pickle")


class Server:
  """The object the tests serve in the child."""

  def __init__(self, base: int = 0, pid_file: str = "", start_sleep_s: float = 0.0,
               start_error: str = "", close_sleep_s: float = 0.0):
    if pid_file:
      with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    if start_error:
      raise ValueError(start_error)
    time.sleep(start_sleep_s)
    self.base, self.close_sleep_s = base, close_sleep_s

  def add(self, x):
    return self.base + x

  def fail(self, message):
    raise ValueError(message)

  def fail_unpicklable(self):
    raise Unpicklable("no pickle")

  def unpicklable_result(self):
    return lambda: 0

  def sleep(self, seconds):
    time.sleep(seconds)
    return seconds

  def env(self, name):
    return os.environ.get(name), _ENV_AT_IMPORT

  def pid(self):
    return os.getpid()

  def close(self):
    time.sleep(self.close_sleep_s)


FACTORY = f"{__name__}:Server"


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


@pytest.fixture
def child():
  c = ChildProcess(FACTORY, (10,), startup_timeout_s=60, name="test child")
  yield c
  c.close()


def test_call_round_trip_close_and_sigint(child):
  assert child.pid != os.getpid() and child.is_alive()
  assert child.call("add", (5,)) == 15
  assert child.call("pid") == child.pid
  assert child.startup_seconds > 0
  os.kill(child.pid, signal.SIGINT)  # Ctrl-C is the parent's: the child ignores it
  os.kill(child.pid, signal.SIGTERM)  # so is a SIGTERM to the process group (preemption)
  time.sleep(0.2)
  assert child.call("add", (1,), timeout_s=30) == 11
  pid = child.pid
  child.close()
  assert not child.is_alive() and _gone(pid)
  child.close()  # idempotent
  with pytest.raises(ChildDied, match="dead"):
    child.call("add", (1,))


def test_child_exception_is_reraised_with_its_traceback(child):
  with pytest.raises(ValueError, match="boom") as info:
    child.call("fail", ("boom",))
  note = "\n".join(info.value.__notes__)
  assert f"raised in test child pid {child.pid} (fail)" in note
  assert "in fail" in note and "raise ValueError(message)" in note  # the child's frames
  with pytest.raises(RuntimeError, match="(?s)failed:.*Unpicklable: no pickle"):
    child.call("fail_unpicklable")
  with pytest.raises(Exception, match="pickle"):
    child.call("unpicklable_result")
  with pytest.raises(AttributeError, match="no_such_method"):
    child.call("no_such_method")
  with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
    child.call("add", (lambda: 0,))  # fails here, before anything is sent
  assert child.is_alive() and child.call("add", (1,)) == 11  # errors leave it serving


def test_startup_failures(tmp_path):
  pid_file = tmp_path / "pid"
  with pytest.raises(ChildDied, match="(?s)failed to start.*ValueError: bad start") as info:
    ChildProcess(FACTORY, kwargs=dict(start_error="bad start", pid_file=str(pid_file)),
                 startup_timeout_s=60)
  assert isinstance(info.value.__cause__, ValueError)
  assert _gone(int(pid_file.read_text()))
  with pytest.raises(ChildDied, match="(?s)failed to start.*ModuleNotFoundError"):
    ChildProcess("no_such_module_xyz:Thing", startup_timeout_s=60)
  with pytest.raises(ValueError, match="module:callable"):
    ChildProcess("collections.Counter")
  with pytest.raises(ValueError, match="__main__"):
    ChildProcess("__main__:Server")
  with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
    ChildProcess(FACTORY, (lambda: 0,))  # before any process starts


def test_startup_timeout_kills_the_child(tmp_path):
  pid_file = tmp_path / "pid"
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="did not start within 3"):
    ChildProcess(FACTORY, kwargs=dict(start_sleep_s=60, pid_file=str(pid_file)),
                 startup_timeout_s=3.0)
  assert time.monotonic() - start < 30
  # On a loaded machine the interpreter may not reach the factory (which writes the pid) within
  # the timeout; when it did, the child must be gone.
  if pid_file.exists():
    assert _gone(int(pid_file.read_text()))


def test_call_timeout_kills_the_child(child):
  pid = child.pid
  start = time.monotonic()
  with pytest.raises(ChildTimeout, match="'sleep' took more than 0.5 s"):
    child.call("sleep", (60,), timeout_s=0.5)
  assert time.monotonic() - start < 10
  assert not child.is_alive() and _gone(pid)
  with pytest.raises(ChildDied, match="dead"):
    child.call("add", (1,))


def test_sigkill_mid_call_raises_child_died(child):
  assert child.call("sleep", (0.01,)) == 0.01
  threading.Timer(0.5, os.kill, (child.pid, signal.SIGKILL)).start()
  start = time.monotonic()
  with pytest.raises(ChildDied) as info:
    child.call("sleep", (60,))
  assert not isinstance(info.value, ChildTimeout)
  assert time.monotonic() - start < 10
  assert not child.is_alive()
  start = time.monotonic()
  child.close()
  assert time.monotonic() - start < 5


def test_kill_from_another_thread_mid_call(child):
  threading.Timer(0.5, child.kill).start()
  with pytest.raises(ChildDied, match="killed by its owner"):
    child.call("sleep", (60,))
  assert not child.is_alive()


def test_close_kills_a_child_whose_close_hangs():
  c = ChildProcess(FACTORY, kwargs=dict(close_sleep_s=60), startup_timeout_s=60)
  pid = c.pid
  start = time.monotonic()
  c.close(timeout_s=1.0)
  assert time.monotonic() - start < 10
  assert _gone(pid)


def test_env_is_set_before_the_child_imports_anything():
  assert "JAXREPLAY_CHILD_TEST" not in os.environ
  c = ChildProcess(FACTORY, env={"JAXREPLAY_CHILD_TEST": "42"}, startup_timeout_s=60)
  try:
    assert c.call("env", ("JAXREPLAY_CHILD_TEST",)) == ("42", "42")  # (now, at import)
  finally:
    c.close()
  assert "JAXREPLAY_CHILD_TEST" not in os.environ


def test_script_without_main_guard(tmp_path):
  """A multiprocessing spawn would re-run this unguarded script in the child; a fresh interpreter
  does not. A child left open is killed when the script exits."""
  script = tmp_path / "unguarded.py"
  script.write_text(textwrap.dedent("""\
      from jaxreplay.infra.child_process import ChildProcess
      print("top level ran", flush=True)
      child = ChildProcess("collections:Counter", ("abracadabra",), startup_timeout_s=60)
      print("result", child.call("most_common", (1,)), flush=True)
      child.close()
      left_open = ChildProcess("collections:Counter", startup_timeout_s=60)
      print("left open", left_open.pid, flush=True)
      """))
  env = dict(os.environ, PYTHONPATH=REPO)
  out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr
  assert out.stdout.count("top level ran") == 1
  assert "result [('a', 5)]" in out.stdout
  pid = int(out.stdout.split("left open")[1].split()[0])
  deadline = time.monotonic() + 10
  while not _gone(pid) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _gone(pid)


def test_child_busy_in_a_call_exits_when_its_parent_is_killed(tmp_path):
  """kill -9 of the parent while the child is inside a long call: pipe EOF cannot wake it, the
  orphan watchdog ends it within about a second (before: it lived until the call returned)."""
  pid_file = tmp_path / "child.pid"
  script = tmp_path / "parent.py"
  script.write_text(textwrap.dedent(f"""\
      from jaxreplay.infra.child_process import ChildProcess
      child = ChildProcess("tests.infra.test_child_process:Server",
                           kwargs=dict(pid_file={str(pid_file)!r}), startup_timeout_s=60)
      print("ready", flush=True)
      child.call("sleep", (300,))
      """))
  env = dict(os.environ, PYTHONPATH=REPO)
  parent = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            text=True)
  try:
    assert parent.stdout.readline().strip() == "ready"
    child_pid = int(pid_file.read_text())
    time.sleep(0.5)  # the child is inside sleep(300)
    assert not _gone(child_pid)
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not _gone(child_pid) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert _gone(child_pid), "the orphaned child still runs"
  finally:
    parent.kill()
