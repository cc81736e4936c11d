"""Rewards: exact match, math-verify equivalence, and `SafeReward`, a time-limited runner.

A reward must never kill the run: `SafeReward` scores a crash, a timeout, a non-finite value, a call
over its memory limit or a dead worker as 0 and counts it ("reward/calls", "reward/errors",
"reward/timeouts", "reward/memory_errors", "reward/restarts"). math-verify's own timeouts use
SIGALRM, which only works in the main thread, and our rollout workers score from other threads, so
we call it with its timeouts off and enforce the limit here: in a persistent child process that is
killed and restarted on timeout (backend "process", for sympy-heavy rewards), or in a daemon thread
that is abandoned on timeout (backend "thread", for cheap rewards such as exact match, where a hang
cannot be interrupted but is cut off). A process worker also has an address-space limit
(RLIMIT_AS, `memory_limit_gib` beyond its size after start-up): a call that needs more (e.g. a
huge integer power such as "2^{2^{34}}") stops growing there, scores 0 and, when the MemoryError
reaches us, the worker is restarted (math-verify catches some MemoryErrors itself and just
answers 0), instead of growing until the machine swaps.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import logging
import math
import pickle
import queue
import resource
import threading
from typing import Any, Callable, Optional, Sequence

from absl import logging as absl_logging
import numpy as np

from jaxreplay.infra.child_process import ChildDied, ChildProcess, ChildTimeout

_MATH_VERIFY_QUIET = False


def exact_match_reward(completion: str, answer: str) -> float:
  """1.0 when the completion's first line, stripped, equals `answer` stripped; else 0.0."""
  return float(completion.split("\n", 1)[0].strip() == answer.strip())


def _gold_text(answer: str) -> str:
  # math-verify extracts LaTeX from $...$ or \boxed{...}; datasets store bare answers ("\frac{1}{2}").
  if "$" in answer or "\\boxed" in answer:
    return answer
  return f"${answer}$"


def math_verify_reward(completion: str, answer: str) -> float:
  """1.0 when math-verify finds the completion's final answer equivalent to `answer`; else 0.0.

  `answer` is the reference (a bare expression such as "\\frac{1}{2}", or text with \\boxed{});
  the completion's answer is its boxed expression, else its last parseable expression. Runs with
  math-verify's signal timeouts disabled (works in any thread): wrap it in `SafeReward` for a time
  limit. Raises ValueError when the reference itself cannot be parsed (a data problem, counted as
  an error by SafeReward).
  """
  global _MATH_VERIFY_QUIET
  from math_verify import parse, verify
  if not _MATH_VERIFY_QUIET:
    # It warns once per process that its timeouts are off: we enforce them ourselves.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _MATH_VERIFY_QUIET = True
  gold = parse(_gold_text(answer), parsing_timeout=None)
  if not gold:
    raise ValueError(f"math-verify could not parse the reference answer {answer[:200]!r}")
  pred = parse(completion, parsing_timeout=None)
  if not pred:
    return 0.0
  return float(verify(gold, pred, timeout_seconds=None))


# ---- reward plug-ins: task.reward_fn = "module:function" ---------------------------------------


