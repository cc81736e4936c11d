"""`ChildProcess`: an object built and served in a fresh Python interpreter, called over pipes.

The child is `python -c ...` started with `subprocess`, not `multiprocessing`: its "spawn" and
"forkserver" start methods re-run the parent's `__main__` (a calling script needs an
`if __name__ == "__main__":` guard, and an unguarded one breaks), and "fork" is unsafe next to the
threads of JAX, vLLM or torch. A fresh interpreter imports only what the child needs, so any script
may start one, guarded or not. The price: what the child builds must be importable by name
(`"module:callable"`, never `__main__`) and its arguments picklable.

Protocol (two inherited pipes, `multiprocessing.connection` framing): the parent sends its
`sys.path`, then the pickled (factory, args, kwargs); the child builds the object and answers
("ready", None) or ("error", packed). Each request is (method_name, args); the answer is
("ok", value) or ("error", packed), where packed is (the pickled exception or None, the child's
formatted traceback). `None` asks the child to call the object's `close()` (if any) and exit. The
child also exits when the parent's end of the pipe closes, and, even in the middle of a call,
within half a second of its parent's death (a watchdog thread: no orphans after a kill -9).
"""
from __future__ import annotations

import atexit
import importlib
from multiprocessing import connection as mp_connection
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Optional
import weakref

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_POLL_S = 0.05  # how often a waiting parent checks that the child still runs
# Killed when this interpreter exits (as multiprocessing does with daemon children); an idle child
# whose parent is gone otherwise exits by itself on pipe EOF.
_LIVE: "weakref.WeakSet[ChildProcess]" = weakref.WeakSet()


@atexit.register
def _kill_live_children() -> None:
  for child in list(_LIVE):
    try:
      child.kill()
    except Exception:  # pylint: disable=broad-except
      pass


class ChildDied(RuntimeError):
  """The child process is gone: it failed to start, crashed, was killed, or its call timed out."""


class ChildTimeout(ChildDied):
  """A call did not answer within its timeout; the child was killed."""


def _pack_exception(e: BaseException) -> tuple[Optional[bytes], str]:
  text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
  try:
    return pickle.dumps(e), text
  except Exception:  # pylint: disable=broad-except
    return None, text


def _unpack_exception(packed: tuple[Optional[bytes], str], where: str) -> Exception:
  """The child's exception with its traceback as a note, else a RuntimeError holding that text."""
  blob, text = packed
  if blob is not None:
    try:
      e = pickle.loads(blob)
    except Exception:  # pylint: disable=broad-except
      e = None
    if isinstance(e, Exception):
      e.add_note(f"[raised in {where}]\n{text}")
      return e
  return RuntimeError(f"{where} failed:\n{text}")


def _resolve(factory: str):
  module, _, name = factory.partition(":")
  obj = importlib.import_module(module)
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _exit_when_orphaned(parent_pid: int, poll_s: float = 0.5) -> threading.Thread:
  """A daemon thread that ends this process (os._exit) within `poll_s` of its parent's death.

  Pipe EOF only wakes a child waiting for a request; one busy in a long call (a vLLM generate)
  would otherwise live on after a kill -9 of its parent, holding memory and devices.
  """
  def watch():
    while os.getppid() == parent_pid:
      time.sleep(poll_s)
    os._exit(0)  # pylint: disable=protected-access
  thread = threading.Thread(target=watch, name="orphan-watchdog", daemon=True)
  thread.start()
  return thread