def import_object(spec: str, key: str = "reward_fn") -> Any:
  """The callable named by `spec` = "module:attr" (dots allowed in both parts, e.g.
  "my_pkg.rewards:Scorer.score"); `key` names the config key in messages. Raises ValueError naming
  the problem and the fix when the module cannot be imported, the attribute is missing or it is
  not callable."""
  if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
    raise ValueError(f"{key}={spec!r}: expected 'module:function' (e.g. 'my_rewards:score')")
  module_name, attr = spec.split(":")
  try:
    obj = importlib.import_module(module_name)
  except Exception as e:  # pylint: disable=broad-except  (an ImportError, or the module's own)
    raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} "
                     f"({type(e).__name__}: {e}); put it on PYTHONPATH (or in the directory you launch from) and check "
                     "that it imports on its own") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
      raise ValueError(f"{key}={spec!r}: module {module_name!r} has no attribute {attr!r}; "
                       f"public names there: {public}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"{key}={spec!r} is a {type(obj).__name__}, not a function")
  return obj


def import_reward_fn(spec: str) -> Callable[..., float]:
  """The function named by `spec` = "module:function" (`import_object`). Raises ValueError naming
  the problem and the fix when it cannot be imported or called as fn(completion, answer)."""
  obj = import_object(spec, "reward_fn")
  try:
    inspect.signature(obj).bind("completion", "answer")
  except TypeError as e:
    raise ValueError(f"reward_fn={spec!r} cannot be called as fn(completion: str, answer: str) "
                     f"({e}); its signature is {spec.split(':')[1]}{inspect.signature(obj)}") from e
  except ValueError:
    pass  # a builtin without a signature: the warm-up call checks it
  return obj


class PluginReward:
  """A picklable reward that imports `spec` ("module:function") where it is first called: in a
  reward child process, the function never crosses a pipe (only its name does).

  Called as fn(completion: str, answer: str) -> float, like `math_verify_reward`.
  """

  def __init__(self, spec: str):
    self.spec = spec
    self.__name__ = spec  # SafeReward's messages name the function
    self._fn: Optional[Callable[..., float]] = None

  def __getstate__(self):
    return {"spec": self.spec}

  def __setstate__(self, state):
    self.__init__(state["spec"])

  def __call__(self, completion: str, answer: str) -> float:
    if self._fn is None:
      self._fn = import_reward_fn(self.spec)
    return self._fn(completion, answer)


# ---- worker slots: one call at a time, with a deadline ---------------------------------------

_GIB = 1 << 30


def _address_space_bytes() -> Optional[int]:
  """This process's virtual address space [bytes] (VmSize of /proc/self/status); None off Linux."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def limit_address_space(extra_bytes: int) -> int:
  """Caps this process's address space (RLIMIT_AS, soft limit) at its current size plus
  `extra_bytes`; returns the limit [bytes]. Allocations beyond it fail: Python raises MemoryError.
  Meant for a child process (a reward worker); never call it in the trainer."""
  base = _address_space_bytes() or 0
  _, hard = resource.getrlimit(resource.RLIMIT_AS)
  limit = base + int(extra_bytes)
  if hard != resource.RLIM_INFINITY:
    limit = min(limit, hard)
  resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
  return limit


class _RewardServer:
  """What a reward child process serves: `score(*args)` -> float(fn(*args)).

  The warm-up call runs at start-up: first-call imports (sympy, ...) must not eat a scored call's
  time limit. Its errors are ignored (the scored calls report theirs). Then, with
  `memory_limit_bytes`, the process's address space is capped at its size after the warm-up plus
  that much (`limit_address_space`): the interpreter, its imports and thread stacks (whose size
  varies from machine to machine) are not counted against a call.
  """

  def __init__(self, fn: Callable[..., float], warmup_args: Optional[tuple],
               memory_limit_bytes: Optional[int] = None):
    self._fn = fn
    if warmup_args is not None:
      try:
        fn(*warmup_args)
      except Exception:  # pylint: disable=broad-except
        pass
    self.address_space_limit = (None if memory_limit_bytes is None
                                else limit_address_space(memory_limit_bytes))

  def score(self, *args) -> float:
    return float(self._fn(*args))


class _ProcessSlot:
  """A persistent child process running `fn` (a `ChildProcess`, see there why not multiprocessing);
  killed on timeout, death or a MemoryError (its heap may be left fragmented), restarted on the next
  call. Calls answer (status, value) with status "ok", "error", "timeout" or "memory"."""

  def __init__(self, fn: Callable[..., float], warmup_args: Optional[tuple],
               start_timeout_s: float, memory_limit_bytes: Optional[int] = None):
    self._args = (fn, warmup_args, memory_limit_bytes)
    self._start_timeout_s = start_timeout_s
    self._child: Optional[ChildProcess] = None
    self.starts = 0

  def _start(self) -> None:
    """Starts the child; raises RuntimeError when it does not come up."""
    self.starts += 1
    try:
      self._child = ChildProcess(f"{__name__}:_RewardServer", self._args,
                                 startup_timeout_s=self._start_timeout_s, name="reward worker")
    except TimeoutError as e:
      raise RuntimeError(str(e)) from e

  def alive(self) -> bool:
    return self._child is not None and self._child.is_alive()

  def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
    if not self.alive():
      self.kill()
      try:
        self._start()
      except Exception as e:  # pylint: disable=broad-except
        return "error", str(e)
    try:
      return "ok", self._child.call("score", args, timeout_s)
    except ChildTimeout:
      self.kill()
      return "timeout", None
    except ChildDied as e:
      self.kill()
      return "error", str(e)
    except MemoryError as e:  # raised by fn in the child, over its address-space limit
      self.kill()
      return "memory", str(e).split("\n", 1)[0][:200] or "MemoryError"
    except Exception as e:  # pylint: disable=broad-except
      return "error", repr(e)[:500]  # raised by fn in the child: the child keeps serving

  def kill(self) -> None:
    if self._child is not None:
      self._child.kill()
    self._child = None

  def close(self) -> None:
    if self._child is not None:
      self._child.close(timeout_s=1.0)
    self._child = None


class _ThreadSlot:
  """A daemon thread running `fn`; on timeout it is abandoned (it cannot be killed) and replaced.
  `convert` turns a result into the value answered (float: a reward; None: as it is)."""

  def __init__(self, fn, convert: Optional[Callable[[Any], Any]] = float):
    self._fn = fn
    self._convert = convert
    self.starts = 0
    self._spawn()

  def _spawn(self) -> None:
    self._in, self._out = queue.SimpleQueue(), queue.SimpleQueue()
    threading.Thread(target=self._loop, args=(self._in, self._out), daemon=True,
                     name="reward-thread").start()
    self.starts += 1

  def _loop(self, inq, outq) -> None:
    while True:
      args = inq.get()
      if args is None:
        return
      try:
        value = self._fn(*args)
        outq.put(("ok", value if self._convert is None else self._convert(value)))
      except Exception as e:  # pylint: disable=broad-except
        outq.put(("error", repr(e)[:500]))

  def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
    self._in.put(args)
    try:
      return self._out.get(timeout=timeout_s)
    except queue.Empty:
      self._in.put(None)  # the stuck thread exits once its call returns, if ever
      self._spawn()
      return "timeout", None

  def close(self) -> None:
    self._in.put(None)


class SafeReward:
  """Runs `fn(*args) -> float` with a time limit; failures score 0.0 and are counted.

  Args:
    fn: the reward, e.g. `math_verify_reward(completion, answer)`. With backend "process" it must
      be picklable (a module-level function).
    timeout_s: limit per call, seconds of wall time.
    backend: "process" (killable child processes) or "thread" (daemon threads, for cheap rewards).
    num_workers: parallel slots; `score_batch` spreads a batch over them.
    warmup_args: arguments of one call each new worker process makes before accepting work.
    start_timeout_s: how long a starting child process may take.
    memory_limit_gib: backend "process": address space a call may add to its worker [GiB] (an
      RLIMIT_AS of the worker's size after start-up plus this); a call over it scores 0, counts in
      "reward/memory_errors" and the worker is restarted. None: no limit. Ignored by backend
      "thread" (a limit there would cap the whole trainer process).

  Thread-safe: several rollout threads may score at once (each call takes a free slot).
  """

  def __init__(self, fn: Callable[..., float], timeout_s: float = 5.0, backend: str = "process",
               num_workers: int = 1, warmup_args: Optional[tuple] = None,
               start_timeout_s: float = 120.0, memory_limit_gib: Optional[float] = 2.0):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s={timeout_s} must be > 0")
    if memory_limit_gib is not None and not memory_limit_gib > 0:
      raise ValueError(f"memory_limit_gib={memory_limit_gib} must be > 0 [GiB] (None: no limit)")
    memory_limit_bytes = None if memory_limit_gib is None else int(memory_limit_gib * _GIB)
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1")
    if backend == "process":
      if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"backend='process' runs {fn!r} in a fresh interpreter, which cannot import "
                         "__main__: define it in an importable module, or use backend='thread'")
      try:
        pickle.dumps((fn, warmup_args))
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"backend='process' needs a picklable reward function (module-level), "
                         f"got {fn!r}: {e}; or use backend='thread'") from e
      self._slots = [_ProcessSlot(fn, warmup_args, start_timeout_s, memory_limit_bytes)
                     for _ in range(num_workers)]
    elif backend == "thread":
      self._slots = [_ThreadSlot(fn) for _ in range(num_workers)]
    else:
      raise ValueError(f"backend={backend!r}; expected 'process' or 'thread'")
    self.fn, self.timeout_s, self.backend, self.num_workers = fn, timeout_s, backend, num_workers
    self.memory_limit_gib = memory_limit_gib if backend == "process" else None
    self._free: queue.Queue = queue.Queue()
    for slot in self._slots:
      self._free.put(slot)
    self._lock = threading.Lock()
    self._counts = {"reward/calls": 0, "reward/errors": 0, "reward/timeouts": 0,
                    "reward/memory_errors": 0}
    self._dispatch = (concurrent.futures.ThreadPoolExecutor(num_workers, "reward-dispatch")
                      if num_workers > 1 else None)
    self._closed = False

  def try_call(self, *args) -> tuple[str, Any]:
    """One call, not counted: (status, value) with status "ok" (value: the float reward),
    "error" (value: the error text), "timeout" or "memory". For checks at start-up (a reward
    plug-in's warm-up call)."""
    if self._closed:
      raise RuntimeError("SafeReward is closed")
    slot = self._free.get()
    try:
      status, value = slot.call(args, self.timeout_s)
    finally:
      self._free.put(slot)
    if status == "ok" and not math.isfinite(value):
      status, value = "error", f"non-finite reward {value}"
    return status, value

  def __call__(self, *args) -> float:
    """The reward of one call; 0.0 on error, timeout, memory limit or a non-finite value."""
    status, value = self.try_call(*args)
    with self._lock:
      self._counts["reward/calls"] += 1
      if status == "timeout":
        self._counts["reward/timeouts"] += 1
      elif status == "memory":
        self._counts["reward/memory_errors"] += 1
      elif status != "ok":
        self._counts["reward/errors"] += 1
    if status == "ok":
      return value
    name = getattr(self.fn, "__name__", "fn")
    if status == "memory":  # rare (each restarts a worker), so never rate-limited
      absl_logging.warning("reward %s scored 0: over its memory limit of %s GiB (%s); its worker "
                           "is restarted (a run sets the limit with task.reward_memory_gib)", name,
                           self.memory_limit_gib, value)
      return 0.0
    absl_logging.log_every_n_seconds(
        absl_logging.WARNING, "reward %s scored 0 (%s): %s", 30, name, status,
        value if status != "timeout" else f"over {self.timeout_s} s")
    return 0.0

  def score_batch(self, completions: Sequence[str], targets: Sequence[Any]) -> np.ndarray:
    """float32 [N] rewards of `fn(completions[i], targets[i])`, spread over the workers."""
    if len(completions) != len(targets):
      raise ValueError(f"score_batch: {len(completions)} completions but {len(targets)} targets")
    if self._dispatch is None or len(completions) <= 1:
      out = [self(c, t) for c, t in zip(completions, targets)]
    else:
      out = list(self._dispatch.map(self, completions, targets))
    return np.asarray(out, dtype=np.float32).reshape(len(completions))

  def start(self) -> None:
    """Starts the child processes now (otherwise on first use)."""
    for slot in self._slots:
      if isinstance(slot, _ProcessSlot) and not slot.alive():
        slot.kill()
        slot._start()  # pylint: disable=protected-access

  @property
  def counts(self) -> dict[str, int]:
    """Cumulative counters: calls, errors, timeouts, calls over the memory limit, and worker
    restarts (beyond the first start)."""
    with self._lock:
      counts = dict(self._counts)
    counts["reward/restarts"] = sum(max(s.starts - 1, 0) for s in self._slots)
    return counts

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._dispatch is not None:
      self._dispatch.shutdown(wait=True)
    for slot in self._slots:
      slot.close()

  def __enter__(self) -> "SafeReward":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


class SafeScoring:
  """The scoring half of the task interface, for a task holding a `SafeReward` in `self._safe`
  whose function takes (completion, answer)."""

  _safe: SafeReward

  def score_batch(self, completions: Sequence[str], problems: Sequence[Any]) -> np.ndarray:
    """float32 [N] time-limited rewards (errors and timeouts score 0 and are counted)."""
    return self._safe.score_batch(completions, [p.answer for p in problems])

  def reward_metrics(self) -> dict[str, int]:
    return self._safe.counts

  def close(self) -> None:
    self._safe.close()