def _serve(read_fd: int, write_fd: int) -> None:
  """The child's main: build the object, then answer requests until told to close or orphaned."""
  # Ctrl-C and a SIGTERM sent to the whole process group (SLURM preemption, scancel) are the
  # parent's to handle: it stops after its step and closes this child. The child still ends on
  # pipe EOF, on its parent's death (the watchdog) and on `kill()` (SIGKILL).
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  _exit_when_orphaned(os.getppid())
  inp = mp_connection.Connection(read_fd, writable=False)
  out = mp_connection.Connection(write_fd, readable=False)
  try:
    # The parent's path first, so that unpickling the arguments can import what the parent can.
    sys.path.extend(p for p in pickle.loads(inp.recv_bytes()) if p not in sys.path)
    factory, args, kwargs = pickle.loads(inp.recv_bytes())
    obj = _resolve(factory)(*args, **kwargs)
  except BaseException as e:  # pylint: disable=broad-except
    out.send(("error", _pack_exception(e)))
    return
  out.send(("ready", None))
  while True:
    try:
      request = inp.recv()
    except (EOFError, OSError):
      return  # The parent is gone.
    if request is None:
      close = getattr(obj, "close", None)
      try:
        if close is not None:
          close()
        reply = ("ok", None)
      except Exception as e:  # pylint: disable=broad-except
        reply = ("error", _pack_exception(e))
      try:
        out.send(reply)
      except (BrokenPipeError, OSError):
        pass
      return
    method, args = request
    try:
      reply = ("ok", getattr(obj, method)(*args))
    except Exception as e:  # pylint: disable=broad-except
      reply = ("error", _pack_exception(e))
    try:
      out.send(reply)
    except (BrokenPipeError, OSError):
      return
    except Exception as e:  # pylint: disable=broad-except
      # An unpicklable result: send pickles before it writes, so the pipe is still in sync.
      out.send(("error", _pack_exception(e)))


class ChildProcess:
  """`factory(*args, **kwargs)` built in a fresh interpreter, its methods called over pipes.

  One call at a time (a lock). The child inherits this process's environment plus `env` (set before
  the interpreter starts, so before anything is imported), stdout and stderr, and gets the package
  on PYTHONPATH and this process's `sys.path`. It ignores SIGINT and SIGTERM. A child that dies (crash, kill,
  pipe EOF) makes the call raise `ChildDied`; the object is then unusable (make a new one).

  Args:
    factory: "module:callable" (e.g. "jaxreplay.rollout.vllm.engine:VllmEngine"), importable in a
      fresh interpreter (not `__main__`).
    args, kwargs: its arguments; picklable. Pickled here: an unpicklable one raises before any
      process starts.
    env: environment variables for the child on top of this process's.
    startup_timeout_s: the child is killed and TimeoutError raised when the object is not built by
      then (None waits as long as the child lives).
    name: how errors name the child, e.g. "vLLM worker".

  Raises (from the constructor): TimeoutError (start-up timeout); ChildDied when the child exits or
  `factory` raises during start-up (its traceback is in the message; the exception, when it
  unpickles, is the __cause__).
  """

  def __init__(self, factory: str, args: tuple = (), kwargs: Optional[dict[str, Any]] = None, *,
               env: Optional[dict[str, str]] = None, startup_timeout_s: Optional[float] = 300.0,
               name: str = "child process"):
    module, sep, attr = factory.partition(":")
    if not (module and sep and attr) or module == "__main__":
      raise ValueError(f"factory={factory!r} must be 'module:callable' of an importable module "
                       "(not __main__), e.g. 'jaxreplay.rollout.vllm.engine:VllmEngine'")
    spec = pickle.dumps((factory, tuple(args), dict(kwargs or {})))
    self.name = name
    self._lock = threading.Lock()  # Held by the call in flight.
    self._dead: Optional[str] = None  # Why the child is unusable, once it is.
    self._closed = False
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, child_env.get("PYTHONPATH", "")) if p)
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    code = f"from jaxreplay.infra.child_process import _serve; _serve({to_child_r}, {from_child_w})"
    start = time.perf_counter()
    try:
      self._proc = subprocess.Popen([sys.executable, "-c", code],
                                    pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
                                    env=child_env, close_fds=True)
    except BaseException:
      os.close(to_child_w)
      os.close(from_child_r)
      raise
    finally:
      # Only the child holds these ends: its death then reads as EOF here.
      os.close(to_child_r)
      os.close(from_child_w)
    self._send = mp_connection.Connection(to_child_w, readable=False)
    self._recv = mp_connection.Connection(from_child_r, writable=False)
    try:
      self._send.send_bytes(pickle.dumps(list(sys.path)))
      self._send.send_bytes(spec)
    except OSError as e:
      self.kill()
      raise ChildDied(f"{self._where()} died while starting (exit code {self._proc.returncode})"
                      ) from e
    try:
      status, payload = self._receive(startup_timeout_s, "start-up")
    except TimeoutError:
      self.kill()
      raise TimeoutError(f"{self._where()} did not start within {startup_timeout_s} s") from None
    except ChildDied:
      self.kill()
      raise
    if status != "ready":
      self.kill()
      raise ChildDied(f"{self._where()} failed to start:\n{payload[1]}") from _unpack_exception(
          payload, f"{self._where()} start-up")
    self.startup_seconds = time.perf_counter() - start
    _LIVE.add(self)

  @property
  def pid(self) -> int:
    return self._proc.pid

  def is_alive(self) -> bool:
    return self._dead is None and self._proc.poll() is None

  def call(self, method: str, args: tuple = (), timeout_s: Optional[float] = None) -> Any:
    """`obj.method(*args)` in the child; returns its value.

    Raises: the child's exception (re-raised here with the child's traceback as a note; a
    RuntimeError holding that traceback when it does not unpickle); ChildTimeout after `timeout_s`
    seconds (None: no limit), the child then killed; ChildDied when the child is or goes dead.
    Arguments that do not pickle raise here and leave the child serving.
    """
    with self._lock:
      if self._dead is not None:
        self._close_pipes()
        raise ChildDied(f"{self._where()} is dead ({self._dead})")
      try:
        self._send.send((method, tuple(args)))
      except OSError as e:
        raise self._died(f"pipe closed when sending {method!r}: {e}") from e
      try:
        status, payload = self._receive(timeout_s, method)
      except TimeoutError as e:
        died = self._died(f"{method!r} took more than {timeout_s} s; the child was killed")
        raise ChildTimeout(str(died)) from e
    if status == "error":
      raise _unpack_exception(payload, f"{self._where()} ({method})")
    return payload

  def close(self, timeout_s: float = 10.0) -> None:
    """Asks the child to close its object and exit; kills it when that takes over `timeout_s`."""
    if self._closed:
      return
    self._closed = True
    deadline = time.monotonic() + timeout_s
    if self._lock.acquire(timeout=timeout_s):
      try:
        if self.is_alive():
          try:
            self._send.send(None)
            self._receive(max(deadline - time.monotonic(), 0.0), "close")
          except (ChildDied, TimeoutError, OSError):
            pass
      finally:
        self._lock.release()
    try:
      self._proc.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
      pass
    self.kill()

  def kill(self) -> None:
    """Kills the child now and reaps it; safe from any thread, also while a call is in flight
    (that call then raises ChildDied)."""
    if self._dead is None:  # Before the kill: a call in flight then reports this reason.
      self._dead = "killed by its owner"
    self._proc.kill()  # A no-op once the child is reaped.
    self._proc.wait()
    if self._lock.acquire(blocking=False):  # Else the call in flight closes the pipes.
      try:
        self._close_pipes()
      finally:
        self._lock.release()

  def __del__(self):
    try:
      if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
        self.kill()
    except Exception:  # pylint: disable=broad-except
      pass

  # ---- helpers ----------------------------------------------------------------------------------

  def _where(self) -> str:
    return f"{self.name} pid {self._proc.pid}"

  def _receive(self, timeout_s: Optional[float], what: str):
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      wait = _POLL_S if deadline is None else min(_POLL_S, max(deadline - time.monotonic(), 0.0))
      try:
        if self._recv.poll(wait):
          return self._recv.recv()
      except (EOFError, OSError) as e:
        raise self._died(f"pipe closed while waiting for {what}") from e
      if self._proc.poll() is not None and not self._recv.poll(0):
        raise self._died(f"process exited during {what}")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"no answer to {what} within {timeout_s} s")

  def _died(self, reason: str) -> ChildDied:
    """Kills and reaps the child, closes the pipes (lock held), and marks it dead; the first
    reason wins (e.g. `kill()` from another thread)."""
    self._proc.kill()  # A no-op when it has exited already: the exit code below is its own.
    self._proc.wait()
    self._close_pipes()
    if self._dead is None:
      self._dead = f"{reason} (exit code {self._proc.returncode})"
    return ChildDied(f"{self._where()} died: {self._dead}")

  def _close_pipes(self) -> None:
    for conn in (self._send, self._recv):
      if not conn.closed:
        conn.close()
